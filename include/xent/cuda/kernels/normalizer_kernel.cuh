// The mean's normaliser ahead of the row kernels. Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../block/row_sums.cuh"
#include "../cuda.cuh"
#include "../tuning/policy.cuh"

namespace xent {
namespace cuda_detail {

/// The mean's normaliser by one CTA ahead of the row kernel, into the workspace header: the row
/// kernel is launched as its programmatic dependant, starts while this runs and waits for it
/// (normalizer_from_ahead) only where it needs W, so 8192 targets are read once per call rather
/// than once per CTA at every CTA's start.
template <int Block, class Tgt>
XENT_KERNEL void __launch_bounds__(Block)
    normalizer_kernel(Tgt targets, std::int64_t rows, std::int64_t cols, std::int64_t ignore_index,
                      const float* weights, void* workspace) {
#if XENT_CUDA_SM90_PTX
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const double w = mean_normalizer<Block>(targets, rows, cols, ignore_index, weights);
  if (threadIdx.x == 0) header(workspace)->normalizer = w;
}

}  // namespace cuda_detail
}  // namespace xent
