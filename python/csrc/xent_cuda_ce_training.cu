// Cross-entropy training: the forward+backward in one pass (xent::forward_backward), out of place
// and in place, instantiated for CUDA (xent_cuda_backend.h) and registered under the CUDA dispatch
// key. One of the .cu files that python/CMakeLists.txt builds side by side when torch has CUDA and
// nvcc is found (the backward from a saved LSE is xent_cuda_ce_backward.cu's).
#include <torch/library.h>

#include "xent_cuda_backend.h"
#include "xent_ops.h"

TORCH_LIBRARY_IMPL(xent, CUDA, m) {
  using xent_torch::cuda_backend;
  m.impl("cross_entropy_fwd_bwd", &xent_torch::cross_entropy_fwd_bwd<cuda_backend>);
  m.impl("cross_entropy_fwd_bwd_", &xent_torch::cross_entropy_fwd_bwd_inplace<cuda_backend>);
}
