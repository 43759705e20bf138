// The small-batch kernel: a batch of a few plain class-id rows (the seed shapes: 32 x 32000 fp32),
// each row's vocabulary split over a thread-block cluster, every CTA holding its slice in
// registers straight from global memory (a few 16-byte vectors per thread) on one straight path:
// load, statistics, one exchange over the cluster's shared memory, the row's outputs, its
// gradient. The row kernel serves such a batch too, but each of its clusters then runs its
// pipeline (stages, mbarriers, the row loop) for a single row from a cold instruction cache: ncu
// on fp32 32 x 32000 (13.9 us) found 1100 instructions per warp, stalled on instruction fetch
// and barriers rather than memory (bench/results/cuda-notes.md). Included only by nvcc.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../loss_math.hpp"
#include "kernels.cuh"
#include "row_reduce.cuh"
#include "row_sums.cuh"
#include "tile.cuh"

namespace xent {
namespace cuda_detail {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/// Cluster-wide split barrier: arrive (release: this CTA's shared-memory writes before it are
/// visible to the cluster) and wait (acquire).
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
/// Arrive with no memory ordering: for a CTA whose reads of the others' shared memory are done
/// (their values consumed), saying only that it will not read again. The release form costs a
/// MEMBAR.ALL.GPU and an ERRBAR in SASS (ncu: 8% of the small-batch kernel's stall samples at its
/// two arrives).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

/// This thread's statistics of its vectors of a slice, merged over its warp: the warp's max,
/// then the exponentials relative to it (the row kernel's chunk_stats, without a stage).
template <class Tile>
__device__ __forceinline__ row_partial tile_warp_stats(const Tile& t) {
  float m = -HUGE_VALF;
#pragma unroll
  for (int r = 0; r < Tile::regs; ++r)
#pragma unroll
    for (int e = 0; e < Tile::vec; ++e)  // fmaxf passes over NaN; the sum below still meets it
      if (t.has(r) && e < t.valid(r)) m = fmaxf(m, t.value(r, e));
  m = warp_max(m);
  row_partial p;
  p.lse =
      online_lse::of_block(m, warp_sum(tile_exp_sum<false>(t, m == -HUGE_VALF ? 0.0f : m * log2e)));
  return p;
}

/// Grid (cluster, rows): CTA `rank` of row blockIdx.y's cluster owns classes [rank * slice,
/// (rank + 1) * slice). Plain class-id rows of an unsharded call, forward or fused. Clusters
/// exist from sm_90: below it the kernel is empty, and the dispatcher never launches that build
/// (launch_small_rows asks the binary's version).
///
/// The row's partials cross the cluster by policy::small_push: each CTA pushes its partial into
/// every rank's shared memory (row_exchange: st.async counted on the receiver's mbarrier), or
/// (off) a cluster barrier, a read of each rank's partial and a second barrier before exit. With
/// policy::small_reduction 2, rank 0 publishes its row's loss in a record with a ready flag and
/// one warp of the last row's rank 0 polls them all (no fence or atomic: two fewer round trips
/// to L2 on the launch's last path); 1, rank 0 publishes its row's record and counts it (fence,
/// atomic) before the gradient, and one warp of the CTA that completes the count sums the
/// records after it; 0, finish_reduction after the gradient (its fence then waits for the
/// gradient's stores).
template <int Block, int Regs, bool Aligned, pass P, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Block) small_rows_kernel(row_args<T, G, Tgt> a) {
  static_assert(!Tgt::soft && P != pass::backward, "class ids, with statistics");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int warps = Block / 32;
  constexpr bool want_grad = P == pass::fused;
  constexpr bool push = policy::small_push;
  constexpr bool early_count = policy::small_reduction == 1;
  constexpr bool polled = policy::small_reduction == 2;
  constexpr bool one_w = push && policy::small_one_normalizer;
  using exchange_t = row_exchange<row_partial, Block>;
  using exchange_state = row_exchange_state<row_partial, exchange_t::warps>;
  // Raw storage: shared memory takes no initialiser. Pushed: the exchange's slots and mbarriers.
  // Read: warps parts, this CTA's (read by every CTA of the cluster), the row's.
  __shared__ alignas(exchange_state) unsigned char
      parts_bytes[push ? sizeof(exchange_state) : sizeof(row_partial) * (warps + 2)];
  row_partial* const warp_parts = reinterpret_cast<row_partial*>(parts_bytes);
  row_partial& cta_part = warp_parts[warps];
  exchange_t ex{*reinterpret_cast<exchange_state*>(parts_bytes), static_cast<int>(gridDim.x)};
  row_partial total_part;  // the row's, in every thread
  const int rank = static_cast<int>(blockIdx.x);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t n = blockIdx.y;
  const std::int64_t v0 = rank * a.slice;
  const std::int64_t v1 = v0 + a.slice < a.cols ? v0 + a.slice : a.cols;
  const int count = v1 > v0 ? static_cast<int>(v1 - v0) : 0;
  // The slice is loaded before the row's target is known, skipped row or not: two cold reads one
  // after the other (the target, then the logits it decides on) were the launch's longest chain.
  global_tile<T, Regs, Block> tile;
  tile.template load<Aligned>(a.logits + n * a.ld + v0, count);
  if constexpr (push) {
    // Every rank's mbarrier is set up before any partial is pushed to it: the cluster's arrive
    // here, its wait just before the push, with the loads in flight in between.
    if (threadIdx.x == 0) {
      ex.init();
      mbarrier_init_fence();
    }
    cluster_arrive_relaxed();
  }
  const std::int64_t y = static_cast<std::int64_t>(a.targets.ids[n]);
  // The same on every CTA of the row, so a skipped row skips the cluster's exchange everywhere.
  const bool skip = skipped_target(a, y);
  const bool invalid = skip && y != a.ignore_index;
  const float w_y = !skip && a.weights ? a.weights[y] : 1.0f;
  // The target's logit, by the thread that merges it, read beside the slice rather than after it.
  const bool has_target = threadIdx.x == 0 && !skip && y >= v0 && y < v1;
  const float z_y = has_target ? to_float(a.logits[n * a.ld + y]) : 0.0f;
  const bool need_reduce = a.workspace && (a.loss || a.num_correct);
  if (need_reduce && rank == 0 && threadIdx.x == 0) prefetch_workspace(a.workspace);
  // The mean's normaliser W while the loads fly: summed by every CTA, as the row kernel's do, or
  // with one_w by rank 0 alone, which pushes it to the others beside its partial (the forward's
  // other ranks need none: rank 0 finishes the reduction). Every CTA reading every target and
  // summing them cost 0.4-1.1 us of the fused seed shapes (policy::small_one_normalizer).
  const bool need_w = a.reduce == reduction::mean && (want_grad || need_reduce);
  double normalizer =
      need_w && (!one_w || rank == 0)
          ? mean_normalizer<Block>(a.targets, a.rows, a.vocab, a.ignore_index, a.weights)
          : 1.0;
  const bool w_pushed = one_w && want_grad && need_w;  // rank 0 pushes W to the other ranks
  __shared__ double rank0_w;

  if constexpr (push) {
    if (!skip) {
      row_partial p = tile_warp_stats(tile);
      if (has_target) p.target_logit = z_y;  // read before any gradient store
      ex.publish(p, 0);
      __syncthreads();  // the warps' parts are in shared memory
      cluster_wait();   // every rank's mbarrier is ready
      if (warp == 0) {
        ex.send(0, 0);
        if (w_pushed && rank == 0 && lane > 0 && lane < static_cast<int>(gridDim.x)) {
          unsigned w[2];
          memcpy(w, &normalizer, sizeof(w));
          push_words(&rank0_w, w, &ex.x.arrived[0], lane);
        }
        ex.receive(0, 0, w_pushed && rank != 0 ? sizeof(double) : 0u);
      }
      __syncthreads();  // the row's total (and W from rank 0) is in shared memory
      total_part = ex.result(0);
      if (w_pushed && rank != 0) normalizer = rank0_w;
    } else {
      cluster_wait();  // the arrive above is matched before the CTA leaves
    }
  } else if (!skip) {
    row_partial p = tile_warp_stats(tile);
    if (has_target) p.target_logit = z_y;  // read before any gradient store
    if (lane == 0) warp_parts[warp] = p;
    __syncthreads();
    if (warp == 0) {
      const row_partial c =
          warp_merge<pow2_at_least(warps)>(lane < warps ? warp_parts[lane] : row_partial{});
      if (lane == 0) cta_part = c;
    }
    cluster_arrive();  // every CTA's cta_part is written ...
    cluster_wait();    // ... and visible here
    if (warp == 0) {
      // Lane r reads rank r's part; the same tree in every CTA gives every CTA the same bits.
      const int ranks = static_cast<int>(gridDim.x);
      row_partial q{};
      if (lane < ranks) q = *cooperative_groups::this_cluster().map_shared_rank(&cta_part, lane);
      q = warp_merge<policy::cluster_max>(q);
      if (lane == 0) warp_parts[warps + 1] = q;
    }
    cluster_arrive_relaxed();  // done reading the others' shared memory (waited for before exit)
    __syncthreads();           // the row's total is visible
    total_part = warp_parts[warps + 1];
  }

  unsigned long long counted = 0;       // rank 0's thread 0, early_count: the count before its row
  if (rank == 0 && threadIdx.x == 0) {  // selects, not write_skipped_row: one store path
    const float loss = skip ? (invalid ? NAN : 0.0f) : class_row_loss(total_part, w_y, a.k);
    const float lse = skip ? loss : total_part.lse.lse();
    write_row_outputs(a, n, loss, lse, -1, false, need_reduce && !polled);
    if (invalid && a.error_count) atomicAdd(a.error_count, 1);
    if (polled && need_reduce) publish_record(a.workspace, a.rows, n, loss);
    if (early_count && need_reduce) counted = count_rows(a.workspace, 1u);
  }
  if constexpr (want_grad) {
    G* out = a.grad + n * a.grad_ld;
    if (skip) {
      for (std::int64_t c = v0 + threadIdx.x; c < v1; c += Block) out[c] = from_float<G>(0.0f);
    } else {
      const double scalar = a.reduce != reduction::none
                                ? scalar_upstream(a.scale, a.scale_ptr, a.reduce, normalizer)
                                : 0.0;
      row_gradient rg;
      rg.y = y;
      rg.w_y = w_y;
      rg.lse = total_part.lse.lse();
      rg.g = row_scale(a, n, scalar);
      rg.alpha = gradient_alpha(class_target_mass(w_y, a.k), rg.lse, a.k);
      tile_gradient<true, Aligned>(a, tile, n, v0, rg, out);
    }
  }
  if (need_reduce && rank == 0) {
    if constexpr (polled) {
      // The last row's rank 0, among the launch's last CTAs to start, so the rows it waits for
      // are mostly done; it holds one CTA slot while the rest of the grid runs around it.
      if (n == a.rows - 1 && warp == 0)
        warp_poll_reduction(a.workspace, a.rows, a.loss, a.num_correct, normalizer);
    } else if constexpr (early_count) {
      if (warp == 0 && __shfl_sync(0xffffffffu, rows_complete(counted, 1u, a.rows) ? 1 : 0, 0))
        warp_finish_reduction(a.workspace, a.rows, a.loss, a.num_correct, normalizer);
    } else {
      finish_reduction<Block>(a.workspace, a.rows, 1u, a.loss, a.num_correct, normalizer);
    }
  }
  if (!push && !skip) cluster_wait();  // no CTA leaves while another may read its cta_part
#else
  (void)a;
#endif
}

}  // namespace cuda_detail
}  // namespace xent
