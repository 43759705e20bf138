// PyTorch custom ops over xent's cross-entropy: the schemas (TORCH_LIBRARY) and the CPU kernels,
// the op bodies of xent_ops.h (cross-entropy and fused linear cross-entropy) instantiated for
// xent::cpu. The autograd formulas are registered by xent_autograd.cpp (C++, every device), the
// fake (meta) kernels that torch.compile traces with in Python (xent/torch/ops.py). The CUDA
// kernels are registered by xent_ops_cuda.cu, built beside this file when torch has CUDA and nvcc
// is found.
#include <torch/library.h>

#include "xent_cpu_backend.h"
#include "xent_ops.h"

namespace xent_torch {
namespace {

// grad *= scale, each element multiplied in Acc (float32; float64 for a float64 grad) and rounded
// to grad's dtype once, as the CUDA kernel does. aten's mul_ by a scalar would round the scalar to
// a 16-bit grad's dtype first: a GradScaler's 65536 is inf in float16, 1/3 is 0.33398 in bfloat16.
template <class T, class Acc>
void scale_elements(const at::Tensor& grad, Acc scale) {
  T* data = grad.data_ptr<T>();
  const auto times = [scale](T v) { return static_cast<T>(static_cast<Acc>(v) * scale); };
  if (grad.is_contiguous()) {
    at::parallel_for(0, grad.numel(), 1 << 16, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) data[i] = times(data[i]);
    });
    return;
  }
  // 2-D (an in-place gradient is the caller's logits, whose rows may be padded), or a 1-D vector
  // taken as one row; grad_scale_of admits no other layout.
  const bool matrix = grad.dim() == 2;
  const std::int64_t cols = matrix ? grad.size(1) : grad.numel();
  const std::int64_t row_stride = matrix ? grad.stride(0) : 0, col_stride = grad.stride(-1);
  at::parallel_for(0, matrix ? grad.size(0) : 1, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r)
      for (std::int64_t c = 0; c < cols; ++c) {
        T& e = data[r * row_stride + c * col_stride];
        e = times(e);
      }
  });
}

// On the CPU the upstream gradient is read where it lies. Exactly 1 (loss.backward()) leaves the
// gradient as it is, as on CUDA.
void scale_grad_cpu(const at::Tensor& grad, const at::Tensor& grad_output) {
  const double scale = grad_scale_of(grad, grad_output).item<double>();
  if (scale == 1.0 || grad.numel() == 0) return;
  switch (grad.scalar_type()) {
    case at::kDouble:
      return scale_elements<double>(grad, scale);
    case at::kFloat:
      return scale_elements<float>(grad, static_cast<float>(scale));
    case at::kBFloat16:
      return scale_elements<c10::BFloat16>(grad, static_cast<float>(scale));
    default:
      return scale_elements<c10::Half>(grad, static_cast<float>(scale));
  }
}

}  // namespace
}  // namespace xent_torch

