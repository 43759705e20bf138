// The fused pass read twice, the second read from L2: plain class-id rows (forward and fused) of a
// batch long enough to fill the GPU (policy::reread). Included only by nvcc (cuda/backend.cuh).
//
// The row kernel holds a row's slice on chip between its statistics and its gradient, which for
// 16-bit rows costs two CTAs per SM of registers and leaves each row's cluster round trip in
// series with its sweeps. Here no slice is held: each CTA streams its slice of a row from global
// memory into registers twice, tile by tile, once for the statistics and once for the gradient,
// with nothing but a few floats kept in between. The first read asks L2 to keep the lines
// (evict_last) and the second to drop them (ld.global.cs), and the plan sizes the slices so the
// bytes read but not yet re-read across the GPU stay within L2: HBM sees each element read once
// and its gradient written once, as with the row kernel. With few registers per thread, several
// CTAs per SM overlap one another's loads, sweeps and row ends, so no pipeline is needed inside a
// CTA.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../loss_math.hpp"
#include "kernels.cuh"
#include "row_reduce.cuh"
#include "row_sums.cuh"
#include "small_rows_kernel.cuh"
#include "tile.cuh"

namespace xent {
namespace cuda_detail {

/// This thread's running statistics of a row streamed tile by tile: the largest value seen and
/// the sum of exponentials relative to it (a tile with a larger one rescales the sum first).
struct stream_stats {
  float max = -HUGE_VALF;
  float sum = 0.0f;

  /// Folds in this thread's vectors of tile `t` (`Full`: every vector whole, no masks).
  template <bool Full, class Tile>
  __device__ __forceinline__ void add(const Tile& t) {
    using T = typename Tile::elem;
    float m = -HUGE_VALF;
    if constexpr (Full && sizeof(T) == 2) {
      // Packed 16-bit maxima, two accumulators (one HMNMX2 per two elements).
      using pair = std::conditional_t<std::is_same<T, __half>::value, __half2, __nv_bfloat162>;
      pair acc[2];
      memcpy(&acc[0], &t.w[0][0], 4);
      acc[1] = acc[0];
#pragma unroll
      for (int r = 0; r < Tile::regs; ++r)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          pair p;
          memcpy(&p, &t.w[r][k], 4);
          acc[k % 2] = __hmax2(acc[k % 2], p);
        }
      acc[0] = __hmax2(acc[0], acc[1]);
      const float x0 = to_float(acc[0].x), x1 = to_float(acc[0].y);
      m = x0 > x1 ? x0 : x1;
    } else {
#pragma unroll
      for (int r = 0; r < Tile::regs; ++r)
#pragma unroll
        for (int e = 0; e < Tile::vec; ++e)  // fmaxf passes over NaN; the sum still meets it
          if (Full || (t.has(r) && e < t.valid(r))) m = fmaxf(m, t.value(r, e));
    }
    if (m > max) {  // exp2(-inf) = 0 rescales an empty sum
      sum *= fast_exp2((max - m) * log2e);
      max = m;
    }
    const float shift = max == -HUGE_VALF ? 0.0f : max * log2e;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int r = 0; r < Tile::regs; ++r)
#pragma unroll
      for (int e = 0; e < Tile::vec; ++e)
        if (Full || (t.has(r) && e < t.valid(r))) {
          const float p = fast_exp2(fmaf(t.value(r, e), log2e, -shift));
          if (e % 2)
            s1 += p;
          else
            s0 += p;
        }
    sum += s0 + s1;
  }
};

