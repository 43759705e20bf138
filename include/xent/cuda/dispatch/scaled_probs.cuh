// The buffers of fused linear training's scaled-probabilities path
// (kernels/scaled_probs_kernels.cuh) in a chunk's region, as the linear plan lays them out.
#pragma once

#include <cuda_bf16.h>

#include "../kernels/scaled_probs_kernels.cuh"
#include "../kernels/stats_gemm_kernel.cuh"
#include "linear_plan.cuh"

namespace xent {
namespace cuda_detail {
namespace scaled_probs {

static_assert(probs_tile_cols == stats_gemm::tile_n, "the plan's partials per row");
static_assert(probs_tile_rows == stats_gemm::tile_m, "the plan's flags per row tile");
static_assert(sizeof(stats_gemm::partial) == probs_partial_bytes, "the plan's partial size");

inline buffers make_buffers(char* region, const probs_layout& l) {
  buffers b;
  b.partials = reinterpret_cast<stats_gemm::partial*>(region + l.partials);
  b.hidden = reinterpret_cast<__nv_bfloat16*>(region + l.hidden);
  b.ref = reinterpret_cast<float*>(region + l.ref);
  b.mult = reinterpret_cast<float*>(region + l.mult);
  b.beta = reinterpret_cast<float*>(region + l.beta);
  b.patch = reinterpret_cast<float*>(region + l.patch);
  b.target_logit = reinterpret_cast<float*>(region + l.target_logit);
  b.tile_flags = reinterpret_cast<int*>(region + l.flags);
  b.second = reinterpret_cast<int*>(region + l.second);
  b.row_tiles = static_cast<int>(l.row_tiles);
  return b;
}

}  // namespace scaled_probs
}  // namespace cuda_detail
}  // namespace xent
