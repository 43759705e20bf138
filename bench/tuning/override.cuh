// The tuning override of xent's benchmark and test builds (XENT_CUDA_TUNING in CMake,
// bench/cuda_variants.sh): the row the build is tuned for (XENT_CUDA_TUNED_MAJOR) with each
// number whose XENT_CUDA_<NAME> macro is defined replaced by it.
// include/xent/cuda/tuning/policy.cuh includes it through XENT_CUDA_TUNING_OVERRIDE. It takes the
// table from the include path, never by a path relative to itself: a build of another include/
// tree (bench/cuda_variants.sh's @DIR) then sees that tree's table alone, once.
#pragma once

#include <xent/cuda/tuning/policy.cuh>

namespace xent {
namespace cuda_detail {

constexpr tuning overridden(tuning r) {
#ifdef XENT_CUDA_BLOCK
  r.block = XENT_CUDA_BLOCK;
#endif
#ifdef XENT_CUDA_STAGES
  r.stages = XENT_CUDA_STAGES;
#endif
#ifdef XENT_CUDA_STATS_UNROLL
  r.stats_unroll = XENT_CUDA_STATS_UNROLL;
#endif
#ifdef XENT_CUDA_SPLIT_BARRIERS
  r.split_barriers = XENT_CUDA_SPLIT_BARRIERS;
#endif
#ifdef XENT_CUDA_CHUNK_KIB
  r.chunk_kib = XENT_CUDA_CHUNK_KIB;
#endif
#ifdef XENT_CUDA_RUNNING_MAX
  r.running_max = XENT_CUDA_RUNNING_MAX;
#endif
#ifdef XENT_CUDA_WHOLE_ROWS
  r.whole_rows = XENT_CUDA_WHOLE_ROWS;
#endif
#ifdef XENT_CUDA_STREAM_BACKWARD
  r.stream_backward = XENT_CUDA_STREAM_BACKWARD;
#endif
#ifdef XENT_CUDA_FOLD_SCALE
  r.fold_scale = XENT_CUDA_FOLD_SCALE;
#endif
#ifdef XENT_CUDA_EXP_ONCE
  r.exp_once = XENT_CUDA_EXP_ONCE;
#endif
#ifdef XENT_CUDA_STREAM_REGS
  r.stream_regs = XENT_CUDA_STREAM_REGS;
#endif
#ifdef XENT_CUDA_SMALL_REGS
  r.small_regs = XENT_CUDA_SMALL_REGS;
#endif
#ifdef XENT_CUDA_SMALL_EXP_ONCE
  r.small_exp_once = XENT_CUDA_SMALL_EXP_ONCE;
#endif
#ifdef XENT_CUDA_SMALL_CTAS_PER_SM
  r.small_ctas_per_sm = XENT_CUDA_SMALL_CTAS_PER_SM;
#endif
#ifdef XENT_CUDA_BULK_BACKWARD
  r.bulk_backward = XENT_CUDA_BULK_BACKWARD;
#endif
#ifdef XENT_CUDA_BULK_BACKWARD_REGS
  r.bulk_backward_regs = XENT_CUDA_BULK_BACKWARD_REGS;
#endif
#ifdef XENT_CUDA_BULK_BACKWARD_STAGES
  r.bulk_backward_stages = XENT_CUDA_BULK_BACKWARD_STAGES;
#endif
#ifdef XENT_CUDA_BULK_BACKWARD_MIN_BLOCKS
  r.bulk_backward_min_blocks = XENT_CUDA_BULK_BACKWARD_MIN_BLOCKS;
#endif
#ifdef XENT_CUDA_BULK_BACKWARD_LONG_FROM_KIB
  r.bulk_backward_long_from_kib = XENT_CUDA_BULK_BACKWARD_LONG_FROM_KIB;
#endif
#ifdef XENT_CUDA_BULK_BACKWARD_LONG_STAGES
  r.bulk_backward_long_stages = XENT_CUDA_BULK_BACKWARD_LONG_STAGES;
#endif
#ifdef XENT_CUDA_BULK_BACKWARD_LONG_MIN_BLOCKS
  r.bulk_backward_long_min_blocks = XENT_CUDA_BULK_BACKWARD_LONG_MIN_BLOCKS;
#endif
#ifdef XENT_CUDA_BULK_GRADIENT
  r.bulk_gradient = XENT_CUDA_BULK_GRADIENT;
#endif
#ifdef XENT_CUDA_WIDE_ROWS
  r.wide_rows = XENT_CUDA_WIDE_ROWS;
#endif
#ifdef XENT_CUDA_WIDE_FROM_KIB
  r.wide_from_kib = XENT_CUDA_WIDE_FROM_KIB;
#endif
#ifdef XENT_CUDA_STREAM_FORWARD
  r.stream_forward = XENT_CUDA_STREAM_FORWARD;
#endif
#ifdef XENT_CUDA_STREAM_FORWARD_REGS
  r.stream_forward_regs = XENT_CUDA_STREAM_FORWARD_REGS;
#endif
#ifdef XENT_CUDA_STREAM_FORWARD_MIN_BLOCKS
  r.stream_forward_min_blocks = XENT_CUDA_STREAM_FORWARD_MIN_BLOCKS;
#endif
#ifdef XENT_CUDA_STREAM_FORWARD_BLOCK
  r.stream_forward_block = XENT_CUDA_STREAM_FORWARD_BLOCK;
#endif
#ifdef XENT_CUDA_STREAM_FORWARD_WIDE_FROM_KIB
  r.stream_forward_wide_from_kib = XENT_CUDA_STREAM_FORWARD_WIDE_FROM_KIB;
#endif
#ifdef XENT_CUDA_STATS_GEMM
  r.stats_gemm = XENT_CUDA_STATS_GEMM;
#endif
#ifdef XENT_CUDA_STATS_GEMM_CLUSTER
  r.stats_gemm_cluster = XENT_CUDA_STATS_GEMM_CLUSTER;
#endif
#ifdef XENT_CUDA_STATS_GEMM_LOGITS
  r.stats_gemm_logits = XENT_CUDA_STATS_GEMM_LOGITS;
#endif
#ifdef XENT_CUDA_SCALED_PROBS
  r.scaled_probs = XENT_CUDA_SCALED_PROBS;
#endif
#ifdef XENT_CUDA_ACCUMULATE_BY_LT
  r.accumulate_by_lt = XENT_CUDA_ACCUMULATE_BY_LT;
#endif
#ifdef XENT_CUDA_NORMALIZER_AHEAD
  r.normalizer_ahead = XENT_CUDA_NORMALIZER_AHEAD;
#endif
#ifdef XENT_CUDA_ROW_QUEUE
  r.row_queue = XENT_CUDA_ROW_QUEUE;
#endif
#ifdef XENT_CUDA_STREAM_FORWARD_HANDOFF
  r.stream_forward_handoff = XENT_CUDA_STREAM_FORWARD_HANDOFF;
#endif
#ifdef XENT_CUDA_SHIFTED_ROWS
  r.shifted_rows = XENT_CUDA_SHIFTED_ROWS;
#endif
#ifdef XENT_CUDA_TRIM_TILES
  r.trim_tiles = XENT_CUDA_TRIM_TILES;
#endif
#ifdef XENT_CUDA_WARP_ROWS_KIB
  r.warp_rows_kib = XENT_CUDA_WARP_ROWS_KIB;
#endif
#ifdef XENT_CUDA_WARP_ROWS_SHIFTED
  r.warp_rows_shifted = XENT_CUDA_WARP_ROWS_SHIFTED;
#endif
#ifdef XENT_CUDA_WARP_ROWS_SHIFTED_PASSES
  r.warp_rows_shifted_passes = XENT_CUDA_WARP_ROWS_SHIFTED_PASSES;
#endif
#ifdef XENT_CUDA_SPLIT_FUSED_KIB
  r.split_fused_kib = XENT_CUDA_SPLIT_FUSED_KIB;
#endif
#ifdef XENT_CUDA_BALANCED_GRID
  r.balanced_grid = XENT_CUDA_BALANCED_GRID;
#endif
#ifdef XENT_CUDA_STREAM_MIN_BLOCKS
  r.stream_min_blocks = XENT_CUDA_STREAM_MIN_BLOCKS;
#endif
#ifdef XENT_CUDA_STREAM_OPTION_MIN_BLOCKS
  r.stream_option_min_blocks = XENT_CUDA_STREAM_OPTION_MIN_BLOCKS;
#endif
#ifdef XENT_CUDA_WARP_ROWS_REGS
  r.warp_rows_regs = XENT_CUDA_WARP_ROWS_REGS;
#endif
#ifdef XENT_CUDA_WARP_ROWS_MIN_BLOCKS
  r.warp_rows_min_blocks = XENT_CUDA_WARP_ROWS_MIN_BLOCKS;
#endif
#ifdef XENT_CUDA_WARP_ROWS_FORWARD_MIN_BLOCKS
  r.warp_rows_forward_min_blocks = XENT_CUDA_WARP_ROWS_FORWARD_MIN_BLOCKS;
#endif
#ifdef XENT_CUDA_WARP_ROWS_LONG_REGS
  r.warp_rows_long_regs = XENT_CUDA_WARP_ROWS_LONG_REGS;
#endif
#ifdef XENT_CUDA_WARP_ROWS_LONG_MIN_BLOCKS
  r.warp_rows_long_min_blocks = XENT_CUDA_WARP_ROWS_LONG_MIN_BLOCKS;
#endif
#ifdef XENT_CUDA_MIN_BLOCKS
  r.min_blocks = XENT_CUDA_MIN_BLOCKS;
#endif
#ifdef XENT_CUDA_OVERLAP_ROWS
  r.overlap_rows = XENT_CUDA_OVERLAP_ROWS;
#endif
  return r;
}

#ifdef XENT_CUDA_TUNING_OVERRIDE
/// The row this build's kernels are compiled with.
constexpr tuning tuned = overridden(tuned_row);
#endif

}  // namespace cuda_detail
}  // namespace xent
