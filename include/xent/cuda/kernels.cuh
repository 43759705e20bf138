// The CUDA kernels: a one-CTA prologue (mean normaliser) and the row kernel that every entry point
// runs. Included only by nvcc (cuda/backend.cuh).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "../loss_math.hpp"
#include "../online_lse.hpp"
#include "../options.hpp"
#include "cuda.cuh"
#include "dtype.cuh"
#include "policy.cuh"

// Kernels in a header are instantiated in every translation unit that uses them: hidden visibility
// keeps two shared libraries that both include xent from resolving to each other's copies.
#define XENT_KERNEL __global__ __attribute__((visibility("hidden")))

namespace xent {
namespace cuda_detail {

enum class pass { forward, fused, backward };

constexpr float log2e = 1.4426950408889634f;

/// 2^x on the special-function unit: one MUFU.EX2, ~2 ulp; 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// Class-id or soft targets as the kernel sees them (device pointers).
template <class I>
struct class_ids {
  const I* ids;
  static constexpr bool soft = false;
};
template <class S>
struct soft_probs {
  const S* probs;
  std::int64_t ld;
  static constexpr bool soft = true;
};

/// Everything one launch needs, passed by value.
template <class T, class G, class Tgt>
struct row_args {
  const T* logits;
  std::int64_t ld, rows, cols;
  Tgt targets;
  const float* weights;  ///< null: all 1
  loss_constants k;
  std::int64_t ignore_index;
  reduction reduce;
  // forward outputs (each optional)
  float* loss;
  float* row_loss;
  float* lse_out;
  std::int64_t* argmax;
  std::int64_t* num_correct;
  // backward input and gradient
  const float* lse_in;
  G* grad;
  std::int64_t grad_ld;
  float scale;
  const float* scale_ptr;
  const float* up_rows;
  // bookkeeping
  void* workspace;
  int* error_count;
  int cluster;
  std::int64_t slice;
  bool want_argmax;
};

/// A row's statistics from one CTA, merged across threads, then across the CTAs of a cluster.
struct cta_partial {
  row_partial stats;
  argmax_state best;
  __device__ void merge(const cta_partial& o) {
    stats.merge(o.stats);
    best.merge(o.best);
  }
};

struct merge_op {
  __device__ cta_partial operator()(cta_partial a, const cta_partial& b) const {
    a.merge(b);
    return a;
  }
};

__device__ __forceinline__ workspace_header* header(void* ws) {
  return static_cast<workspace_header*>(ws);
}

/// The mean's normaliser W = sum of w[y] over rows not ignored and in range (N for soft targets)
/// and sum_c w_c, in double, and the reset of the rows-done counter. One CTA; runs before the row
/// kernel.
template <int Block, class Tgt>
XENT_KERNEL void prepare_kernel(Tgt targets, std::int64_t rows, std::int64_t cols,
                                std::int64_t ignore_index, const float* weights, void* ws) {
  double w = 0.0;
  if constexpr (Tgt::soft) {
    w = threadIdx.x == 0 ? static_cast<double>(rows) : 0.0;
  } else {
    for (std::int64_t n = threadIdx.x; n < rows; n += Block) {
      const std::int64_t y = static_cast<std::int64_t>(targets.ids[n]);
      if (y != ignore_index && y >= 0 && y < cols) w += weights ? weights[y] : 1.0;
    }
  }
  double wsum = 0.0;
  if (weights)
    for (std::int64_t c = threadIdx.x; c < cols; c += Block) wsum += weights[c];
  using reduce_t = cub::BlockReduce<double, Block>;
  __shared__ typename reduce_t::TempStorage tmp;
  const double total = reduce_t(tmp).Sum(w);
  __syncthreads();  // tmp is reused
  const double total_weight = reduce_t(tmp).Sum(wsum);
  if (threadIdx.x == 0) {
    header(ws)->normalizer = total;
    header(ws)->weight_sum = weights ? total_weight : static_cast<double>(cols);
    header(ws)->rows_done = 0;
  }
}

/// Thread-local view of one tile: `loads` accesses of `vec` elements, in registers. Offsets
/// inside a tile are 32-bit (a tile is at most a few thousand elements); the tile's base is 64-bit.
template <class Cfg, class T>
struct tile_regs {
  vec_t<T, Cfg::vec> v[Cfg::loads];

  /// Offset of access i of this thread from the tile's base.
  __device__ static int offset(int i) {
    return (i * Cfg::block + static_cast<int>(threadIdx.x)) * Cfg::vec;
  }

