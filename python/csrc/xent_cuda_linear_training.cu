// Fused linear cross-entropy training: the forward+backward in one call
// (xent::linear_forward_backward), instantiated for CUDA (xent_cuda_backend.h) and registered under
// the CUDA dispatch key, with the query of the workspace the linear ops allocate. One of the .cu
// files that python/CMakeLists.txt builds side by side when torch has CUDA and nvcc is found (the
// backward from a saved LSE is xent_cuda_linear_backward.cu's).
#include <torch/library.h>

#include "xent_cuda_backend.h"
#include "xent_ops.h"

TORCH_LIBRARY_IMPL(xent, CUDA, m) {
  using xent_torch::cuda_backend;
  m.impl("linear_cross_entropy_fwd_bwd", &xent_torch::linear_cross_entropy_fwd_bwd<cuda_backend>);
  m.impl("linear_workspace_bytes", &xent_torch::linear_workspace_bytes<cuda_backend>);
}