/// Grid (cluster, clusters in flight): CTA `rank` of a cluster owns classes [rank * slice,
/// (rank + 1) * slice) of each row its cluster walks (rows blockIdx.y, + gridDim.y, ...). A
/// cluster of one CTA streams whole rows and never meets another; a larger cluster meets once per
/// row through shared memory (clusters exist from sm_90; the plan asks for one only there).
template <int Block, int Regs, pass P, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Block, policy::reread_min_blocks)
    reread_kernel(row_args<T, G, Tgt> a) {
  static_assert(!Tgt::soft && P != pass::backward, "class ids, with statistics");
  constexpr int warps = Block / 32;
  constexpr bool want_grad = P == pass::fused;
  using tile_t = global_tile<T, Regs, Block>;
  constexpr std::int64_t span = std::int64_t{Regs} * Block * tile_t::vec;
  // Raw storage: shared memory takes no initialiser. Per row parity: this CTA's part (read by
  // every CTA of the cluster) and the row's; the warps' parts.
  __shared__ alignas(row_partial) unsigned char parts_bytes[sizeof(row_partial) * (warps + 4)];
  row_partial* const warp_parts = reinterpret_cast<row_partial*>(parts_bytes);
  row_partial* const cta_part = warp_parts + warps;
  row_partial* const row_total = warp_parts + warps + 2;

  const int rank = static_cast<int>(blockIdx.x);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t v0 = rank * a.slice;
  const std::int64_t v1 = v0 + a.slice < a.cols ? v0 + a.slice : a.cols;
  const std::int64_t my_rows =
      a.rows > blockIdx.y ? (a.rows - blockIdx.y + gridDim.y - 1) / gridDim.y : 0;
  const bool need_reduce = a.workspace && (a.loss || a.num_correct);
  const bool use_cluster = gridDim.x > 1;

  // Per-launch constants, as the row kernel forms them (every CTA: one launch per call).
  const double normalizer =
      a.reduce == reduction::mean && (want_grad || need_reduce)
          ? mean_normalizer<Block>(a.targets, a.rows, a.vocab, a.ignore_index, full_weights(a))
          : 1.0;
  const double scalar = want_grad && a.reduce != reduction::none
                            ? scalar_upstream(a.scale, a.scale_ptr, a.reduce, normalizer)
                            : 0.0;

  int exchanged = 0;  // rows merged so far: their parts alternate between two slots
  for (std::int64_t i = 0; i < my_rows; ++i) {
    const std::int64_t n = blockIdx.y + i * gridDim.y;
    const T* src = a.logits + n * a.ld;
    const std::int64_t y = static_cast<std::int64_t>(a.targets.ids[n]);
    // The same in every CTA of the row, so a skipped row skips the cluster's barrier everywhere.
    const bool skip = y == a.ignore_index || y < 0 || y >= a.vocab;
    if (skip) {
      if (rank == 0 && threadIdx.x == 0) {
        const bool invalid = y != a.ignore_index;
        const float v = invalid ? NAN : 0.0f;
        write_row_outputs(a, n, v, v, -1, false, need_reduce);
        if (invalid && a.error_count) atomicAdd(a.error_count, 1);
      }
      if constexpr (want_grad) {
        G* out = a.grad + n * a.grad_ld;
        for (std::int64_t c = v0 + threadIdx.x; c < v1; c += Block) out[c] = from_float<G>(0.0f);
      }
      continue;
    }
    const int slot = exchanged++ & 1;
    const std::int64_t col = y - a.first;  // the target's column in this shard
    const float w_y = a.weights ? full_weights(a)[y] : 1.0f;

    // First read: the statistics, the lines kept in L2 for the second.
    stream_stats st;
#pragma unroll 1
    for (std::int64_t base = v0; base < v1; base += span) {
      tile_t t;
      const int count = static_cast<int>(v1 - base < span ? v1 - base : span);
      t.template load<true, l2_hint::keep>(src + base, count);
      if (count == span)
        st.add<true>(t);
      else
        st.add<false>(t);
    }
    row_partial p;
    p.lse = online_lse::of_block(st.max, st.sum);
    p = warp_merge<32>(p);
    if (threadIdx.x == 0 && col >= v0 && col < v1)
      p.target_logit = to_float(src[col]);  // before any gradient store of this row
    if (lane == 0) warp_parts[warp] = p;
    __syncthreads();
    if (warp == 0) {
      const row_partial c =
          warp_merge<pow2_at_least(warps)>(lane < warps ? warp_parts[lane] : row_partial{});
      if (lane == 0) (use_cluster ? cta_part : row_total)[slot] = c;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (use_cluster) {
      // Every CTA's part of this row is written and visible after the barrier. A CTA writes
      // cta_part[slot] again two merged rows later, after the next merged row's barrier, which no
      // CTA passes before it has read this row's parts (skipped rows meet nowhere, in every CTA
      // of the cluster alike).
      cluster_arrive();
      cluster_wait();
      if (warp == 0) {
        // Lane r reads rank r's part; the same tree in every CTA gives every CTA the same bits.
        row_partial q{};
        if (lane < static_cast<int>(gridDim.x))
          q = *cooperative_groups::this_cluster().map_shared_rank(&cta_part[slot], lane);
        q = warp_merge<policy::cluster_max>(q);
        if (lane == 0) row_total[slot] = q;
      }
    }
#endif
    __syncthreads();  // row_total[slot] is visible (and warp_parts free for the next row)
    const row_partial& row = row_total[slot];
    const float lse = row.lse.lse();
    if (rank == 0 && threadIdx.x == 0)
      write_row_outputs(a, n, class_row_loss(row, w_y, a.k), lse, -1, false, need_reduce);

    if constexpr (want_grad) {
      // Second read, from L2: the gradient, tile by tile.
      row_gradient rg;
      rg.y = col;
      rg.w_y = w_y;
      rg.lse = lse;
      rg.g = row_scale(a, n, scalar);
      rg.alpha = gradient_alpha(class_target_mass(w_y, a.k), lse, a.k);
#pragma unroll 1  // one tile in registers at a time: more CTAs per SM hide the loads instead
      for (std::int64_t base = v0; base < v1; base += span) {
        tile_t t;
        t.template load<true, l2_hint::stream>(src + base,
                                              static_cast<int>(v1 - base < span ? v1 - base : span));
        tile_gradient<true, true>(a, t, n, base, rg, a.grad + n * a.grad_ld);
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (use_cluster) {  // no CTA leaves while another may read its parts
    cluster_arrive();
    cluster_wait();
  }
#endif
  if (need_reduce && rank == 0)
    finish_reduction<Block>(a.workspace, a.rows, static_cast<unsigned>(my_rows), a.loss,
                            a.num_correct, normalizer);
}

}  // namespace cuda_detail
}  // namespace xent
