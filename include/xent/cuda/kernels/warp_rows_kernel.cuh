// The warp-rows kernel: every pass over short plain class-id rows, a warp per row.
// Included only by nvcc.
//
// A row of at most 32 x Regs 16-byte vectors (6 KiB at Regs = 12) fits one warp's registers:
// the warp loads it, merges its statistics by shuffles and writes its gradient from the same
// registers, one read and one write of the logits with no shared memory and no barrier. The row
// kernel holds at most two such rows in flight per CTA, each in a 32 KiB tile it mostly sweeps as
// padding (bf16 65536 x 3008 fused: 747 us, 25% of the copy roof on an H200); here every warp of
// the SM has a row in flight. Aligned rows (logits and gradient rows on 16-byte boundaries), or
// rows cut at their own 16-byte boundaries (`Shifted`) whose gradient rows share them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../loss_math.hpp"
#include "../block/row_args.cuh"
#include "../block/row_reduce.cuh"
#include "../block/row_sums.cuh"
#include "../block/stream_stats.cuh"
#include "../block/tile.cuh"
#include "../block/tile_gradient.cuh"
#include "../cuda.cuh"

namespace xent {
namespace cuda_detail {

/// Persistent CTAs of Block threads, MinBlocks per SM; warp w of the grid takes rows w, w +
/// warps in the grid, ... . `P`: forward, fused, or backward from the saved LSE (a.lse_in). The
/// mean's normaliser comes from normalizer_kernel ahead (a.normalizer_ahead) or is summed by
/// every CTA.
template <int Block, int Regs, int MinBlocks, pass P, bool Shifted, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Block, MinBlocks) warp_rows_kernel(row_args<T, G, Tgt> a) {
  static_assert(!Tgt::soft, "class ids");
  constexpr bool want_grad = P != pass::forward;
  constexpr int warps = Block / 32;
  using tile_t = global_tile<T, Regs, 32>;
  constexpr int span = Regs * 32 * tile_t::vec;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t stride = std::int64_t{gridDim.x} * warps;
  const bool need_reduce = P != pass::backward && a.workspace && (a.loss || a.num_correct);
  // Launch: cols <= span, or cols + vec - 1 where Shifted.
  const int cols = static_cast<int>(a.cols < span ? a.cols : span);
  double scalar = 0.0;  // plain rows: no smoothing, so no sum of class weights
  if constexpr (want_grad) {
    if (a.reduce != reduction::none) {
      const double normalizer =
          a.reduce != reduction::mean ? 1.0
          : a.normalizer_ahead
              ? normalizer_from_ahead(a.workspace)
              : mean_normalizer<Block>(a.targets, a.rows, a.vocab, a.ignore_index, full_weights(a));
      scalar = scalar_upstream(a.scale, a.scale_ptr, a.reduce, normalizer);
    }
  }
  loss_share mine{};  // lane 0's: its warp's rows, in row order
  for (std::int64_t n = std::int64_t{blockIdx.x} * warps + warp; n < a.rows; n += stride) {
    const T* src = a.logits + n * a.ld;
    // Shifted: the tile starts lead elements before the row, on the 16-byte boundary there, and
    // counts from it (global_tile's lead: those elements are -inf and never stored).
    const int lead = Shifted ? lead_of(src) : 0;
    const int count = cols + lead;
    // The row's loads go out before its target is known (a skipped row's are wasted): the target,
    // then the logits, one after the other, would be two cold reads in a chain.
    tile_t t;
    if constexpr (Shifted)
      t.template load<true, true>(src - lead, count, lead);
    else
      t.load(src, count);
    const std::int64_t y = static_cast<std::int64_t>(a.targets.ids[n]);
    // A backward's saved LSE, read beside the logits.
    const float saved_lse = P == pass::backward ? a.lse_in[n] : 0.0f;
    G* const out = want_grad ? a.grad + n * a.grad_ld : nullptr;  // a forward has no gradient
    if (skipped_target(a, y)) {
      if (lane == 0) {
        write_skipped_row(a, n, y != a.ignore_index, P != pass::backward, false);
        if (y != a.ignore_index) mine.loss += NAN;  // the row's loss; its weight in W is 0
      }
      if constexpr (want_grad)
        for (int c = lane; c < cols; c += 32) out[c] = from_float<G>(0.0f);
      continue;
    }
    if constexpr (P == pass::backward) {
      tile_gradient<true, true, Shifted>(a, t, n, -lead, backward_row(a, n, y, saved_lse, scalar),
                                         out, lead);
    } else {
      const float z_y = lane == 0 ? to_float(src[y]) : 0.0f;
      stream_stats st;
      st.add(t, count, span, count % tile_t::vec == 0);
      row_partial p = st.warp_total();  // every lane holds the row's statistics
      p.target_logit = z_y;
      const float w_y = a.weights ? a.weights[y] : 1.0f;
      const float lse = p.lse.lse();
      if (lane == 0) {
        const float loss = class_row_loss(p, w_y, a.k);
        write_row_outputs(a, n, loss, lse, -1, false, false);
        mine.loss += static_cast<double>(loss);
        mine.w += static_cast<double>(w_y);
      }
      if constexpr (want_grad) {
        // Lane 0's read of the target's logit (above) before another lane's store over it (in
        // place): the shuffles between them order no memory.
        __syncwarp();
        tile_gradient<true, true, Shifted>(a, t, n, -lead, backward_row(a, n, y, lse, scalar), out,
                                           lead);
      }
    }
  }
  if (need_reduce) {
    // The CTA's share: its warps' in warp order (deterministic), then the shares across CTAs.
    __shared__ loss_share warp_shares[warps];
    if (lane == 0) warp_shares[warp] = mine;
    __syncthreads();
    loss_share cta{};
    if (threadIdx.x == 0)
      for (int w = 0; w < warps; ++w) {
        cta.loss += warp_shares[w].loss;
        cta.w += warp_shares[w].w;
      }
    finish_shares<Block>(a.workspace, a.rows, blockIdx.x, gridDim.x, cta, a.reduce, a.loss,
                         a.num_correct);
  }
}

}  // namespace cuda_detail
}  // namespace xent