  /// Loads the first `count` elements of the tile at x; later elements are never read.
  __device__ void load(const T* x, int count) {
#pragma unroll
    for (int i = 0; i < Cfg::loads; ++i) {
      const int o = offset(i);
      if (o + Cfg::vec <= count) {
        v[i] = load_vec<T, Cfg::vec>(x + o);
      } else {
#pragma unroll
        for (int e = 0; e < Cfg::vec; ++e)
          if (o + e < count) v[i].v[e] = x[o + e];
      }
    }
  }
};

template <class T>
__device__ __forceinline__ float capped(T raw, const loss_constants& k) {
  const float x = to_float(raw);
  return k.softcap > 0.0f ? k.softcap * tanhf(x * k.inv_softcap) : x;
}

/// w_c t'_c for class c of row n (soft targets; class ids use the smoothing term alone).
template <class T, class G, class Tgt>
__device__ __forceinline__ float target_mass(const row_args<T, G, Tgt>& a, std::int64_t n,
                                             std::int64_t c) {
  const float w = a.weights ? a.weights[c] : 1.0f;
  if constexpr (Tgt::soft) {
    return w * (a.k.keep * to_float(a.targets.probs[n * a.targets.ld + c]) + a.k.smooth);
  } else {
    return w * a.k.smooth;
  }
}

/// Statistics of this thread's elements of the tile at `base` (`count` valid): its own max first
/// (registers, no memory), then one exponential per element relative to it; the side sums the
/// options need ride along.
template <class Cfg, class T, class G, class Tgt>
__device__ void tile_stats(const row_args<T, G, Tgt>& a, const tile_regs<Cfg, T>& t, std::int64_t n,
                           std::int64_t base, int count, cta_partial& acc) {
  float m = -HUGE_VALF;
#pragma unroll
  for (int i = 0; i < Cfg::loads; ++i) {
#pragma unroll
    for (int e = 0; e < Cfg::vec; ++e) {
      if (t.offset(i) + e < count) {
        const float z = capped(t.v[i].v[e], a.k);
        m = (z > m || z != z) ? z : m;  // NaN sticks, so it reaches the sum
      }
    }
  }
  const float shift = m == -HUGE_VALF ? 0.0f : m * log2e;
  float s = 0.0f, dot = 0.0f, mass = 0.0f, best = -HUGE_VALF;
  int best_at = -1;
  const bool side = Tgt::soft || a.k.smooth != 0.0f;
#pragma unroll
  for (int i = 0; i < Cfg::loads; ++i) {
#pragma unroll
    for (int e = 0; e < Cfg::vec; ++e) {
      const int o = t.offset(i) + e;
      if (o < count) {
        const float z = capped(t.v[i].v[e], a.k);
        s += fast_exp2(fmaf(z, log2e, -shift));
        if (side) {
          if constexpr (Tgt::soft) {
            const float wt = target_mass(a, n, base + o);
            mass += wt;
            dot += wt * z;
          } else {
            dot += (a.weights ? a.weights[base + o] : 1.0f) * z;
          }
        }
        // Offsets grow with i and e, so a strict comparison keeps the first maximum.
        if (a.want_argmax && argmax_state::greater(z, best)) {
          best = z;
          best_at = o;
        }
      }
    }
  }
  acc.stats.lse.merge(online_lse::of_block(m, s));
  acc.stats.dot += dot;
  acc.stats.mass += mass;
  if (best_at >= 0) {
    argmax_state here;
    here.value = best;
    here.index = base + best_at;
    acc.best.merge(here);
  }
}

/// Gradient of this thread's elements of the tile at `base`, written to out; the target class
/// takes `target_grad` (formed once per row, in float, by class_target_gradient), and each vector
/// is stored once.
template <class Cfg, class T, class G, class Tgt>
__device__ void tile_gradient(const row_args<T, G, Tgt>& a, const tile_regs<Cfg, T>& t,
                              std::int64_t n, std::int64_t base, int count, std::int64_t y,
                              float target_grad, float lse, float alpha, float g, G* out) {
  const float ga = g * alpha;
  const float shift = lse * log2e;
  const bool plain = !Tgt::soft && a.k.smooth == 0.0f && a.k.softcap == 0.0f;
  const std::int64_t yo = y - base;  // outside [0, count) when the target is elsewhere
#pragma unroll
  for (int i = 0; i < Cfg::loads; ++i) {
    const int o = t.offset(i);
    vec_t<G, Cfg::vec> d;
#pragma unroll
    for (int e = 0; e < Cfg::vec; ++e) {
      const float z = capped(t.v[i].v[e], a.k);
      float r = ga * fast_exp2(fmaf(z, log2e, -shift));
      if (!plain && o + e < count) {
        r -= g * target_mass(a, n, base + o + e);
        if (a.k.softcap > 0.0f) r *= 1.0f - (z * a.k.inv_softcap) * (z * a.k.inv_softcap);
      }
      if (o + e == yo) r = target_grad;
      d.v[e] = from_float<G>(r);
    }
    if (o + Cfg::vec <= count) {
      store_vec<G, Cfg::vec>(out + base + o, d);
    } else {
#pragma unroll
      for (int e = 0; e < Cfg::vec; ++e)
        if (o + e < count) out[base + o + e] = d.v[e];
    }
  }
}

/// Block-wide merge, then (sm_90, cluster > 1) the cluster-wide merge through distributed shared
/// memory: every CTA merges the cluster's partials in rank order, so all CTAs of a row agree
/// bit for bit and the result does not depend on timing.
template <int Block>
__device__ cta_partial reduce_row(const cta_partial& mine, int cluster_size) {
  using reduce_t = cub::BlockReduce<cta_partial, Block>;
  __shared__ typename reduce_t::TempStorage tmp;
  __shared__ cta_partial slot;
  __shared__ cta_partial result;
  const cta_partial block = reduce_t(tmp).Reduce(mine, merge_op{});
  if (threadIdx.x == 0) slot = block;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster_size > 1) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every CTA's slot is written
    if (threadIdx.x == 0) {
      cta_partial r = *cluster.map_shared_rank(&slot, 0);
      for (int rank = 1; rank < cluster_size; ++rank)
        r.merge(*cluster.map_shared_rank(&slot, rank));
      result = r;
    }
    cluster.sync();  // no CTA rewrites its slot (next row) or exits while another still reads it
    return result;
  }
#endif
  (void)cluster_size;
  __syncthreads();  // slot is visible to the whole block
  const cta_partial r = slot;
  __syncthreads();  // nobody overwrites slot (next row) before everyone has read it
  return r;
}