TORCH_LIBRARY(xent, m) {
  // The cross-entropy forwards' stats: int64, each row's argmax (N entries, -1 on ignored rows)
  // when return_argmax, then the count of rows not ignored whose argmax is their target when
  // return_num_correct; (0,) when neither is asked for.
  m.def(
      "cross_entropy_fwd(Tensor input, Tensor target, Tensor? weight, int ignore_index, "
      "int reduction, float label_smoothing, float z_loss, float softcap, bool inplace_backward, "
      "bool return_argmax, bool return_num_correct) -> (Tensor loss, Tensor lse, Tensor stats)");
  m.def(
      "cross_entropy_bwd(Tensor grad_output, Tensor input, Tensor target, Tensor? weight, "
      "Tensor lse, int ignore_index, int reduction, float label_smoothing, float z_loss, "
      "float softcap) -> Tensor");
  m.def(
      "cross_entropy_bwd_(Tensor grad_output, Tensor(a!) input, Tensor target, Tensor? weight, "
      "Tensor lse, int ignore_index, int reduction, float label_smoothing, float z_loss, "
      "float softcap) -> ()");
  // The linear ops' order, accumulate and sparse_threshold, last and defaulted: a training call's
  // choices (xent_ops.h, linear_choices: 0 is xent's default, automatic / fp32 / exact); the
  // forward only checks them, and carries them for the backward of a call on the split path.
  m.def(
      "linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor? class_weight, int ignore_index, int reduction, float label_smoothing, "
      "float z_loss, float softcap, int order=0, int accumulate=0, float sparse_threshold=0.0) "
      "-> (Tensor loss, Tensor lse)");
  m.def(
      "linear_cross_entropy_bwd(Tensor grad_output, Tensor hidden, Tensor weight, Tensor? bias, "
      "Tensor target, Tensor? class_weight, Tensor lse, int ignore_index, int reduction, "
      "float label_smoothing, float z_loss, float softcap, bool[3] output_mask, int order=0, "
      "int accumulate=0, float sparse_threshold=0.0) -> (Tensor d_hidden, Tensor d_weight, "
      "Tensor d_bias)");
  // The linear ops' output_mask: which of d_hidden, d_weight, d_bias to compute (a frozen LM head
  // skips its d_weight GEMM); a gradient not asked for is returned empty, (0,).
  // Training in one call for reduction mean or sum: the forward's results and the gradient with
  // upstream 1, which the autograd node scales by the loss's gradient (scale_grad_) in backward.
  m.def(
      "cross_entropy_fwd_bwd(Tensor input, Tensor target, Tensor? weight, int ignore_index, "
      "int reduction, float label_smoothing, float z_loss, float softcap, bool return_argmax, "
      "bool return_num_correct) -> (Tensor loss, Tensor lse, Tensor stats, Tensor grad)");
  m.def(
      "cross_entropy_fwd_bwd_(Tensor(a!) input, Tensor target, Tensor? weight, int ignore_index, "
      "int reduction, float label_smoothing, float z_loss, float softcap, bool return_argmax, "
      "bool return_num_correct) -> (Tensor loss, Tensor lse, Tensor stats)");
  m.def(
      "linear_cross_entropy_fwd_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor? class_weight, int ignore_index, int reduction, float label_smoothing, "
      "float z_loss, float softcap, bool[3] output_mask, int order=0, int accumulate=0, "
      "float sparse_threshold=0.0) "
      "-> (Tensor loss, Tensor lse, Tensor d_hidden, Tensor d_weight, Tensor d_bias)");
  m.def("scale_grad_(Tensor(a!) grad, Tensor grad_output) -> ()");
  // The workspace bytes the linear ops allocate for these shapes, dtype, device and choices
  // (training: the _bwd and _fwd_bwd ops; d_weight: whether the call computes it).
  m.def(
      "linear_workspace_bytes(Tensor hidden, Tensor weight, bool training, bool d_weight, "
      "int order=0, int accumulate=0, float sparse_threshold=0.0) -> int");
}

TORCH_LIBRARY_IMPL(xent, CPU, m) {
  using xent_torch::cpu_backend;
  m.impl("cross_entropy_fwd", &xent_torch::cross_entropy_fwd<cpu_backend>);
  m.impl("cross_entropy_bwd", &xent_torch::cross_entropy_bwd<cpu_backend>);
  m.impl("cross_entropy_bwd_", &xent_torch::cross_entropy_bwd_inplace<cpu_backend>);
  m.impl("linear_cross_entropy_fwd", &xent_torch::linear_cross_entropy_fwd<cpu_backend>);
  m.impl("linear_cross_entropy_bwd", &xent_torch::linear_cross_entropy_bwd<cpu_backend>);
  m.impl("cross_entropy_fwd_bwd", &xent_torch::cross_entropy_fwd_bwd<cpu_backend>);
  m.impl("cross_entropy_fwd_bwd_", &xent_torch::cross_entropy_fwd_bwd_inplace<cpu_backend>);
  m.impl("linear_cross_entropy_fwd_bwd", &xent_torch::linear_cross_entropy_fwd_bwd<cpu_backend>);
  m.impl("scale_grad_", &xent_torch::scale_grad_cpu);
  m.impl("linear_workspace_bytes", &xent_torch::linear_workspace_bytes<cpu_backend>);
}
