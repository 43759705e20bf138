// The streaming and bulk backward kernels: the gradient of class-id rows from their saved LSE
// (policy::stream_backward; plain 16-byte-aligned rows on sm_90 take the bulk kernel,
// policy::bulk_backward). Included only by nvcc.
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

#include "../../loss_math.hpp"
#include "../block/async_copy.cuh"
#include "../block/row_args.cuh"
#include "../block/row_sums.cuh"
#include "../block/tile.cuh"
#include "../block/tile_gradient.cuh"
#include "../tuning/policy.cuh"

namespace xent {
namespace cuda_detail {

/// `Shifted`: rows need not start on a 16-byte boundary, but each gradient row has the same
/// boundaries as its logits row (an in-place call, or equal starts and leading dimensions modulo
/// 16 bytes). Each row's tiles are then cut at its own boundaries, the first starting `lead`
/// elements before the row (global_tile's and tile_gradient's lead), one tile more per row
/// allowed for, so only a row's first and last vectors are read and written element by element.
template <int Block, int Regs, bool Plain, bool Shifted, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Block, policy::stream_min_blocks(Plain))
    stream_backward_kernel(row_args<T, G, Tgt> a) {
  static_assert(!Tgt::soft, "soft targets need each row's mass: the row kernel's path");
  using tile_t = global_tile<T, Regs, Block>;
  constexpr std::int64_t span = static_cast<std::int64_t>(Regs) * Block * tile_t::vec;
  const double scalar = backward_constants<Block>(a);

  const std::int64_t tiles_per_row = (a.cols + (Shifted ? tile_t::vec - 1 : 0) + span - 1) / span;
  const std::int64_t tiles = a.rows * tiles_per_row;
  for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const std::int64_t n = t / tiles_per_row;
    const T* src = a.logits + n * a.ld;
    const int lead = Shifted ? lead_of(src) : 0;
    const std::int64_t base = (t - n * tiles_per_row) * span - lead;
    if (Shifted && base >= a.cols) continue;  // the row's tile to spare
    const int count = static_cast<int>(a.cols - base < span ? a.cols - base : span);
    const int tile_lead = base < 0 ? lead : 0;
    G* out = a.grad + n * a.grad_ld;
    // The loads first: nothing they need depends on the row's scalars.
    tile_t tile;
    if constexpr (Shifted)
      tile.template load<true, true>(src + base, count, tile_lead);
    else
      tile.load(src + base, count);
    // The row's scalars with them, so their latencies overlap (the LSE is read for every row).
    const auto y = static_cast<std::int64_t>(a.targets.ids[n]);
    const float lse = a.lse_in[n];
    if (skipped_target(a, y)) {  // a zero gradient (and, once per row, a device error)
      for (int c = tile_lead + static_cast<int>(threadIdx.x); c < count; c += Block)
        out[base + c] = from_float<G>(0.0f);
      if (base <= 0 && threadIdx.x == 0) write_skipped_row(a, n, y != a.ignore_index, false, false);
      continue;
    }
    tile_gradient<Plain, true, Shifted>(a, tile, n, base, backward_row(a, n, y, lse, scalar), out,
                                        tile_lead);
  }
}

