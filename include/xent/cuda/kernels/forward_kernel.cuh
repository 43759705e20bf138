// The streaming forward kernel: loss and LSE of plain class-id rows in a batch that gives every
// CTA in flight a row of its own (policy::stream_forward). Included only by nvcc.
//
// A forward reads each element once and keeps nothing of it, so a row needs no shared-memory stage
// and no cluster: each CTA streams whole rows from global memory into registers, a tile of Regs x
// Block 16-byte vectors at a time, each thread keeping a running max and its sum of exponentials,
// and meets its own warps once per row. With few registers per thread, four CTAs per SM overlap one
// another's loads, sweeps and row ends. The row kernel's whole-row forward (two 32 KiB
// shared-memory stages filled by bulk copies) measured slower on every shape.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../loss_math.hpp"
#include "../block/row_args.cuh"
#include "../block/row_reduce.cuh"
#include "../block/row_sums.cuh"
#include "../block/stream_stats.cuh"
#include "../block/tile.cuh"

namespace xent {
namespace cuda_detail {

/// Persistent CTAs, each walking rows blockIdx.x, + gridDim.x,... (MinBlocks per SM). `Shifted`:
/// rows need not start on a 16-byte boundary. Each row's tiles are then cut at its own boundaries,
/// the first starting `lead` elements before the row (global_tile's lead: thread 0 reads its first
/// vector from the row's start, -inf before it), so every other vector is one 16-byte load, as in
/// an aligned row. Element by element, bf16 8192 x 50257 (GPT-2's vocabulary) took 923 us against
/// 204 for 8192 x 50304 (H200, the row kernel's element-wise staging).
template <int Block, int Regs, int MinBlocks, bool Shifted, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Block, MinBlocks) stream_forward_kernel(row_args<T, G, Tgt> a) {
  static_assert(!Tgt::soft, "class ids");
  constexpr int warps = Block / 32;
  using tile_t = global_tile<T, Regs, Block>;
  constexpr std::int64_t span = std::int64_t{Regs} * Block * tile_t::vec;
  // Raw storage: shared memory takes no initialiser. The warps' parts, per row parity: warps
  // write the next row's while warp 0 may still read this one's.
  __shared__ alignas(row_partial) unsigned char parts_bytes[sizeof(row_partial) * 2 * warps];
  row_partial* const warp_parts = reinterpret_cast<row_partial*>(parts_bytes);

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t my_rows =
      a.rows > blockIdx.x ? (a.rows - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const bool need_reduce = a.workspace && (a.loss || a.num_correct);
  // Rows of whole vectors (V a multiple of 16 bytes, as 32000 is) end in a tile of whole vectors:
  // its sweep tests each vector, not each element (ncu, bf16 8192 x 32000: the element-masked
  // sweep of the last tile was 284 of the row's 1203 instructions per warp).
  const bool whole_vectors = a.cols % tile_t::vec == 0;  // with no lead

  int merged = 0;  // rows merged so far
  // This CTA's share of the reduced loss, added to by thread 0 alone (skipped rows and warp 0's
  // row ends): in shared memory, as a share held in every thread's registers through the row
  // loop spilled (ptxas, sm_90: 32 bytes of stack, and 2 us slower at bf16 8192 x 32000).
  __shared__ loss_share share;
  if (threadIdx.x == 0) share = loss_share{};
  // Row m's parts are handed to warp 0 by named barrier 1 + m % 2 (warps 1.. arrive and go on to
  // the next row, warp 0 waits), and warp 0 hands the parity back by barrier 3 + m % 2 once it
  // has read them (warps 1.. wait for it only before writing that parity again, two rows on):
  // a CTA barrier per row made every warp wait for the slowest warp's last tile of the row. The
  // sanitizer build takes full barriers (policy::split_barriers).
  constexpr bool split = policy::split_barriers && policy::stream_forward_handoff;
  auto parts_read = [](int m) {  // warp 0, after reading row m's parts
    if (split) m & 1 ? named_barrier_arrive<4>(Block) : named_barrier_arrive<3>(Block);
  };
  auto parts_read_wait = [](int m) {  // warps 1.., before writing row m + 2's parts
    if (split) m & 1 ? named_barrier_sync<4>(Block) : named_barrier_sync<3>(Block);
  };
  // Each row's target is read one row ahead, and its target logit (thread 0) as the row starts:
  // read where they were needed, each was a cold read that stalled the whole CTA once per row
  // (bf16 8192 x 32000 forward at 82% of the copy roof, where rows 4x longer reach 98%).
  auto target_of = [&](std::int64_t i) {
    return i < my_rows ? static_cast<std::int64_t>(a.targets.ids[blockIdx.x + i * gridDim.x])
                       : std::int64_t{0};
  };
  std::int64_t y_next = target_of(0);
  for (std::int64_t i = 0; i < my_rows; ++i) {
    const std::int64_t n = blockIdx.x + i * gridDim.x;
    const T* src = a.logits + n * a.ld;
    const std::int64_t y = y_next;
    y_next = target_of(i + 1);
    if (skipped_target(a, y)) {
      if (threadIdx.x == 0) {
        write_skipped_row(a, n, y != a.ignore_index, true, false);
        if (y != a.ignore_index) share.loss += NAN;  // the row's loss; its weight in W is 0
      }
      continue;
    }
    const float z_y = threadIdx.x == 0 ? to_float(src[y]) : 0.0f;
    // Tiles start at -lead: count elements from there, the first lead of them before the row.
    const int lead = Shifted ? lead_of(src) : 0;
    const bool vectors_end = Shifted ? (a.cols + lead) % tile_t::vec == 0 : whole_vectors;
    stream_stats st;
    // One tile in registers at a time (the loop is not unrolled): the other CTAs of the SM keep
    // loads in flight while this one sweeps.
#pragma unroll 1
    for (std::int64_t base = -lead; base < a.cols; base += span) {
      tile_t t;
      const int count = static_cast<int>(a.cols - base < span ? a.cols - base : span);
      if constexpr (Shifted)
        t.template load<true, true>(src + base, count, base < 0 ? lead : 0);
      else
        t.load(src + base, count);
      st.add(t, count, static_cast<int>(span), vectors_end);
    }
    row_partial p = st.warp_total();
    if (threadIdx.x == 0) p.target_logit = z_y;
    const int m = merged++;
    row_partial* const parts = warp_parts + (m & 1) * warps;
    // Warps 1.. write this parity's parts again only once warp 0 has read them two rows ago.
    if (warp != 0 && m >= 2) parts_read_wait(m - 2);
    if (lane == 0) parts[warp] = p;
    parity_handoff<1, Block, split>(m, warp == 0);
    if (warp == 0) {
      // Warp 0 alone finishes the row; the others go on to the next one.
      const row_partial row =
          warp_merge<pow2_at_least(warps)>(lane < warps ? parts[lane] : row_partial{});
      parts_read(m);
      if (lane == 0) {
        const float w_y = a.weights ? a.weights[y] : 1.0f;
        const float loss = class_row_loss(row, w_y, a.k);
        write_row_outputs(a, n, loss, row.lse.lse(), -1, false, false);
        share.loss += static_cast<double>(loss);
        share.w += static_cast<double>(w_y);
      }
    }
  }
  // Every parts_read of warp 0 is met: warps 1.. wait on the last two rows' here.
  if (warp != 0)
    for (int m = merged >= 2 ? merged - 2 : 0; m < merged; ++m) parts_read_wait(m);
  if (need_reduce)
    finish_shares<Block>(a.workspace, a.rows, blockIdx.x, gridDim.x, share, a.reduce, a.loss,
                         a.num_correct);
}

}  // namespace cuda_detail
}  // namespace xent
