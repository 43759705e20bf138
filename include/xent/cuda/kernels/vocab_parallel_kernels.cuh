// The kernels of vocab-parallel cross-entropy (vocab_parallel.cuh's steps 1 and 4): this rank's
// header into the send block, and the merge of the gathered blocks. Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../loss_math.hpp"
#include "../../options.hpp"
#include "../../parallel/records.hpp"
#include "../../parallel/shard.hpp"
#include "../block/row_args.cuh"
#include "../block/row_sums.cuh"
#include "../cuda.cuh"

namespace xent {
namespace cuda_detail {

using detail::shard_header;

/// Rank r's header in the gathered blocks (each block a multiple of 8 bytes: aligned).
__device__ __forceinline__ const shard_header& gathered_header(const unsigned char* recv,
                                                               std::size_t block, int r) {
  return *reinterpret_cast<const shard_header*>(recv + static_cast<std::size_t>(r) * block);
}

/// Whether the gathered shards tile [0, vocab) and every rank declared `vocab` classes and `rows`
/// rows: non-empty shards pairwise disjoint, inside [0, vocab), their sizes adding up to vocab.
/// The same test as the CPU's check_tiling without its sort (R is small) or its messages.
__device__ inline bool shards_tile(const unsigned char* recv, std::size_t block, int ranks,
                                   std::int64_t vocab, std::int64_t rows) {
  std::int64_t covered = 0;
  for (int r = 0; r < ranks; ++r) {
    const shard_header h = gathered_header(recv, block, r);
    if (h.vocab != vocab || h.rows != rows || h.cols < 0 || h.first < 0 ||
        h.first > h.vocab - h.cols)
      return false;
    covered += h.cols;
    for (int q = 0; q < r && h.cols > 0; ++q) {
      const shard_header o = gathered_header(recv, block, q);
      if (o.cols > 0 && h.first < o.first + o.cols && o.first < h.first + h.cols) return false;
    }
  }
  return covered == vocab;
}

/// Step 1: this rank's header, and empty records when the shard has no classes (the row kernel
/// then does not run, and the records must still merge as "nothing here").
/// (A template, as every kernel in a header: one definition however many units include it.)
template <int Block>
XENT_KERNEL void __launch_bounds__(Block)
    vp_begin_kernel(shard_header header, record_sink records, bool empty_shard) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *reinterpret_cast<shard_header*>(records.block) = header;
  if (!empty_shard) return;
  for (std::int64_t n = blockIdx.x * std::int64_t{Block} + threadIdx.x; n < header.rows;
       n += std::int64_t{gridDim.x} * Block)
    records.put(n, slice_partial{});
}

/// The gathered blocks, and where the merge leaves what the gradient pass needs.
struct vp_gathered {
  const unsigned char* recv;
  std::size_t block;
  int ranks;
  record_layout layout;
  float* lse_rows;   ///< each row's merged LSE
  float* mass_rows;  ///< each row's merged target mass (soft targets)

  /// Rank r's record of row n.
  __device__ __forceinline__ slice_partial record(int r, std::int64_t n) const {
    return layout.get(recv + static_cast<std::size_t>(r) * block +
                      detail::record_offset(n, layout));
  }
};

/// Step 4, one thread per row, with the row kernel's arguments of the call (its outputs, targets,
/// options; `workspace` set when something is reduced). Every CTA holds at least one row (the grid
/// is sized so), which finish_reduction's last-CTA count relies on.
template <int Block, class T, class G, class Tgt>
XENT_KERNEL void __launch_bounds__(Block) vp_merge_kernel(row_args<T, G, Tgt> a, vp_gathered x) {
  const float* weights = full_weights(a);
  __shared__ bool tiled;
  if (threadIdx.x == 0) tiled = shards_tile(x.recv, x.block, x.ranks, a.vocab, a.rows);
  __syncthreads();  // `tiled` is visible
  if (!tiled && blockIdx.x == 0 && threadIdx.x == 0 && a.error_count) atomicAdd(a.error_count, 1);
  if (weights && a.k.smooth != 0.0f)
    a.k.weight_sum = static_cast<float>(class_weight_sum<Block>(weights, a.vocab));
  const bool need_reduce = a.workspace && (a.loss || a.num_correct);
  const double normalizer =
      a.reduce == reduction::mean && need_reduce
          ? mean_normalizer<Block>(a.targets, a.rows, a.vocab, a.ignore_index, weights)
          : 1.0;
  std::uint64_t my_rows = 0;
  for (std::int64_t base = blockIdx.x * std::int64_t{Block}; base < a.rows;
       base += std::int64_t{gridDim.x} * Block) {
    my_rows += static_cast<std::uint64_t>(a.rows - base < Block ? a.rows - base : Block);
    const std::int64_t n = base + threadIdx.x;
    if (n >= a.rows) continue;
    std::int64_t y = -1;
    bool ignored = false, invalid = !tiled;
    float w_y = 1.0f;
    if constexpr (!Tgt::soft) {
      y = static_cast<std::int64_t>(a.targets.ids[n]);
      ignored = y == a.ignore_index && tiled;
      if (!ignored && (y < 0 || y >= a.vocab)) {
        if (tiled && a.error_count) atomicAdd(a.error_count, 1);
        invalid = true;
      }
      if (!ignored && !invalid && weights) w_y = weights[y];
    }
    float loss, lse, mass = 0.0f;
    std::int64_t best = -1;
    if (ignored || invalid) {  // as finish_skipped in the row kernel
      loss = lse = invalid ? NAN : 0.0f;
    } else {
      // Rank order, on every rank: the same bits everywhere (parallel/communicator.hpp).
      slice_partial p = x.record(0, n);
      for (int r = 1; r < x.ranks; ++r) p.merge(x.record(r, n));
      lse = p.stats.lse.lse();
      if constexpr (Tgt::soft) {
        loss = soft_row_loss(p.stats, a.k);
      } else {
        loss = class_row_loss(p.stats, w_y, a.k);
      }
      mass = p.stats.mass;
      best = p.argmax.index;
    }
    write_row_outputs(a, n, loss, lse, best, best >= 0 && best == y, need_reduce);
    x.lse_rows[n] = lse;
    x.mass_rows[n] = mass;
  }
  if (need_reduce)
    finish_reduction<Block>(a.workspace, a.rows, my_rows, a.loss, a.num_correct, normalizer);
}

}  // namespace cuda_detail
}  // namespace xent
