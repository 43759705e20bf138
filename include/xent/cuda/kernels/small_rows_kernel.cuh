// The small-batch kernel: a batch of a few plain class-id rows (the seed shapes: 32 x 32000 fp32),
// each row's vocabulary split over a thread-block cluster, every CTA holding its slice in
// registers straight from global memory (a few 16-byte vectors per thread) on one straight path:
// load, statistics, one exchange over the cluster's shared memory, the row's outputs, its
// gradient. The row kernel serves such a batch too, but each of its clusters then runs its
// pipeline (stages, mbarriers, the row loop) for a single row from a cold instruction cache: ncu
// on fp32 32 x 32000 (13.9 us) found 1100 instructions per warp, stalled on instruction fetch
// and barriers rather than memory. Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "../../loss_math.hpp"
#include "../block/chunk_stats.cuh"
#include "../block/row_args.cuh"
#include "../block/row_reduce.cuh"
#include "../block/row_sums.cuh"
#include "../block/tile.cuh"
#include "../cuda.cuh"
#include "../tuning/policy.cuh"

namespace xent {
namespace cuda_detail {

#if XENT_CUDA_SM90_PTX
/// Cluster-wide split barrier: arrive with no memory ordering (the mbarriers' initialisation is
/// published by its own fence; the release form costs a MEMBAR.ALL.GPU and an ERRBAR in SASS),
/// and wait (acquire).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

/// The largest of this thread's elements of a slice, over its warp (fmaxf passes over NaN; the
/// exponentials' sum still meets it).
template <class Tile>
__device__ __forceinline__ float tile_warp_max(const Tile& t) {
  float m = -HUGE_VALF;
#pragma unroll
  for (int r = 0; r < Tile::regs; ++r)
#pragma unroll
    for (int e = 0; e < Tile::vec; ++e)
      if (t.has(r) && e < t.valid(r)) m = fmaxf(m, t.value(r, e));
  return warp_max(m);
}

/// This thread's statistics of its vectors of a slice, merged over its warp: the warp's max,
/// then the exponentials relative to it (the row kernel's chunk_stats, without a stage).
template <class Tile>
__device__ __forceinline__ row_partial tile_warp_stats(const Tile& t) {
  const float m = tile_warp_max(t);
  row_partial p;
  p.lse =
      online_lse::of_block(m, warp_sum(tile_exp_sum<false>(t, m == -HUGE_VALF ? 0.0f : m * log2e)));
  return p;
}

/// tile_warp_stats, keeping the exponentials it sums in `x` (tile_exp_sum's keep), so that the
/// gradient takes a multiply per element where it took a second exponential (tile_gradient's
/// exp_tile form). The same sums in the same order, so the statistics keep their bits.
template <class Tile, class Exps>
__device__ __forceinline__ row_partial tile_warp_exps(const Tile& t, Exps& x) {
  const float m = tile_warp_max(t);
  x.count = t.count;
  x.max = m;
  row_partial p;
  p.lse = online_lse::of_block(
      m, warp_sum(tile_exp_sum<false>(t, m == -HUGE_VALF ? 0.0f : m * log2e, &x)));
  return p;
}

/// Element k (inside the tile's count) of a tile of `Block` threads, in every lane of the warp
/// whose thread holds it and 0 in every other warp: a row's target logit out of the registers. The
/// index is the same in every thread, so the pick is a few selects, and the shuffle reads the
/// holder's lane. Read from the logits instead, it was a round trip to L2 that waited for the
/// target id's own load (two cold reads one after the other, where the slice needs one).
template <class Tile>
__device__ __forceinline__ float warp_element(const Tile& t, int k) {
  const int q = k / Tile::vec, r = q / Tile::block, e = k % Tile::vec;
  const int holder = q % Tile::block;
  float z = 0.0f;
  if (Tile::thread() == holder) {
#pragma unroll
    for (int i = 0; i < Tile::regs; ++i)
#pragma unroll
      for (int j = 0; j < Tile::vec; ++j)
        if (i == r && j == e) z = t.value(i, j);
  }
  return __shfl_sync(0xffffffffu, z, holder % 32);
}

/// Where the rows of a small-batch launch start: all 16-byte aligned; or each row's 16-byte
/// boundaries at the same elements of the logits and of the gradient (the same element size, the
/// two starts and leading dimensions equal modulo 16 bytes: any in-place call), where the row is
/// cut; or anywhere (every element loaded and stored alone).
enum class row_start { aligned, shifted, any };

/// The sizes of a small-batch launch as the kernel reads them: from its arguments and grid
/// (call_sizes), or constants (fixed_sizes: a static shape's, views.hpp, whose launch plan was
/// fixed at compile time, launch_small_rows), where each slice's bounds, the cluster's exchange
/// and the loops over the batch's targets fold to constants.
struct call_sizes {
  std::int64_t rows, cols, vocab, slice;
  int cluster;
  template <class A>
  __device__ __forceinline__ explicit call_sizes(const A& a)
      : rows(a.rows),
        cols(a.cols),
        vocab(a.vocab),
        slice(a.slice),
        cluster(static_cast<int>(gridDim.x)) {}
};

/// Rows x Cols logits of an unsharded call (the vocabulary is the columns) in clusters of
/// Cluster CTAs of Slice classes each.
template <std::int64_t Rows, std::int64_t Cols, int Cluster, std::int64_t Slice>
struct fixed_sizes {
  static constexpr std::int64_t rows = Rows, cols = Cols, vocab = Cols, slice = Slice;
  static constexpr int cluster = Cluster;
  template <class A>
  __device__ __forceinline__ explicit fixed_sizes(const A&) {}
};

/// Grid (cluster, rows): CTA `rank` of row blockIdx.y's cluster owns classes [rank * slice,
/// (rank + 1) * slice), or with row_start::shifted, [rank * slice - lead, (rank + 1) * slice -
/// lead) where the row starts `lead` elements past a 16-byte boundary: every CTA's tile starts on
/// a boundary (rank 0's `lead` elements before the row), so only rank 0's first vector and the
/// row's last are read and stored element by element (make_small_plan leaves the room: slices of
/// cols + vec - 1 classes). H200, fused 32 x 50257, the rows 4-byte aligned: fp32 11.1-11.4 us
/// against 12.2 element by element, bf16 10.4 against 19.1 (aligned 32 x 50256: 11.0, 10.2). Plain
/// class-id rows of an unsharded call, forward or fused. Clusters exist from sm_90: below it the
/// kernel is empty, and the dispatcher never launches that build (launch_small_rows asks the
/// binary's version).
///
/// In such a launch the cross-row sum and the mean's normaliser, not the per-element work, were
/// the largest part above a plain read and write of the logits (H100, fp32 fused 32 x 32000: mean
/// 12.3 us, no reduction 10.2). So the row's partials are pushed into every rank's shared memory
/// (row_exchange), rank 0's warp 1 alone sums the normaliser W after its statistics and pushes it
/// on mbarriers that only the gradients wait for, each row's loss goes into a record that one warp
/// polls (row_sums.cuh), and the target's logit comes from the registers (warp_element).
/// docs/design.md's small-batch section has each step's measurement.
template <int Block, int Regs, row_start Start, pass P, class T, class G, class Tgt,
          class Sizes = call_sizes>
XENT_KERNEL void __launch_bounds__(Block) small_rows_kernel(row_args<T, G, Tgt> a) {
  static_assert(!Tgt::soft && P != pass::backward, "class ids, with statistics");
  static_assert(Block >= 64, "warp 1 sums the mean's normaliser");
#if XENT_CUDA_SM90_PTX
  constexpr bool want_grad = P == pass::fused;
  constexpr bool Aligned = Start != row_start::any, Shifted = Start == row_start::shifted;
  const Sizes z(a);
  using exchange_t = row_exchange<row_partial, Block>;
  using exchange_state = row_exchange_state<row_partial, exchange_t::warps>;
  // Raw storage: shared memory takes no initialiser (the mbarriers are set up below).
  __shared__ alignas(exchange_state) unsigned char exchange_bytes[sizeof(exchange_state)];
  exchange_t ex{*reinterpret_cast<exchange_state*>(exchange_bytes), z.cluster};
  __shared__ double rank0_w;  // W as rank 0's warp 1 summed it (other ranks: as it pushed it)
  row_partial total_part;     // the row's, in every thread
  const int rank = static_cast<int>(blockIdx.x);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t n = blockIdx.y;
  const int lead = Shifted ? lead_of(a.logits + n * a.ld) : 0;
  const int my_lead = rank == 0 ? lead : 0;
  const std::int64_t v0 = rank * z.slice - lead, cols = z.cols;
  const std::int64_t v1 = v0 + z.slice < cols ? v0 + z.slice : cols;
  const int count = v1 > v0 ? static_cast<int>(v1 - v0) : 0;
  // The slice is loaded before the row's target is known, skipped row or not: two cold reads one
  // after the other (the target, then the logits it decides on) were the launch's longest chain.
  global_tile<T, Regs, Block> tile;
  // fp32 fused rows keep their statistics' exponentials for the gradient (in the registers the
  // values leave: the target's logit is taken out first); 16-bit ones would need twice the
  // registers of their tile.
  constexpr bool keep_exps = policy::small_exp_once && want_grad && sizeof(T) == 4;
  exp_tile<T, Regs, Block> exps;
  tile.template load<Aligned, Shifted>(a.logits + n * a.ld + v0, count, my_lead);
  // Every rank's mbarrier is set up before anything is pushed to it: the cluster's arrive here,
  // its wait just before the push, with the loads in flight in between.
  if (threadIdx.x == 0) {
    ex.init();
    mbarrier_init_fence();
  }
  cluster_arrive_relaxed();
  const std::int64_t y = static_cast<std::int64_t>(a.targets.ids[n]);
  // The same on every CTA of the row, so a skipped row skips the cluster's exchange everywhere.
  const bool skip = skipped_class(y, a.ignore_index, z.vocab);
  const bool invalid = skip && y != a.ignore_index;
  const float w_y = !skip && a.weights ? a.weights[y] : 1.0f;
  const bool has_target = !skip && y >= v0 && y < v1;  // the same in the whole CTA
  const bool need_reduce = a.workspace && (a.loss || a.num_correct);
  // The mean's normaliser W. In the fused pass rank 0's warp 1 sums it while warp 0 waits for the
  // row's partials (after this CTA's statistics, so no rank's merge waits for W) and pushes it to
  // the other ranks on mbarrier set 1, which only their gradients wait for; the targets' lines are
  // asked of L1 now, while the slice loads. The forward needs W only in the warp that polls the
  // rows' losses (below) and divides.
  const bool need_w = a.reduce == reduction::mean && (want_grad || need_reduce);
  const bool w_pushed = want_grad && need_w;
  const bool w_warp = w_pushed && rank == 0 && warp == 1;
  if (w_warp) prefetch_l1_lines(a.targets.ids, z.rows, lane);
  double normalizer = need_w && !want_grad && rank == 0 && warp == 0 && n == z.rows - 1
                          ? warp_normalizer(a.targets, z.rows, z.vocab, a.ignore_index, a.weights)
                          : 1.0;

  if (!skip) {
    row_partial p;
    if constexpr (keep_exps) {  // the target's logit first: the exponentials take its registers
      const float z_y = has_target ? warp_element(tile, static_cast<int>(y - v0)) : 0.0f;
      p = tile_warp_exps(tile, exps);
      p.target_logit = z_y;
    } else {
      p = tile_warp_stats(tile);
      if (has_target) p.target_logit = warp_element(tile, static_cast<int>(y - v0));
    }
    ex.publish(p, 0);
    __syncthreads();  // the warps' parts are in shared memory
    cluster_wait();   // every rank's mbarrier is ready
    if (warp == 0) {
      ex.send(0, 0);
      ex.receive(0, 0);
    } else if (w_warp) {
      const double w = warp_normalizer(a.targets, z.rows, z.vocab, a.ignore_index, a.weights);
      if (lane > 0 && lane < z.cluster) {
        unsigned words[2];
        memcpy(words, &w, sizeof(words));
        push_words(&rank0_w, words, &ex.x.arrived[1], lane);
      }
      if (lane == 0) rank0_w = w;
    }
    __syncthreads();  // the row's total (and rank 0's W) is in shared memory
    total_part = ex.result(0);
  } else {
    cluster_wait();  // the arrive above is matched before the CTA leaves
  }

  if (rank == 0 && threadIdx.x == 0) {  // selects, not write_skipped_row: one store path
    const float loss = skip ? (invalid ? NAN : 0.0f) : class_row_loss(total_part, w_y, a.k);
    const float lse = skip ? loss : total_part.lse.lse();
    write_row_outputs(a, n, loss, lse, -1, false, false);
    if (invalid && a.error_count) atomicAdd(a.error_count, 1);
    if (need_reduce) publish_record(a.workspace, n, loss);
  }
  if constexpr (want_grad) {
    G* out = a.grad + n * a.grad_ld;
    if (skip) {
      for (std::int64_t c = (Shifted && v0 < 0 ? 0 : v0) + threadIdx.x; c < v1; c += Block)
        out[c] = from_float<G>(0.0f);
    } else {
      if (w_pushed) {  // rank 0's W, pushed to the others on set 1 (its only use)
        if (rank != 0) {
          if (threadIdx.x == 0) mbarrier_arrive_expect(&ex.x.arrived[1], sizeof(double));
          mbarrier_wait<true>(&ex.x.arrived[1], 0);
        }
        normalizer = rank0_w;
      }
      const double scalar = a.reduce != reduction::none
                                ? scalar_upstream(a.scale, a.scale_ptr, a.reduce, normalizer)
                                : 0.0;
      row_gradient rg;
      rg.y = y;
      rg.w_y = w_y;
      rg.lse = total_part.lse.lse();
      rg.g = row_scale(a, n, scalar);
      rg.alpha = gradient_alpha(class_target_mass(w_y, a.k), rg.lse, a.k);
      // z_y as the merge summed it with the other ranks' zeros: z_y itself.
      if constexpr (keep_exps)
        tile_gradient<true, Aligned, Shifted, true>(a, exps, n, v0, rg, out, my_lead,
                                                    total_part.target_logit);
      else
        tile_gradient<true, Aligned, Shifted, true>(a, tile, n, v0, rg, out, my_lead,
                                                    total_part.target_logit);
    }
  }
  // The last row's rank 0, among the launch's last CTAs to start, so the rows it waits for are
  // mostly done; it holds one CTA slot while the rest of the grid runs around it.
  if (need_reduce && rank == 0 && n == z.rows - 1 && warp == 0) {
    if (w_pushed && skip)  // the fused pass's W came from warp 1, which a skipped row skips
      normalizer = warp_normalizer(a.targets, z.rows, z.vocab, a.ignore_index, a.weights);
    warp_poll_reduction(a.workspace, z.rows, a.loss, a.num_correct, normalizer);
  }
#else
  (void)a;
#endif
}

}  // namespace cuda_detail
}  // namespace xent
