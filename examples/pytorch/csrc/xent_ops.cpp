// PyTorch custom ops over xent's cross-entropy: the schemas (TORCH_LIBRARY) and the CPU kernels,
// the op bodies of xent_ops.h (cross-entropy and fused linear cross-entropy) instantiated for
// xent::cpu. The autograd formulas are registered by xent_autograd.cpp (C++, every device), the
// fake (meta) kernels that torch.compile traces with in Python (xent_torch/ops.py). The CUDA
// kernels are registered by xent_ops_cuda.cu, built beside this file when torch has CUDA and nvcc
// is found.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "xent_ops.h"

namespace xent_torch {
namespace {

// The CPU backend of the op bodies in xent_ops.h: torch's intra-op thread count, no workspace.
struct cpu_backend {
  struct guard {
    explicit guard(const c10::Device&) {}
  };
  struct call {
    xent::cpu exec;
  };
  static call exec(const at::Tensor&, bool, bool = false) {
    return {xent::cpu{std::max(1, at::get_num_threads())}};
  }
};

}  // namespace
}  // namespace xent_torch

TORCH_LIBRARY(xent, m) {
  m.def(
      "cross_entropy_fwd(Tensor input, Tensor target, Tensor? weight, int ignore_index, "
      "int reduction, float label_smoothing, float z_loss, float softcap, bool inplace_backward) "
      "-> (Tensor loss, Tensor lse)");
  m.def(
      "cross_entropy_bwd(Tensor grad_output, Tensor input, Tensor target, Tensor? weight, "
      "Tensor lse, int ignore_index, int reduction, float label_smoothing, float z_loss, "
      "float softcap) -> Tensor");
  m.def(
      "cross_entropy_bwd_(Tensor grad_output, Tensor(a!) input, Tensor target, Tensor? weight, "
      "Tensor lse, int ignore_index, int reduction, float label_smoothing, float z_loss, "
      "float softcap) -> ()");
  m.def(
      "linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor? class_weight, int ignore_index, int reduction, float label_smoothing, "
      "float z_loss, float softcap) -> (Tensor loss, Tensor lse)");
  m.def(
      "linear_cross_entropy_bwd(Tensor grad_output, Tensor hidden, Tensor weight, Tensor? bias, "
      "Tensor target, Tensor? class_weight, Tensor lse, int ignore_index, int reduction, "
      "float label_smoothing, float z_loss, float softcap) "
      "-> (Tensor d_hidden, Tensor d_weight, Tensor d_bias)");
}

TORCH_LIBRARY_IMPL(xent, CPU, m) {
  using xent_torch::cpu_backend;
  m.impl("cross_entropy_fwd", &xent_torch::cross_entropy_fwd<cpu_backend>);
  m.impl("cross_entropy_bwd", &xent_torch::cross_entropy_bwd<cpu_backend>);
  m.impl("cross_entropy_bwd_", &xent_torch::cross_entropy_bwd_inplace<cpu_backend>);
  m.impl("linear_cross_entropy_fwd", &xent_torch::linear_cross_entropy_fwd<cpu_backend>);
  m.impl("linear_cross_entropy_bwd", &xent_torch::linear_cross_entropy_bwd<cpu_backend>);
}
