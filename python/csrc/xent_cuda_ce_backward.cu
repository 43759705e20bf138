// Cross-entropy's backward from a saved LSE (xent::backward), out of place and in place,
// instantiated for CUDA (xent_cuda_backend.h) and registered under the CUDA dispatch key. One of
// the .cu files that python/CMakeLists.txt builds side by side when torch has CUDA and nvcc is
// found.
#include <torch/library.h>

#include "xent_cuda_backend.h"
#include "xent_ops.h"

TORCH_LIBRARY_IMPL(xent, CUDA, m) {
  using xent_torch::cuda_backend;
  m.impl("cross_entropy_bwd", &xent_torch::cross_entropy_bwd<cuda_backend>);
  m.impl("cross_entropy_bwd_", &xent_torch::cross_entropy_bwd_inplace<cuda_backend>);
}
