// The CUDA kernels: a one-CTA prologue (mean normaliser) and the row kernel that every entry point
// runs. Included only by nvcc (cuda/backend.cuh).
#pragma once

#include <cooperative_groups.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <cub/block/block_reduce.cuh>
#include <type_traits>

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
  std::int64_t slice;       ///< classes per CTA
  std::int64_t chunk;       ///< classes per shared-memory stage
  std::int64_t chunks;      ///< stages per slice: 1 = the slice is resident
  std::size_t chunk_bytes;  ///< bytes per stage (16-byte multiple)
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

/// The soft-capped logit. `Plain` kernels (no softcap, no label smoothing, class ids) are compiled
/// without the option paths, so their inner loops are the bare conversion, exponential and store.
template <bool Plain = false, class T>
__device__ __forceinline__ float capped(T raw, const loss_constants& k) {
  if constexpr (Plain) return to_float(raw);
  return apply_softcap(to_float(raw), k);
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

/// A count known at compile time (std::integral_constant's conversion is host-only under nvcc).
template <int N>
struct fixed_count {
  __host__ __device__ constexpr operator int() const { return N; }  // NOLINT
};

/// Calls f(offset, v, valid) for this thread's vectors of a staged chunk of `count` elements
/// (vectors tid, tid + Block, ...). Whole vectors pass `valid` as a fixed_count, so the
/// per-element bound checks vanish from the loop body; only the chunk's last vector checks.
template <int Block, int Vec, class T, class F>
__device__ __forceinline__ void for_each_vector(const T* chunk, int count, F&& f) {
  const int whole = count / Vec;
  // Not unrolled: warps, not in-thread parallelism, hide shared-memory latency here.
#pragma unroll 1
  for (int j = threadIdx.x; j < whole; j += Block)
    f(j * Vec, load_vec<T, Vec>(chunk + j * Vec), fixed_count<Vec>{});
  if (count % Vec != 0 && static_cast<int>(threadIdx.x) == whole % Block)
    f(whole * Vec, load_vec<T, Vec>(chunk + whole * Vec), count % Vec);
}

/// Statistics of this thread's elements of a chunk staged in shared memory (`count` elements from
/// class `base`): its own max first (a sweep over shared memory, no HBM), then one exponential
/// per element relative to it. The side sums (soft targets, label smoothing) and the argmax each
/// take a sweep of their own, only when asked for, so the common sweeps stay lean.
template <int Block, int Vec, bool Plain, class T, class G, class Tgt>
__device__ void chunk_stats(const row_args<T, G, Tgt>& a, const T* chunk, std::int64_t n,
                            std::int64_t base, int count, cta_partial& acc) {
  float m = -HUGE_VALF;
  for_each_vector<Block, Vec>(chunk, count, [&](int, const vec_t<T, Vec>& v, auto valid) {
#pragma unroll
    for (int e = 0; e < Vec; ++e)  // fmaxf passes over NaN; the sum below still meets it
      if (e < valid) m = fmaxf(m, capped<Plain>(v.v[e], a.k));
  });
  const float shift = m == -HUGE_VALF ? 0.0f : m * log2e;
  float s0 = 0.0f, s1 = 0.0f;  // two chains of additions, for latency
  for_each_vector<Block, Vec>(chunk, count, [&](int, const vec_t<T, Vec>& v, auto valid) {
#pragma unroll
    for (int e = 0; e < Vec; ++e) {
      if (e < valid) {
        const float p = fast_exp2(fmaf(capped<Plain>(v.v[e], a.k), log2e, -shift));
        if (e % 2)
          s1 += p;
        else
          s0 += p;
      }
    }
  });
  acc.stats.lse.merge(online_lse::of_block(m, s0 + s1));
  if (!Plain && (Tgt::soft || a.k.smooth != 0.0f)) {
    float dot = 0.0f, mass = 0.0f;
    for_each_vector<Block, Vec>(chunk, count, [&](int o, const vec_t<T, Vec>& v, auto valid) {
#pragma unroll
      for (int e = 0; e < Vec; ++e) {
        if (e < valid) {
          const float z = capped<Plain>(v.v[e], a.k);
          if constexpr (Tgt::soft) {
            const float wt = target_mass(a, n, base + o + e);
            mass += wt;
            dot += wt * z;
          } else {
            dot += (a.weights ? a.weights[base + o + e] : 1.0f) * z;
          }
        }
      }
    });
    acc.stats.dot += dot;
    acc.stats.mass += mass;
  }
  if (a.want_argmax) {
    float best = -HUGE_VALF;
    int best_at = -1;
    for_each_vector<Block, Vec>(chunk, count, [&](int o, const vec_t<T, Vec>& v, auto valid) {
#pragma unroll
      for (int e = 0; e < Vec; ++e) {  // offsets only grow: strict > keeps the first maximum
        const float z = capped<Plain>(v.v[e], a.k);
        if (e < valid && argmax_state::greater(z, best)) {
          best = z;
          best_at = o + e;
        }
      }
    });
    if (best_at >= 0) {
      argmax_state here;
      here.value = best;
      here.index = base + best_at;
      acc.best.merge(here);
    }
  }
}

/// Gradient of this thread's elements of a staged chunk, stored to `out` (the row of grad), one
/// 16-byte store per whole vector. The target class gets `target_grad` (formed once per row, in
/// float) from the thread that stored its vector, right after that store, so program order makes
/// it the final value and the sweep itself carries no per-element test.
template <int Block, int Vec, bool Plain, class T, class G, class Tgt>
__device__ void chunk_gradient(const row_args<T, G, Tgt>& a, const T* chunk, std::int64_t n,
                               std::int64_t base, int count, std::int64_t y, float target_grad,
                               float lse, float alpha, float g, G* out) {
  const float ga = g * alpha;
  const float shift = lse * log2e;
  const bool plain = Plain || (!Tgt::soft && a.k.smooth == 0.0f && a.k.softcap == 0.0f);
  out += base;
  for_each_vector<Block, Vec>(chunk, count, [&](int o, const vec_t<T, Vec>& v, auto valid) {
    vec_t<G, Vec> d;
#pragma unroll
    for (int e = 0; e < Vec; ++e) {
      const float z = capped<Plain>(v.v[e], a.k);
      float r = ga * fast_exp2(fmaf(z, log2e, -shift));
      if (!plain && e < valid) {
        r -= g * target_mass(a, n, base + o + e);
        if (a.k.softcap > 0.0f) r *= 1.0f - (z * a.k.inv_softcap) * (z * a.k.inv_softcap);
      }
      d.v[e] = from_float<G>(r);
    }
    if constexpr (std::is_same<decltype(valid), fixed_count<Vec>>::value && Vec * sizeof(G) == 16) {
      store_vec<G, Vec>(out + o, d);
    } else {
#pragma unroll
      for (int e = 0; e < Vec; ++e)
        if (e < valid) out[o + e] = d.v[e];
    }
  });
  const std::int64_t yo = y - base;
  if (yo >= 0 && yo < count && static_cast<int>(threadIdx.x) == (yo / Vec) % Block)
    out[yo] = from_float<G>(target_grad);
}

/// Copies `count` elements of a row into a shared-memory stage without waiting: 16-byte
/// cp.async accesses when rows are aligned (the last vector zero-filled past the row's end, so
/// nothing outside the row is read), plain loads otherwise.
/// cp.async of 16 bytes of which the first `src_bytes` are read and the rest zero-filled; the
/// source size in a register (the intrinsic's constant form branches per vector).
__device__ __forceinline__ void copy16_async(void* dst, const void* src, int src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes)
               : "memory");
}