/// The bulk backward kernel (policy::bulk_backward, sm_90): the streaming backward's tiles, each
/// moved by bulk copies both ways. Thread 0 loads tile k + Stages - 1 into its stage while the
/// CTA works on tile k; every thread takes its vectors of tile k from the stage into registers,
/// writes their gradient back over them, and thread 0 stores the stage to the gradient row with
/// one bulk copy, waiting only until the store of the tile before it has read its stage, which
/// the next load refills. Register loads and stores stop at 85-86% of the copy roof on an H200,
/// bulk copies both ways reach 92%. A row's last bytes
/// past its whole 16-byte vectors are moved by thread 0 alone. `Shifted`: rows cut at their own
/// 16-byte boundaries, as in the streaming backward; thread 0 also moves the row's first vector,
/// from its `lead`-th element, so no copy touches another row's bytes (in place, the row before
/// is another CTA's). `MinBlocks`: the CTAs per SM its registers are bounded for.
template <int Block, int Regs, int Stages, int MinBlocks, bool Shifted, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Block, MinBlocks) bulk_backward_kernel(row_args<T, G, Tgt> a) {
  static_assert(!Tgt::soft && sizeof(T) == sizeof(G),
                "class ids; the gradient in the logits' type");
#if XENT_CUDA_SM90_PTX
  using tile_t = row_tile<T, Regs, Block>;
  constexpr int vec = tile_t::vec;
  constexpr std::int64_t span = static_cast<std::int64_t>(Regs) * Block * vec;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ unsigned long long landed[Stages];
  auto stage = [&](std::int64_t k) {
    return reinterpret_cast<T*>(smem + (k % Stages) * span * sizeof(T));
  };
  const std::int64_t tiles_per_row = (a.cols + (Shifted ? vec - 1 : 0) + span - 1) / span;
  const std::int64_t tiles = a.rows * tiles_per_row;
  const std::int64_t my_tiles =
      tiles > blockIdx.x ? (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  // Tile k's row, first element (-lead for a shifted row's first tile), elements from there (0 or
  // less: a shifted row's tile to spare), and how many of its first vector lie before the row.
  auto tile_of = [&](std::int64_t k, std::int64_t& n, std::int64_t& base, int& count, int& lead) {
    const std::int64_t t = blockIdx.x + k * gridDim.x;
    n = t / tiles_per_row;
    const int row_lead = Shifted ? lead_of(a.logits + n * a.ld) : 0;
    base = (t - n * tiles_per_row) * span - row_lead;
    count = static_cast<int>(a.cols - base < span ? a.cols - base : span);
    lead = Shifted && base < 0 ? row_lead : 0;
  };
  // Thread 0: tile k into its stage, the bytes outside its whole vectors by plain loads (visible
  // to the other threads through the barriers between now and tile k's turn).
  auto issue_load = [&](std::int64_t k) {
    if (k >= my_tiles) return;
    std::int64_t n, base;
    int count, lead, first, whole;
    tile_of(k, n, base, count, lead);
    bulk_span<vec, Shifted>(count, lead, first, whole);
    const T* src = a.logits + n * a.ld + base;
    T* st = stage(k);
    for (int e = lead; e < first; ++e) st[e] = src[e];
    for (int e = Shifted && whole < lead ? lead : whole; e < count; ++e) st[e] = src[e];
    mbarrier_arrive_expect(&landed[k % Stages], static_cast<unsigned>((whole - first) * sizeof(T)));
    if (whole > first)
      bulk_copy(st + first, src + first, static_cast<unsigned>((whole - first) * sizeof(T)),
                &landed[k % Stages]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; ++s) mbarrier_init(&landed[s], 1);
    mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = 0; k < Stages - 1; ++k) issue_load(k);
  const double scalar = backward_constants<Block>(a);

  for (std::int64_t k = 0; k < my_tiles; ++k) {
    std::int64_t n, base;
    int count, lead;
    tile_of(k, n, base, count, lead);
    // The row's scalars before the wait, so their latencies overlap it.
    const auto y = static_cast<std::int64_t>(a.targets.ids[n]);
    const float lse = a.lse_in[n];
    mbarrier_wait(&landed[k % Stages], static_cast<unsigned>(k / Stages) & 1u);
    T* st = stage(k);
    if (!Shifted || count > 0) {
      if (skipped_target(a, y)) {  // a zero gradient (and, once per row, a device error)
        for (int c = threadIdx.x; c < count; c += Block) st[c] = from_float<T>(0.0f);
        if ((Shifted ? base <= 0 : base == 0) && threadIdx.x == 0)
          write_skipped_row(a, n, y != a.ignore_index, false, false);
      } else {
        tile_t tile;
        tile.load(st, count);
        // The gradient over the stage: `out + base` is the stage, each thread writing the vectors
        // it read (and the target's element, in its owner's vectors). A lead's elements are
        // written there too (from whatever the stage held), never stored to the row.
        tile_gradient<true, true>(a, tile, n, base, backward_row(a, n, y, lse, scalar),
                                  reinterpret_cast<G*>(st) - base);
      }
    }
    fence_async_shared();
    __syncthreads();
    if (threadIdx.x == 0) {
      store_row_tile<Shifted>(a.grad + n * a.grad_ld + base, reinterpret_cast<const G*>(st), count,
                              lead);
      // Tile k + Stages - 1 refills the stage of tile k - 1, once its store has read it.
      bulk_stores_wait<1>();
      issue_load(k + Stages - 1);
    }
  }
  if (threadIdx.x == 0) bulk_stores_wait<0, true>();
#else
  (void)a;
#endif
}

}  // namespace cuda_detail
}  // namespace xent