/// Adds this row's loss and correctness to the workspace; the CTA that finishes the last row sums
/// them in a fixed order (deterministic), writes the reduced loss and resets the counter.
template <int Block, class T, class G, class Tgt>
__device__ void finish_reduction(const row_args<T, G, Tgt>& a, std::int64_t n, float loss,
                                 bool correct) {
  __shared__ bool last;
  const workspace_layout layout(a.rows);
  char* ws = static_cast<char*>(a.workspace);
  float* losses = reinterpret_cast<float*>(ws + layout.row_loss);
  unsigned char* flags = reinterpret_cast<unsigned char*>(ws + layout.correct);
  if (threadIdx.x == 0) {
    losses[n] = loss;
    flags[n] = correct ? 1 : 0;
    __threadfence();  // the row's entries are visible before the count says so
    last = atomicAdd(&header(a.workspace)->rows_done, 1u) == static_cast<unsigned>(a.rows - 1);
  }
  __syncthreads();  // `last` is visible
  if (!last) return;
  __threadfence();
  double sum = 0.0;
  long long hits = 0;
  for (std::int64_t r = threadIdx.x; r < a.rows; r += Block) {
    sum += static_cast<double>(__ldcg(losses + r));  // L2: written by other SMs
    hits += __ldcg(reinterpret_cast<const char*>(flags) + r);
  }
  using dreduce = cub::BlockReduce<double, Block>;
  using lreduce = cub::BlockReduce<long long, Block>;
  __shared__ typename dreduce::TempStorage dtmp;
  __shared__ typename lreduce::TempStorage ltmp;
  const double total = dreduce(dtmp).Sum(sum);
  const long long total_hits = lreduce(ltmp).Sum(hits);
  if (threadIdx.x == 0) {
    if (a.loss) {
      const double w = a.reduce == reduction::mean ? header(a.workspace)->normalizer : 1.0;
      *a.loss = static_cast<float>(total / w);
    }
    if (a.num_correct) *a.num_correct = total_hits;
    header(a.workspace)->rows_done = 0;
  }
}

/// The upstream gradient of row n (see xent::upstream), formed in double and rounded once.
template <class T, class G, class Tgt>
__device__ float row_scale(const row_args<T, G, Tgt>& a, std::int64_t n) {
  double g = a.scale;
  if (a.reduce == reduction::none) {
    if (a.up_rows) g *= a.up_rows[n];
    return static_cast<float>(g);
  }
  if (a.scale_ptr) g *= *a.scale_ptr;
  if (a.reduce == reduction::mean) g /= header(a.workspace)->normalizer;
  return static_cast<float>(g);
}