template <int Block, int Vec, class T>
__device__ void stage_chunk(T* stage, const T* src, int count) {
  if constexpr (Vec * sizeof(T) == 16) {
    const int vectors = (count + Vec - 1) / Vec;
#pragma unroll 1
    for (int j = threadIdx.x; j < vectors; j += Block) {
      const int valid = count - j * Vec < Vec ? count - j * Vec : Vec;
      copy16_async(stage + j * Vec, src + j * Vec, valid * static_cast<int>(sizeof(T)));
    }
  } else {
    for (int j = threadIdx.x; j < count; j += Block) stage[j] = src[j];
  }
}
/// Exchanges a trivially copyable partial with the lane `mask` away, word by word.
template <class P>
__device__ __forceinline__ P shuffle_xor(const P& v, int mask) {
  static_assert(sizeof(P) % 4 == 0, "partials are whole words");
  int w[sizeof(P) / 4];
  memcpy(w, &v, sizeof(P));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(P) / 4); ++i)
    w[i] = __shfl_xor_sync(0xffffffffu, w[i], mask);
  P r;
  memcpy(&r, w, sizeof(P));
  return r;
}

/// Butterfly merge over the lanes of a warp: every lane ends with the merge of all 32, and since
/// a merge is commutative bit for bit (max, and sums of two terms), all lanes agree.
__device__ __forceinline__ cta_partial warp_merge(cta_partial v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v.merge(shuffle_xor(v, mask));
  return v;
}

