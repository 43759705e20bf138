// The streaming backward kernel: the gradient of class-id rows from their saved LSE, for
// 16-byte-aligned rows (policy::stream_backward). Included only by nvcc (cuda/backend.cuh).
//
// Backward from a saved LSE needs no statistics of a row, so nothing has to meet: every element is
// read once and its gradient written once. The row kernel serves it through its shared-memory
// stages and cluster machinery, built for the passes that do need a row's statistics; here each
// CTA takes tiles of Regs x Block 16-byte vectors of one row straight from global memory into
// registers (global_tile) and writes their gradient with the row kernel's own sweep
// (tile_gradient), so the gradient's arithmetic exists once. Tiles are dealt to persistent CTAs
// in order, row by row, so consecutive CTAs stream consecutive memory.
#pragma once

#include <cstdint>

#include "../loss_math.hpp"
#include "kernels.cuh"
#include "row_sums.cuh"
#include "tile.cuh"

namespace xent {
namespace cuda_detail {

/// CTAs per SM the streaming backward's registers are bounded for (untuned: 4 x 16 KiB of loads
/// in flight per SM is well past what the memory system needs to run at its rate). The option
/// paths' per-element smoothing and softcap terms over 16-bit tiles spilled 7 KB at 64 registers
/// (ptxas, sm_90): two CTAs per SM for them.
constexpr int stream_min_blocks(bool plain) {
#ifdef XENT_CUDA_STREAM_MIN_BLOCKS
  return plain ? XENT_CUDA_STREAM_MIN_BLOCKS : 2;
#else
  return plain ? 4 : 2;
#endif
}

template <int Block, int Regs, bool Plain, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Block, stream_min_blocks(Plain))
    stream_backward_kernel(row_args<T, G, Tgt> a) {
  static_assert(!Tgt::soft, "soft targets need each row's mass: the row kernel's path");
  using tile_t = global_tile<T, Regs, Block>;
  constexpr std::int64_t span = static_cast<std::int64_t>(Regs) * Block * tile_t::vec;

  // Per-launch constants, as the row kernel forms them (every CTA: one launch per call).
  if (a.weights && a.k.smooth != 0.0f)
    a.k.weight_sum = static_cast<float>(class_weight_sum<Block>(full_weights(a), a.vocab));
  const double normalizer =
      a.reduce == reduction::mean
          ? mean_normalizer<Block>(a.targets, a.rows, a.vocab, a.ignore_index, full_weights(a))
          : 1.0;
  const double scalar = a.reduce != reduction::none
                            ? scalar_upstream(a.scale, a.scale_ptr, a.reduce, normalizer)
                            : 0.0;

  const std::int64_t tiles_per_row = (a.cols + span - 1) / span;
  const std::int64_t tiles = a.rows * tiles_per_row;
  for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const std::int64_t n = t / tiles_per_row;
    const std::int64_t base = (t - n * tiles_per_row) * span;
    const int count = static_cast<int>(a.cols - base < span ? a.cols - base : span);
    G* out = a.grad + n * a.grad_ld;
    // The loads first: nothing they need depends on the row's scalars.
    tile_t tile;
    tile.load(a.logits + n * a.ld + base, count);
    // The row's scalars with them, so their latencies overlap (the LSE is read for every row).
    const auto y = static_cast<std::int64_t>(a.targets.ids[n]);
    const float lse = a.lse_in[n];
    const bool skip = y == a.ignore_index || y < 0 || y >= a.vocab;
    if (skip) {  // ignored or out of range: a zero gradient (and, once per row, a device error)
      for (int c = threadIdx.x; c < count; c += Block) out[base + c] = from_float<G>(0.0f);
      if (y != a.ignore_index && base == 0 && threadIdx.x == 0 && a.error_count)
        atomicAdd(a.error_count, 1);
      continue;
    }
    row_gradient rg;
    rg.y = y - a.first;  // the target's column in this shard
    rg.w_y = a.weights ? full_weights(a)[y] : 1.0f;
    rg.lse = lse;
    rg.g = row_scale(a, n, scalar);
    rg.alpha = gradient_alpha(class_target_mass(rg.w_y, a.k), rg.lse, a.k);
    tile_gradient<Plain, true>(a, tile, n, base, rg, out);
  }
}

}  // namespace cuda_detail
}  // namespace xent