/// The row kernel. Grid (cluster, rows in flight); the CTAs of one cluster share a row, CTA `rank`
/// owning elements [rank * slice, (rank + 1) * slice). A row that fits the cluster's registers is
/// read once; longer ones re-read their tiles in the gradient sweep.
template <class Cfg, pass P, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Cfg::block, Cfg::min_blocks) row_kernel(row_args<T, G, Tgt> a) {
  if (a.weights && a.k.smooth != 0.0f)
    a.k.weight_sum = static_cast<float>(header(a.workspace)->weight_sum);
  const int rank = static_cast<int>(blockIdx.x);
  const std::int64_t v0 = rank * a.slice;
  const std::int64_t v1 = v0 + a.slice < a.cols ? v0 + a.slice : a.cols;
  const std::int64_t tiles = v1 > v0 ? (v1 - v0 + Cfg::tile - 1) / Cfg::tile : 0;
  const bool need_reduce = a.workspace && (a.loss || a.num_correct) && P != pass::backward;
  constexpr bool want_grad = P != pass::forward;
  // Backward needs statistics only for soft targets (their mass); the LSE comes from forward.
  constexpr bool want_stats = P != pass::backward || Tgt::soft;
  tile_regs<Cfg, T> t;

  for (std::int64_t n = blockIdx.y; n < a.rows; n += gridDim.y) {
    const T* x = a.logits + n * a.ld;
    G* out = want_grad ? a.grad + n * a.grad_ld : nullptr;
    std::int64_t y = -1;
    bool ignored = false, invalid = false;
    if constexpr (!Tgt::soft) {
      y = static_cast<std::int64_t>(a.targets.ids[n]);
      ignored = y == a.ignore_index;
      invalid = !ignored && (y < 0 || y >= a.cols);
    }
    if (ignored || invalid) {  // not read; a zero gradient; no cluster exchange needed
      if (rank == 0 && threadIdx.x == 0) {
        const float v = invalid ? NAN : 0.0f;
        if (P != pass::backward) {
          if (a.row_loss) a.row_loss[n] = v;
          if (a.lse_out) a.lse_out[n] = v;
          if (a.argmax) a.argmax[n] = -1;
        }
        if (invalid && a.error_count) atomicAdd(a.error_count, 1);
      }
      if (want_grad)
        for (std::int64_t c = v0 + threadIdx.x; c < v1; c += Cfg::block)
          out[c] = from_float<G>(0.0f);
      if (need_reduce && rank == 0) finish_reduction<Cfg::block>(a, n, invalid ? NAN : 0.0f, false);
      continue;
    }

    cta_partial part;
    if constexpr (!Tgt::soft) {
      if (want_stats && threadIdx.x == 0 && y >= v0 && y < v1)
        part.stats.target_logit = capped(x[y], a.k);
    }
    if (want_stats) {
      for (std::int64_t i = 0; i < tiles; ++i) {
        const std::int64_t base = v0 + i * Cfg::tile;
        const int count = static_cast<int>(v1 - base < Cfg::tile ? v1 - base : Cfg::tile);
        t.load(x + base, count);
        tile_stats(a, t, n, base, count, part);
      }
    }
    const cta_partial row = want_stats ? reduce_row<Cfg::block>(part, a.cluster) : part;

    float lse;
    if constexpr (P == pass::backward) {
      lse = a.lse_in[n];
    } else {
      lse = row.stats.lse.lse();
    }
    float mass;
    if constexpr (Tgt::soft) {
      mass = row.stats.mass;
    } else {
      mass = class_target_mass(a.weights ? a.weights[y] : 1.0f, a.k);
    }

    if constexpr (P != pass::backward) {
      float loss;
      if constexpr (Tgt::soft) {
        loss = soft_row_loss(row.stats, a.k);
      } else {
        loss = class_row_loss(row.stats, a.weights ? a.weights[y] : 1.0f, a.k);
      }
      if (rank == 0 && threadIdx.x == 0) {
        if (a.row_loss) a.row_loss[n] = loss;
        if (a.lse_out) a.lse_out[n] = lse;
        if (a.argmax) a.argmax[n] = row.best.index;
      }
      if (need_reduce && rank == 0) finish_reduction<Cfg::block>(a, n, loss, row.best.index == y);
    }

    if constexpr (want_grad) {
      const float g = row_scale(a, n);
      const float alpha = gradient_alpha(mass, lse, a.k);
      float target_grad = 0.0f;
      if constexpr (!Tgt::soft) {
        // z_y: merged from the statistics, or read back (backward reads the row only here).
        const float z_y = want_stats ? row.stats.target_logit : capped(x[y], a.k);
        target_grad =
            class_target_gradient(z_y, a.weights ? a.weights[y] : 1.0f, alpha, lse, g, a.k);
      }
      for (std::int64_t i = 0; i < tiles; ++i) {
        const std::int64_t base = v0 + i * Cfg::tile;
        const int count = static_cast<int>(v1 - base < Cfg::tile ? v1 - base : Cfg::tile);
        // A row held in registers is not read again; a longer one re-reads the tile from L2.
        if (tiles > 1 || !want_stats) t.load(x + base, count);
        tile_gradient(a, t, n, base, count, y, target_grad, lse, alpha, g, out);
      }
    }
  }
}

}  // namespace cuda_detail
}  // namespace xent