/// Where the CTAs of a cluster meet once per row: a slot per rank for each parity, and for each
/// parity an mbarrier that completes when every rank's partial has landed in this CTA.
struct cluster_exchange {
  cta_partial slots[2][policy::cluster_max];
  unsigned long long arrived[2];
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

/// Sets up the exchange's mbarriers (one arrival per phase: this CTA's own expect_tx) and makes
/// them visible to the cluster before any CTA may signal them. Every thread calls it once.
__device__ inline void init_exchange(cluster_exchange& x) {
  if (threadIdx.x == 0) {
    for (int p = 0; p < 2; ++p)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&x.arrived[p]))
                   : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cooperative_groups::this_cluster().sync();  // once per launch, not per row
}

/// Lane `rank_to` of warp 0 sends this CTA's partial into slot `from` of CTA `to`: st.async
/// stores into the remote shared memory that count their bytes on the remote mbarrier, so the
/// receiver learns of them without a cluster barrier or a memory fence.
__device__ inline void send_partial(cluster_exchange& x, int parity, const cta_partial& v, int from,
                                    int to) {
  unsigned slot = shared_address(&x.slots[parity][from]);
  unsigned mbar = shared_address(&x.arrived[parity]);
  asm volatile("mapa.shared::cluster.u32 %0, %0, %1;" : "+r"(slot) : "r"(to));
  asm volatile("mapa.shared::cluster.u32 %0, %0, %1;" : "+r"(mbar) : "r"(to));
  unsigned w[sizeof(cta_partial) / 4];
  memcpy(w, &v, sizeof(cta_partial));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(cta_partial) / 4); ++i)
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                     slot + 4 * i),
                 "r"(w[i]), "r"(mbar)
                 : "memory");
}

/// Arms this CTA's mbarrier for `bytes` incoming and waits (acquire at cluster scope) for the
/// phase of use `use`.
__device__ inline void await_partials(cluster_exchange& x, int parity, unsigned bytes, int use) {
  const unsigned mbar = shared_address(&x.arrived[parity]);
  asm volatile(
      "{ .reg .b64 state; mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 state, [%0], %1; "
      "}" ::"r"(mbar),
      "r"(bytes)
      : "memory");
  unsigned done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(mbar), "r"(use & 1)
        : "memory");
}
#endif

/// The row's statistics over the CTA and then the cluster, the same bits in every thread of every
/// CTA of the row. Warps merge by shuffles and warp 0 merges the warps. With a cluster (sm_90),
/// lane r of warp 0 pushes the CTA's partial into CTA r's slot (st.async), each CTA waits on its
/// own mbarrier for all ranks' partials and merges them in a fixed tree. Slots and mbarriers
/// alternate with the parity of `exchange` (rows that crossed the cluster so far): a CTA sends
/// into parity p again only after receiving every rank's partial of the row in between, which
/// each rank sends only after it has read its parity-p slots.
template <int Block>
__device__ cta_partial reduce_row(const cta_partial& mine, int cluster_size, int exchange,
                                  cluster_exchange& x) {
  constexpr int warps = Block / 32;
  static_assert(warps <= 32, "one warp merges the warps");
  __shared__ cta_partial warp_parts[warps];
  __shared__ cta_partial result;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const cta_partial w = warp_merge(mine);
  if (lane == 0) warp_parts[warp] = w;
  __syncthreads();  // warp partials are visible to warp 0
  if (warp == 0) {
    const cta_partial block = warp_merge(lane < warps ? warp_parts[lane] : cta_partial{});
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster_size > 1) {
      const int parity = exchange & 1;
      const int rank = static_cast<int>(cooperative_groups::this_cluster().block_rank());
      if (lane < cluster_size) send_partial(x, parity, block, rank, lane);
      if (lane == 0)
        await_partials(x, parity, static_cast<unsigned>(cluster_size * sizeof(cta_partial)),
                       exchange >> 1);
      __syncwarp();  // lane 0 saw the phase complete; its acquire covers the warp after this
      asm volatile("fence.acq_rel.cta;" ::: "memory");
      const cta_partial row =
          warp_merge(lane < cluster_size ? x.slots[parity][lane] : cta_partial{});
      if (lane == 0) result = row;
    } else if (lane == 0) {
      result = block;
    }
#else
    (void)exchange;
    (void)x;
    if (lane == 0) result = block;
#endif
  }
  __syncthreads();  // `result` is visible
  return result;
}

/// Records row n's loss and correctness in the workspace (plain stores; published by
/// finish_reduction's fence).
template <class T, class G, class Tgt>
__device__ void record_row(const row_args<T, G, Tgt>& a, std::int64_t n, float loss, bool correct) {
  const workspace_layout layout(a.rows);
  char* ws = static_cast<char*>(a.workspace);
  reinterpret_cast<float*>(ws + layout.row_loss)[n] = loss;
  reinterpret_cast<unsigned char*>(ws + layout.correct)[n] = correct ? 1 : 0;
}

/// Once per CTA, after its last row: adds its row count to the counter; the CTA that completes it
/// sums every row's entries in a fixed order (deterministic), writes the reduced loss and
/// num_correct, and resets the counter for the next call. One fence and one atomic per CTA, not
/// per row.
template <int Block, class T, class G, class Tgt>
__device__ void finish_reduction(const row_args<T, G, Tgt>& a, unsigned my_rows) {
  __shared__ bool last;
  __syncthreads();  // every record_row of this CTA is issued
  if (threadIdx.x == 0) {
    __threadfence();  // this CTA's entries are visible before the count says so
    const unsigned before = atomicAdd(&header(a.workspace)->rows_done, my_rows);
    last = before + my_rows == static_cast<unsigned>(a.rows);
  }
  __syncthreads();  // `last` is visible
  if (!last) return;
  __threadfence();
  const workspace_layout layout(a.rows);
  const char* ws = static_cast<const char*>(a.workspace);
  const float* losses = reinterpret_cast<const float*>(ws + layout.row_loss);
  const unsigned char* flags = reinterpret_cast<const unsigned char*>(ws + layout.correct);
  double sum = 0.0;
  long long hits = 0;
  for (std::int64_t r = threadIdx.x; r < a.rows; r += Block) {
    sum += static_cast<double>(__ldcg(losses + r));  // from L2: written by other SMs
    hits += __ldcg(reinterpret_cast<const signed char*>(flags) + r);
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

/// The upstream gradient of row n (see xent::upstream), formed in double and rounded once;
/// `scalar` is scale * *scale_ptr / W for mean and sum, read once per launch.
template <class T, class G, class Tgt>
__device__ float row_scale(const row_args<T, G, Tgt>& a, std::int64_t n, double scalar) {
  if (a.reduce == reduction::none)
    return static_cast<float>(a.up_rows ? static_cast<double>(a.scale) * a.up_rows[n] : a.scale);
  return static_cast<float>(scalar);
}

/// The streaming row kernel. Grid (cluster, clusters in flight): the CTAs of one cluster share a
/// row, CTA `rank` owning classes [rank * slice, (rank + 1) * slice), and each cluster walks rows
/// blockIdx.y, + gridDim.y, ... (persistent). A CTA's slice is staged in shared memory in chunks
/// by cp.async, `Stages` deep, so the next row streams in from HBM while this one is reduced and
/// its gradient written. When a slice fits one chunk (resident) the row is read from HBM once;
/// otherwise the gradient sweep stages each chunk again.
///
/// The work of a cluster is a sequence of items, `per_row` per row: `chunks` statistics items then
/// `chunks` gradient items (one item each way when resident; backward of class ids has only
/// gradient items). Item k is staged at iteration k - (Stages - 1), into stage k % Stages, with
/// the row's target and saved LSE, so no iteration waits on a dependent global load.
template <int Block, int Vec, int Stages, bool Plain, pass P, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Block, policy::min_blocks) stream_kernel(row_args<T, G, Tgt> a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ std::int64_t stage_target[Stages];
  __shared__ float stage_lse[Stages];
  if (a.weights && a.k.smooth != 0.0f)
    a.k.weight_sum = static_cast<float>(header(a.workspace)->weight_sum);
  // The scalar upstream gradient (scale * *scale_ptr / W), once per launch.
  // The workspace (and its normaliser) exists only when a mean needs it.
  const double scalar =
      a.reduce != reduction::none && P != pass::forward
          ? scalar_upstream(a.scale, a.scale_ptr, a.reduce,
                            a.reduce == reduction::mean ? header(a.workspace)->normalizer : 1.0)
          : 0.0;
  const int rank = static_cast<int>(blockIdx.x);
  const std::int64_t v0 = rank * a.slice;
  const std::int64_t v1 = v0 + a.slice < a.cols ? v0 + a.slice : a.cols;
  const int chunks = static_cast<int>(a.chunks);
  const bool resident = chunks == 1;
  constexpr bool want_grad = P != pass::forward;
  // Backward needs statistics only for soft targets (their mass); the LSE comes from forward.
  constexpr bool want_stats = P != pass::backward || Tgt::soft;
  const int stat_items = want_stats ? chunks : 0;
  const int per_row = resident ? 1 : stat_items + (want_grad ? chunks : 0);
  const std::int64_t my_rows =
      a.rows > blockIdx.y ? (a.rows - blockIdx.y + gridDim.y - 1) / gridDim.y : 0;
  const std::int64_t items = my_rows * per_row;
  const bool need_reduce = a.workspace && (a.loss || a.num_correct) && P != pass::backward;
  auto stage = [&](std::int64_t k) {
    return reinterpret_cast<T*>(smem + static_cast<std::size_t>(k % Stages) * a.chunk_bytes);
  };
  auto row_of = [&](std::int64_t k) { return blockIdx.y + (k / per_row) * gridDim.y; };
  auto chunk_span = [&](int c, std::int64_t& base, int& count) {
    base = v0 + static_cast<std::int64_t>(c) * a.chunk;
    const std::int64_t rest = v1 - base;
    count = static_cast<int>(rest < a.chunk ? (rest > 0 ? rest : 0) : a.chunk);
  };
  // Issues item k's copies (or none) and always commits a group, so group counts stay uniform.
  // Ignored rows are copied too: knowing that first would put a dependent load before the copy.
  auto issue = [&](std::int64_t k) {
    if (k < items) {
      const std::int64_t n = row_of(k);
      const int j = static_cast<int>(k % per_row);
      std::int64_t base;
      int count;
      chunk_span(resident ? 0 : j % chunks, base, count);
      stage_chunk<Block, Vec>(stage(k), a.logits + n * a.ld + base, count);
      if (threadIdx.x == 0 && j == 0) {
        if constexpr (!Tgt::soft) {
          if constexpr (sizeof(*a.targets.ids) == 8) {
            __pipeline_memcpy_async(&stage_target[k % Stages], a.targets.ids + n, 8);
          } else {
            __pipeline_memcpy_async(reinterpret_cast<std::int32_t*>(&stage_target[k % Stages]),
                                    a.targets.ids + n, 4);
          }
        }
        if constexpr (P == pass::backward)
          __pipeline_memcpy_async(&stage_lse[k % Stages], a.lse_in + n, 4);
      }
    }
    __pipeline_commit();
  };

  for (int k = 0; k < Stages - 1; ++k) issue(k);
  cta_partial part;
  float lse = 0.0f, mass = 0.0f, g = 0.0f, alpha = 0.0f, target_grad = 0.0f, loss = 0.0f;
  std::int64_t y = -1;
  bool skip = false, invalid = false;
  int exchanges = 0;  // rows whose statistics crossed the cluster
  // Raw storage: shared memory takes no initialiser (the mbarriers are set up by init_exchange).
  __shared__ alignas(cluster_exchange) unsigned char exchange_bytes[sizeof(cluster_exchange)];
  cluster_exchange& exchange = *reinterpret_cast<cluster_exchange*>(exchange_bytes);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (a.cluster > 1 && want_stats) init_exchange(exchange);
#endif
  for (std::int64_t k = 0; k < items; ++k) {
    // Copies issued so far reach item k + Stages - 2: waiting for all but Stages - 2 of them
    // lands item k. One barrier then serves twice: item k is visible to every thread, and every
    // thread is done with item k - 1, whose stage the next copy refills.
    __pipeline_wait_prior(Stages - 2);
    __syncthreads();
    issue(k + Stages - 1);
    const std::int64_t n = row_of(k);
    const int j = static_cast<int>(k % per_row);
    const T* chunk = stage(k);
    if (j == 0) {  // a new row
      part = cta_partial{};
      if constexpr (!Tgt::soft) {
        y = stage_target[k % Stages];
        if (sizeof(*a.targets.ids) == 4) y = static_cast<std::int32_t>(y & 0xffffffff);
        skip = y == a.ignore_index || y < 0 || y >= a.cols;
        invalid = skip && y != a.ignore_index;
      }
      if constexpr (P == pass::backward) lse = stage_lse[k % Stages];
    }
    if (skip) {  // ignored or out of range: zero gradient, NaN loss if out of range
      if (j == 0) {
        if (rank == 0 && threadIdx.x == 0) {
          const float v = invalid ? NAN : 0.0f;
          if (P != pass::backward) {
            if (a.row_loss) a.row_loss[n] = v;
            if (a.lse_out) a.lse_out[n] = v;
            if (a.argmax) a.argmax[n] = -1;
            if (need_reduce) record_row(a, n, v, false);
          }
          if (invalid && a.error_count) atomicAdd(a.error_count, 1);
        }
        if (want_grad) {
          G* out = a.grad + n * a.grad_ld;
          for (std::int64_t c = v0 + threadIdx.x; c < v1; c += Block) out[c] = from_float<G>(0.0f);
        }
      }
      continue;
    }
    const bool stats_item = want_stats && (resident || j < stat_items);
    const bool grad_item = want_grad && (resident || j >= stat_items);
    std::int64_t base;
    int count;
    chunk_span(resident ? 0 : j % chunks, base, count);
    if (stats_item) {
      if constexpr (!Tgt::soft) {
        if (threadIdx.x == 0 && y >= base && y < base + count)
          part.stats.target_logit = capped(chunk[y - base], a.k);
      }
      chunk_stats<Block, Vec, Plain>(a, chunk, n, base, count, part);
    }
    const bool last_stats = want_stats ? (resident || j == stat_items - 1) : j == 0;
    if (last_stats) {  // the row's statistics are complete: merge them, form the loss
      const cta_partial row =
          want_stats ? reduce_row<Block>(part, a.cluster, exchanges++, exchange) : part;
      if constexpr (P != pass::backward) lse = row.stats.lse.lse();
      const float w_y = !Tgt::soft && a.weights ? a.weights[y] : 1.0f;
      if constexpr (Tgt::soft) {
        mass = row.stats.mass;
      } else {
        mass = class_target_mass(w_y, a.k);
      }
      if constexpr (P != pass::backward) {
        if constexpr (Tgt::soft) {
          loss = soft_row_loss(row.stats, a.k);
        } else {
          loss = class_row_loss(row.stats, w_y, a.k);
        }
        if (rank == 0 && threadIdx.x == 0) {
          if (a.row_loss) a.row_loss[n] = loss;
          if (a.lse_out) a.lse_out[n] = lse;
          if (a.argmax) a.argmax[n] = row.best.index;
          if (need_reduce) record_row(a, n, loss, row.best.index == y);
        }
      }
      if constexpr (want_grad) {
        g = row_scale(a, n, scalar);
        alpha = gradient_alpha(mass, lse, a.k);
        if constexpr (!Tgt::soft) {
          // z_y: merged from the statistics, or read back (backward reads the row only here).
          const float z_y =
              want_stats ? row.stats.target_logit : capped(a.logits[n * a.ld + y], a.k);
          target_grad = class_target_gradient(z_y, w_y, alpha, lse, g, a.k);
        }
      }
    }
    if (grad_item)
      chunk_gradient<Block, Vec, Plain>(a, chunk, n, base, count, y, target_grad, lse, alpha, g,
                                        a.grad + n * a.grad_ld);
  }
  __pipeline_wait_prior(0);  // no copy is left in flight at exit
  if (need_reduce && rank == 0) finish_reduction<Block>(a, static_cast<unsigned>(my_rows));
}

}  // namespace cuda_detail
}  // namespace xent
