// The device-neutral half of the PyTorch ops: tensor-to-view adapters and the op bodies, written
// once as templates over a backend (xent_ops.cpp instantiates them for the CPU, xent_ops_cuda.cu
// for CUDA). A backend B provides
//   B::guard        constructed from the input's device for the op's duration (a CUDA device
//                   guard; nothing on the CPU)
//   B::exec(x, ws, blas)  the execution object of one call on tensors like x: {exec, hold},
//                   where `hold` keeps alive whatever the call borrows (a per-call workspace); ws
//                   says whether the call needs xent's reduced-loss workspace, blas whether it
//                   runs GEMMs (fused linear calls: the cuBLAS handle)
//
// The ops take 2-D logits (N x C, class dimension last, last dimension contiguous; any row stride
// is passed to xent as the leading dimension); the Python wrappers flatten (..., C) inputs. Every
// reduction and every per-row result is of xent's accumulator type (xent::accumulator_t): float64
// for float64 inputs (CPU only), float32 otherwise; the wrapper casts the loss to the input's
// dtype.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include <xent/xent.hpp>

#include "layout.h"
#include "linear_choices.h"

namespace xent_torch {

// The Python side passes reduction as an int with these values (torch's own enum order:
// at::Reduction::None = 0, Mean = 1, Sum = 2).
inline xent::reduction to_reduction(std::int64_t r) {
  TORCH_CHECK_VALUE(r >= 0 && r <= 2, "xent: reduction must be 0 (none), 1 (mean) or 2 (sum), got ",
                    r);
  return r == 0 ? xent::reduction::none : (r == 1 ? xent::reduction::mean : xent::reduction::sum);
}

// A matrix (logits by default) as a 2-D tensor whose last dimension is contiguous (a copy only
// when it is not), so the row stride can be xent's leading dimension; errors name the argument.
inline at::Tensor rows_view(const at::Tensor& input, const char* name = "input",
                            const char* dims = "(N, C)") {
  TORCH_CHECK_VALUE(input.dim() == 2, "xent: ", name, " must be 2-D ", dims, ", got ", input.dim(),
                    "-D");
  return rows_readable_in_place(input) ? input : input.contiguous();
}

// torch's element type -> xent's (same 16-bit layouts: Eigen's bfloat16 / half and c10's are both
// the plain IEEE / brain-float bit patterns; the CUDA backend reads them as __nv_bfloat16 /
// __half).
template <class T>
xent::matrix_view<T> matrix_of(const at::Tensor& t) {
  using X = std::remove_const_t<T>;
  static_assert(sizeof(X) == 2 || sizeof(X) == 4 || sizeof(X) == 8, "xent: 16-, 32- or 64-bit");
  auto* data = reinterpret_cast<T*>(t.data_ptr());
  const std::int64_t ld = t.size(0) <= 1 ? t.size(1) : t.stride(0);
  return {data, t.size(0), t.size(1), ld};
}

template <class T>
xent::vector_view<T> vector_of(const at::Tensor& t) {
  if (!t.defined()) return {};
  return {reinterpret_cast<T*>(t.data_ptr()), t.numel()};
}

// float32, bfloat16 and float16 on every device; float64 on the CPU only (xent's CPU backend
// accumulates float64 in double; the CUDA backend has no float64 kernels).
inline void check_input_dtype(const at::Tensor& input, const char* name = "input") {
  const auto st = input.scalar_type();
  TORCH_CHECK_TYPE(st != at::kDouble || input.device().is_cpu(), "xent: ", name, " is float64 on ",
                   input.device(),
                   ": float64 runs on the CPU only (on CUDA use float32, bfloat16 or float16)");
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble,
                   "xent: ", name,
                   " must be float32, bfloat16, float16 or (on the CPU) float64, got ", st);
}

// The dtype of the results of a call on x: float64 for float64 x, float32 otherwise.
inline at::ScalarType accumulator_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Whether backend B's execution object takes float64 (the CPU's; not CUDA's, whose op bodies are
// then compiled without a float64 case).
template <class B>
constexpr bool runs_float64 =
    xent::backend_traits<std::decay_t<decltype(B::exec(std::declval<const at::Tensor&>(), false)
                                                   .exec)>>::template supports_dtype<double>;

/// A RuntimeError, as torch's own operators raise for tensors on different devices (and as the
/// Python wrappers' check before it, xent/torch/ops.py).
inline void check_same_device(const at::Tensor& input, const at::Tensor& other, const char* name) {
  TORCH_CHECK(other.device() == input.device(), "xent: ", name, " is on ", other.device(),
              ", the input on ", input.device(), ": every tensor must be on one device");
}

// The targets of a call over N rows of C classes: class ids (N,), int64 or int32, contiguous; or
// soft targets (class probabilities, N x C), floating point as torch's are, held in the dtype of
// x (the logits, or the hidden states of the fused linear op) with a contiguous last dimension.
struct targets {
  at::Tensor t;
  bool soft = false;
};

inline targets targets_of(const at::Tensor& target, const at::Tensor& x, std::int64_t classes) {
  const std::int64_t rows = x.size(0);
  check_same_device(x, target, "target");
  if (at::isFloatingType(target.scalar_type())) {
    TORCH_CHECK_VALUE(target.dim() == 2 && target.size(0) == rows && target.size(1) == classes,
                      "xent: soft targets (class probabilities) must be (N, C) with N = ", rows,
                      ", C = ", classes, ", got ", target.sizes());
    return {rows_view(target.to(x.scalar_type())), true};
  }
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
                   "xent: target must hold class ids as int64 or int32 (or class probabilities "
                   "of the input's shape), got ",
                   target.scalar_type());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == rows,
                    "xent: target must be (N,) with N = ", rows, ", got ", target.sizes());
  return {target.contiguous(), false};
}

// Class weights as C float32 values (empty when absent): xent::options' weights are float for
// every dtype, float64 included (a float64 weight is rounded to float32).
inline at::Tensor weights_of(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                             std::int64_t cols, const char* name = "weight") {
  if (!weight.has_value() || !weight->defined()) return {};
  check_same_device(input, *weight, name);
  TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == cols, "xent: ", name,
                    " must be (C,) with C = ", cols, ", got ", weight->sizes());
  return weight->to(at::kFloat).contiguous();
}

inline xent::options options_of(const at::Tensor& weights, std::int64_t ignore_index,
                                std::int64_t reduction, double label_smoothing, double z_loss,
                                double softcap) {
  xent::options opts;
  opts.reduce = to_reduction(reduction);
  opts.ignore_index = ignore_index;
  opts.label_smoothing = static_cast<float>(label_smoothing);
  opts.z_loss = static_cast<float>(z_loss);
  opts.softcap = static_cast<float>(softcap);
  // A cap so small that float32 holds it as 0 would turn softcap off without a word.
  TORCH_CHECK_VALUE(softcap == 0.0 || opts.softcap != 0.0f,
                    "xent: softcap must be 0 (off) or at least 2.9e-39 (1 / softcap finite in "
                    "float), got ",
                    softcap);
  if (weights.defined()) opts.class_weights = {weights.data_ptr<float>(), weights.numel()};
  return opts;
}

// What every cross-entropy call derives from its arguments over the logits x: the targets, the
// class weights (which opts points into, so they travel together) and xent's options.
struct ce_inputs {
  targets tg;
  at::Tensor weights;
  xent::options opts;
};

inline ce_inputs ce_inputs_of(const at::Tensor& x, const at::Tensor& target,
                              const std::optional<at::Tensor>& weight, std::int64_t ignore_index,
                              std::int64_t reduction, double label_smoothing, double z_loss,
                              double softcap) {
  ce_inputs in;
  in.tg = targets_of(target, x, x.size(1));
  in.weights = weights_of(x, weight, x.size(1));
  in.opts = options_of(in.weights, ignore_index, reduction, label_smoothing, z_loss, softcap);
  return in;
}

// The side outputs a cross-entropy forward may also write (xent::basic_forward_outputs' argmax
// and num_correct), asked for by the ops' return_argmax / return_num_correct: one int64 tensor,
// `stats`, holds the N rows' argmax (when asked) and then num_correct (when asked); it is (0,)
// when neither is, so a call asking for nothing pays one empty tensor and no pass.
struct side_outputs {
  bool argmax = false, num_correct = false;
};

// A forward's results over the N rows of x, in its accumulator dtype (float32; float64 for
// float64 x): the loss (0-d for mean / sum, (N,) for none), the per-row LSE and the side outputs,
// and xent's view of them for a call accumulating in A.
struct loss_outputs {
  at::Tensor loss, lse, stats;
  side_outputs side;

  loss_outputs(const at::Tensor& x, xent::reduction reduce, side_outputs s = {}) : side(s) {
    const std::int64_t n = x.size(0);
    const auto acc = x.options().dtype(accumulator_dtype(x));
    loss = reduce == xent::reduction::none ? at::empty({n}, acc) : at::empty({}, acc);
    lse = at::empty({n}, acc);
    stats = at::empty({(side.argmax ? n : 0) + (side.num_correct ? 1 : 0)},
                      x.options().dtype(at::kLong));
  }

  template <class A>
  xent::basic_forward_outputs<A> view() const {
    xent::basic_forward_outputs<A> out;
    if (loss.dim() == 0)
      out.loss = loss.data_ptr<A>();
    else
      out.row_loss = {loss.data_ptr<A>(), loss.numel()};
    out.lse = {lse.data_ptr<A>(), lse.numel()};
    auto* st = stats.data_ptr<std::int64_t>();
    if (side.argmax) out.argmax = {st, lse.numel()};
    if (side.num_correct) out.num_correct = st + (side.argmax ? lse.numel() : 0);
    return out;
  }

  // Whether a CUDA call needs the reduced-loss workspace (for the loss or num_correct's count).
  bool reduces() const { return loss.dim() == 0 || side.num_correct; }
};

// The fused forward+backward ops compute the gradient with upstream 1, before the loss's gradient
// exists; the autograd node scales it in backward (scale_grad_). That takes a scalar upstream:
// with reduction none each row's upstream gradient is known only in backward.
inline void check_fused_reduction(const xent::options& opts) {
  TORCH_CHECK_VALUE(opts.reduce != xent::reduction::none,
                    "xent: a fused forward+backward needs reduction mean or sum (with none, each "
                    "row's upstream gradient is known only in backward)");
}

// Calls f(element tag) with xent's element type for the input's dtype: float32, bfloat16,
// float16, and float64 where backend B runs it.
template <class B, class F>
void dispatch_dtype(const at::Tensor& input, F&& f) {
  switch (input.scalar_type()) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(Eigen::bfloat16{});
      break;
    case at::kHalf:
      f(Eigen::half{});
      break;
    case at::kDouble:
      if constexpr (runs_float64<B>) {
        f(double{});
        break;
      }
      [[fallthrough]];
    default:
      check_input_dtype(input);
  }
}

// Calls f(element tag, targets view) with xent's element type for the input's dtype and xent's
// view of the targets (vector_view<const int64/int32> or soft_targets<element>): nine
// instantiations per op (3 dtypes x 3 kinds of target), twelve where backend B runs float64.
template <class B, class F>
void dispatch(const at::Tensor& input, const targets& tg, F&& f) {
  dispatch_dtype<B>(input, [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t n = input.size(0);
    if (tg.soft)
      f(tag, xent::soft_targets<T>{matrix_of<const T>(tg.t)});
    else if (tg.t.scalar_type() == at::kLong)
      f(tag, xent::vector_view<const std::int64_t>(tg.t.data_ptr<std::int64_t>(), n));
    else
      f(tag, xent::vector_view<const std::int32_t>(tg.t.data_ptr<std::int32_t>(), n));
  });
}

// xent::error names the argument; an out-of-range class id becomes torch's IndexError, anything
// else a ValueError. (CUDA cannot see class ids on the host: there a bad id gives a NaN loss and
// is counted on the device; see xent_ops_cuda.cu.)
template <class F>
void call_xent(F&& f) {
  try {
    f();
  } catch (const xent::error& e) {
    TORCH_CHECK_INDEX(e.argument() != "targets", e.what());
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// Forward: loss (a 0-d float32 tensor for mean / sum, (N,) for none), the per-row LSE saved for
// backward and the side outputs asked for (see side_outputs). inplace_backward is not read here;
// it rides along so the autograd formula sees it.
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_fwd(
    const at::Tensor& input, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap, bool /*inplace_backward*/, bool return_argmax, bool return_num_correct) {
  check_input_dtype(input);
  const typename B::guard device_guard(input.device());
  const at::Tensor x = rows_view(input);
  const ce_inputs in =
      ce_inputs_of(x, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap);
  const loss_outputs out(x, in.opts.reduce, {return_argmax, return_num_correct});
  dispatch<B>(x, in.tg, [&](auto tag, auto tv) {
    using T = decltype(tag);
    const auto call = B::exec(x, out.reduces());
    call_xent([&] {
      xent::forward(call.exec, matrix_of<const T>(x), tv, in.opts,
                    out.view<xent::accumulator_t<T>>());
    });
  });
  return {out.loss, out.lse, out.stats};
}

// The per-row LSE a forward saved, as N values of x's accumulator dtype.
inline at::Tensor saved_lse(const at::Tensor& x, const at::Tensor& lse, std::int64_t n) {
  check_same_device(x, lse, "lse");
  at::Tensor saved = lse.to(accumulator_dtype(x)).contiguous();
  TORCH_CHECK_VALUE(saved.dim() == 1 && saved.size(0) == n, "xent: lse must be (N,)");
  return saved;
}

// The loss's gradient as xent's upstream for a call accumulating in A: g_out (of A's dtype,
// contiguous) is 0-d for mean / sum, read through upstream.scale_ptr (never .item(): on CUDA it
// stays on the device), and (N,) for none, applied per row. g_out must outlive the call that uses
// the result.
template <class A>
xent::basic_upstream<A> upstream_of(const at::Tensor& g_out, xent::reduction reduce,
                                    std::int64_t n) {
  xent::basic_upstream<A> up;
  if (reduce == xent::reduction::none) {
    TORCH_CHECK_VALUE(g_out.numel() == n, "xent: grad_output of reduction none must have N = ", n,
                      " entries, got ", g_out.numel());
    up.rows = {g_out.data_ptr<A>(), n};
  } else {
    TORCH_CHECK_VALUE(g_out.numel() == 1, "xent: grad_output of a reduced loss must be a scalar");
    up.scale_ptr = g_out.data_ptr<A>();
  }
  return up;
}

// grad_output in x's accumulator dtype, contiguous, on x's device (what upstream_of reads).
inline at::Tensor upstream_tensor(const at::Tensor& x, const at::Tensor& grad_output) {
  check_same_device(x, grad_output, "grad_output");
  return grad_output.to(accumulator_dtype(x)).contiguous();
}

// The gradient of the loss with respect to the logits into `grad` (the logits themselves, or a
// fresh tensor), scaled by grad_output (see upstream_of).
template <class B>
void backward_into(const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& target,
                   const std::optional<at::Tensor>& weight, const at::Tensor& lse,
                   std::int64_t ignore_index, std::int64_t reduction, double label_smoothing,
                   double z_loss, double softcap, const at::Tensor& grad) {
  const typename B::guard device_guard(x.device());
  const std::int64_t n = x.size(0);
  const ce_inputs in =
      ce_inputs_of(x, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap);
  const at::Tensor g_out = upstream_tensor(x, grad_output);
  const at::Tensor saved = saved_lse(x, lse, n);

  dispatch<B>(x, in.tg, [&](auto tag, auto tv) {
    using T = decltype(tag);
    using A = xent::accumulator_t<T>;
    const xent::vector_view<const A> lv(saved.data_ptr<A>(), n);
    const auto call = B::exec(x, false);
    call_xent([&] {
      xent::backward(call.exec, matrix_of<const T>(x), tv, in.opts, lv,
                     upstream_of<A>(g_out, in.opts.reduce, n), matrix_of<T>(grad));
    });
  });
}

// Out of place: a new contiguous gradient; the input is only read.
template <class B>
at::Tensor cross_entropy_bwd(const at::Tensor& grad_output, const at::Tensor& input,
                             const at::Tensor& target, const std::optional<at::Tensor>& weight,
                             const at::Tensor& lse, std::int64_t ignore_index,
                             std::int64_t reduction, double label_smoothing, double z_loss,
                             double softcap) {
  check_input_dtype(input);
  const at::Tensor x = rows_view(input);
  at::Tensor grad = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  backward_into<B>(grad_output, x, target, weight, lse, ignore_index, reduction, label_smoothing,
                   z_loss, softcap, grad);
  return grad;
}

// In place: the gradient overwrites `input` (Liger #272: only when the caller asks). An input whose
// last dimension is not contiguous cannot be written row by row; it is refused rather than
// silently copied, so the caller's buffer is never left half-updated.
template <class B>
void cross_entropy_bwd_inplace(const at::Tensor& grad_output, const at::Tensor& input,
                               const at::Tensor& target, const std::optional<at::Tensor>& weight,
                               const at::Tensor& lse, std::int64_t ignore_index,
                               std::int64_t reduction, double label_smoothing, double z_loss,
                               double softcap) {
  check_input_dtype(input);
  TORCH_CHECK_VALUE(rows_readable_in_place(input),
                    "xent: an in-place backward needs 2-D logits whose last dimension is "
                    "contiguous");
  backward_into<B>(grad_output, input, target, weight, lse, ignore_index, reduction,
                   label_smoothing, z_loss, softcap, input);
}

// --- fused forward+backward: one read of the logits, one write of the gradient ------------------

// Loss, LSE and the gradient with upstream 1 into `grad` (the logits themselves, or a fresh
// tensor) in one xent::forward_backward call; see check_fused_reduction.
template <class B>
loss_outputs forward_backward_into(const at::Tensor& x, const at::Tensor& target,
                                   const std::optional<at::Tensor>& weight,
                                   std::int64_t ignore_index, std::int64_t reduction,
                                   double label_smoothing, double z_loss, double softcap,
                                   side_outputs side, const at::Tensor& grad) {
  const typename B::guard device_guard(x.device());
  const ce_inputs in =
      ce_inputs_of(x, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap);
  check_fused_reduction(in.opts);
  const loss_outputs out(x, in.opts.reduce, side);
  dispatch<B>(x, in.tg, [&](auto tag, auto tv) {
    using T = decltype(tag);
    using A = xent::accumulator_t<T>;
    const auto call = B::exec(x, true);
    call_xent([&] {
      xent::forward_backward(call.exec, matrix_of<const T>(x), tv, in.opts,
                             xent::basic_upstream<A>{}, out.view<A>(), matrix_of<T>(grad));
    });
  });
  return out;
}

// Out of place: (loss, lse, stats, grad), grad a new contiguous tensor; the input is only read.
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_fwd_bwd(
    const at::Tensor& input, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap, bool return_argmax, bool return_num_correct) {
  check_input_dtype(input);
  const at::Tensor x = rows_view(input);
  at::Tensor grad = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const loss_outputs out =
      forward_backward_into<B>(x, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                               softcap, {return_argmax, return_num_correct}, grad);
  return {out.loss, out.lse, out.stats, grad};
}

// In place: (loss, lse, stats), the gradient over `input`, refused for the layouts (and for the
// reason) that cross_entropy_bwd_ refuses.
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_fwd_bwd_inplace(
    const at::Tensor& input, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap, bool return_argmax, bool return_num_correct) {
  check_input_dtype(input);
  TORCH_CHECK_VALUE(rows_readable_in_place(input),
                    "xent: an in-place gradient needs 2-D logits whose last dimension is "
                    "contiguous");
  const loss_outputs out =
      forward_backward_into<B>(input, target, weight, ignore_index, reduction, label_smoothing,
                               z_loss, softcap, {return_argmax, return_num_correct}, input);
  return {out.loss, out.lse, out.stats};
}

// scale_grad_(grad, grad_output): grad *= grad_output, the upstream gradient of a reduced loss (one
// element, on grad's device), in place. Checks both and returns the scale in grad's accumulator
// dtype (float32; float64 for a float64 grad); each backend reads it its own way (the CPU on the
// host, CUDA on the device).
inline at::Tensor grad_scale_of(const at::Tensor& grad, const at::Tensor& grad_output) {
  check_input_dtype(grad, "grad");
  check_same_device(grad, grad_output, "grad_output");
  TORCH_CHECK_VALUE(grad_output.numel() == 1,
                    "xent: grad_output of a reduced loss must have one element, got ",
                    grad_output.sizes());
  TORCH_CHECK_VALUE(grad.is_contiguous() || grad.dim() <= 2,
                    "xent: scale_grad_ takes a contiguous gradient or a 1-D or 2-D one, got ",
                    grad.sizes(), " with strides ", grad.strides());
  return grad_output.to(accumulator_dtype(grad));
}

// --- fused linear cross-entropy: logits = hidden weight^T (+ bias), never materialised ----------

struct linear_inputs {
  at::Tensor hidden, weight, bias, class_weights;
  targets tg;
  xent::linear_options opts;
};

// A training call's choices (linear_choices.h), which the schemas take after every other
// argument, with defaults.
struct linear_choices {
  std::int64_t order = 0, accumulate = 0;
  double sparse_threshold = 0.0;
};

inline void set_linear_choices(xent::linear_options& opts, linear_choices c) {
  const xent_bindings::choice_error e = xent_bindings::check_linear_choices(c.order, c.accumulate);
  TORCH_CHECK_VALUE(e.argument.empty(), "xent: ", e.argument, " ", e.what);
  xent_bindings::set_linear_choices(opts, c.order, c.accumulate, c.sparse_threshold);
}

// A training call without d_weight: its float accumulator would have nothing to sum, so neither
// the workspace nor the call plans those V x D floats (a frozen LM head).
inline void plan_without_unused_accumulator(xent::linear_options& opts, bool d_weight) {
  if (!d_weight) opts.accumulate = xent::dw_accumulation::output;
}

inline linear_inputs linear_inputs_of(const at::Tensor& hidden, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias,
                                      const at::Tensor& target,
                                      const std::optional<at::Tensor>& class_weight,
                                      std::int64_t ignore_index, std::int64_t reduction,
                                      double label_smoothing, double z_loss, double softcap,
                                      linear_choices choices = {}) {
  check_input_dtype(hidden);
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(),
                   "xent: weight must have hidden's dtype ", hidden.scalar_type(), ", got ",
                   weight.scalar_type());
  linear_inputs in;
  in.hidden = rows_view(hidden, "hidden", "(N, D)");
  in.weight = rows_view(weight, "weight", "(V, D)");
  TORCH_CHECK_VALUE(in.weight.size(1) == in.hidden.size(1), "xent: weight is ", weight.sizes(),
                    ", hidden is ", hidden.sizes(), ": their last dimensions must agree");
  const std::int64_t vocab = in.weight.size(0);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_TYPE(bias->scalar_type() == hidden.scalar_type(),
                     "xent: bias must have hidden's dtype ", hidden.scalar_type(), ", got ",
                     bias->scalar_type());
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == vocab,
                      "xent: bias must be (V,) with V = ", vocab, ", got ", bias->sizes());
    check_same_device(hidden, *bias, "bias");
    in.bias = bias->contiguous();
  }
  check_same_device(hidden, weight, "weight");
  in.tg = targets_of(target, in.hidden, vocab);
  in.class_weights = weights_of(in.hidden, class_weight, vocab, "class_weight");
  static_cast<xent::options&>(in.opts) =
      options_of(in.class_weights, ignore_index, reduction, label_smoothing, z_loss, softcap);
  set_linear_choices(in.opts, choices);
  return in;
}

// The workspace bytes of a call on hidden (N x D) and weight (V x D) in dtype T: what xent's size
// query answers for the options' order at its default budget (256 MiB of row chunks beyond the
// buffers every chunk needs). linear_order::automatic is answered with the fast order's bytes,
// so such a call runs the fast order; low_memory with that order's, the V x D float sum absent.
template <class T, class Exec>
std::size_t linear_workspace_bytes_of(const Exec& exec, const at::Tensor& hidden,
                                      const at::Tensor& weight, xent::linear_pass pass,
                                      const xent::linear_options& opts) {
  return xent::linear_workspace_size<T>(exec, {hidden.size(0), hidden.size(1), weight.size(0)},
                                        pass, opts)
      .bytes;
}

// A workspace of linear_workspace_bytes_of's size, allocated through torch's allocator for this
// call.
template <class T, class Exec>
at::Tensor linear_workspace_for(const Exec& exec, const linear_inputs& in, xent::linear_pass pass) {
  const std::size_t bytes = linear_workspace_bytes_of<T>(exec, in.hidden, in.weight, pass, in.opts);
  return at::empty({static_cast<std::int64_t>(bytes)}, in.hidden.options().dtype(at::kByte));
}

// xent's view of a workspace tensor from linear_workspace_for.
inline xent::linear_workspace workspace_of(const at::Tensor& ws) {
  return {ws.data_ptr(), static_cast<std::size_t>(ws.numel())};
}

// One fused linear call in hidden's dtype T on backend B: `run(exec, T{}, targets, workspace)`
// with a workspace of xent's size for `pass`, and xent's errors as torch's.
template <class B, class Run>
void run_linear(const linear_inputs& in, xent::linear_pass pass, Run&& run) {
  dispatch<B>(in.hidden, in.tg, [&](auto tag, auto tv) {
    using T = decltype(tag);
    const auto call = B::exec(in.hidden, false, true);
    call_xent([&] {
      // The size query checks the options too (a sparse threshold with the fast order, say).
      const at::Tensor ws = linear_workspace_for<T>(call.exec, in, pass);
      run(call.exec, tag, tv, workspace_of(ws));
    });
  });
}

template <class B>
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_fwd(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap, std::int64_t order, std::int64_t accumulate, double sparse_threshold) {
  const typename B::guard device_guard(hidden.device());
  // A forward has one order and no backward: the training choices are only checked.
  linear_inputs in =
      linear_inputs_of(hidden, weight, bias, target, class_weight, ignore_index, reduction,
                       label_smoothing, z_loss, softcap, {order, accumulate, sparse_threshold});
  call_xent([&] { xent::detail::check_sparse("xent::linear_forward", in.opts); });
  in.opts.sparse_threshold = 0.0f;
  const loss_outputs out(in.hidden, in.opts.reduce);
  run_linear<B>(in, xent::linear_pass::forward, [&](const auto& exec, auto tag, auto tv, auto ws) {
    using T = decltype(tag);
    xent::linear_forward(exec, matrix_of<const T>(in.hidden), matrix_of<const T>(in.weight),
                         vector_of<const T>(in.bias), tv, in.opts,
                         out.view<xent::accumulator_t<T>>(), ws);
  });
  return {out.loss, out.lse};
}

// d_hidden (N x D), d_weight (V x D) and d_bias (V, or an empty tensor without a bias) in the
// hidden dtype, and xent's view of them.
struct linear_grad_tensors {
  at::Tensor d_hidden, d_weight, d_bias;
  std::array<bool, 3> mask;  ///< which of the three the call computes (output_mask)

  linear_grad_tensors(const linear_inputs& in, std::array<bool, 3> output_mask)
      : mask{output_mask[0], output_mask[1], output_mask[2] && in.bias.defined()} {
    const auto like = in.hidden.options().memory_format(at::MemoryFormat::Contiguous);
    // Gradients not asked for are not allocated: (0,) stands for them.
    d_hidden = mask[0] ? at::empty(in.hidden.sizes(), like) : at::empty({0}, like);
    d_weight = mask[1] ? at::empty(in.weight.sizes(), like) : at::empty({0}, like);
    d_bias = at::empty({mask[2] ? in.weight.size(0) : 0}, like);
  }

  template <class T>
  xent::linear_grads<T> view() const {
    return {mask[0] ? matrix_of<T>(d_hidden) : xent::matrix_view<T>{},
            mask[1] ? matrix_of<T>(d_weight) : xent::matrix_view<T>{},
            mask[2] ? vector_of<T>(d_bias) : xent::vector_view<T>{}};
  }
};

// The gradients from the LSE the forward saved; each chunk's logits are recomputed.
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd(
    const at::Tensor& grad_output, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const at::Tensor& lse, std::int64_t ignore_index,
    std::int64_t reduction, double label_smoothing, double z_loss, double softcap,
    std::array<bool, 3> output_mask, std::int64_t order, std::int64_t accumulate,
    double sparse_threshold) {
  const typename B::guard device_guard(hidden.device());
  linear_inputs in =
      linear_inputs_of(hidden, weight, bias, target, class_weight, ignore_index, reduction,
                       label_smoothing, z_loss, softcap, {order, accumulate, sparse_threshold});
  const std::int64_t n = in.hidden.size(0);
  const at::Tensor g_out = upstream_tensor(in.hidden, grad_output);
  const at::Tensor saved = saved_lse(in.hidden, lse, n);
  const linear_grad_tensors grads(in, output_mask);
  plan_without_unused_accumulator(in.opts, grads.mask[1]);
  run_linear<B>(in, xent::linear_pass::training, [&](const auto& exec, auto tag, auto tv, auto ws) {
    using T = decltype(tag);
    using A = xent::accumulator_t<T>;
    xent::linear_backward(exec, matrix_of<const T>(in.hidden), matrix_of<const T>(in.weight),
                          vector_of<const T>(in.bias), tv, in.opts,
                          xent::vector_view<const A>(saved.data_ptr<A>(), n),
                          upstream_of<A>(g_out, in.opts.reduce, n), grads.view<T>(), ws);
  });
  return {grads.d_hidden, grads.d_weight, grads.d_bias};
}

// Training in one call (xent::linear_forward_backward, upstream 1; see check_fused_reduction):
// (loss, lse, d_hidden, d_weight, d_bias), each chunk's logits computed once.
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_fwd_bwd(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap, std::array<bool, 3> output_mask, std::int64_t order, std::int64_t accumulate,
    double sparse_threshold) {
  const typename B::guard device_guard(hidden.device());
  linear_inputs in =
      linear_inputs_of(hidden, weight, bias, target, class_weight, ignore_index, reduction,
                       label_smoothing, z_loss, softcap, {order, accumulate, sparse_threshold});
  check_fused_reduction(in.opts);
  const loss_outputs out(in.hidden, in.opts.reduce);
  const linear_grad_tensors grads(in, output_mask);
  plan_without_unused_accumulator(in.opts, grads.mask[1]);
  run_linear<B>(in, xent::linear_pass::training, [&](const auto& exec, auto tag, auto tv, auto ws) {
    using T = decltype(tag);
    using A = xent::accumulator_t<T>;
    xent::linear_forward_backward(exec, matrix_of<const T>(in.hidden),
                                  matrix_of<const T>(in.weight), vector_of<const T>(in.bias), tv,
                                  in.opts, xent::basic_upstream<A>{}, out.view<A>(),
                                  grads.view<T>(), ws);
  });
  return {out.loss, out.lse, grads.d_hidden, grads.d_weight, grads.d_bias};
}

// linear_workspace_bytes: the workspace bytes the linear ops allocate for their one xent call on
// hidden (N x D) and weight (V x D): training (linear_cross_entropy_bwd and _fwd_bwd) or forward,
// with or without d_weight, for the given choices (see linear_choices). Reads no values.
template <class B>
std::int64_t linear_workspace_bytes(const at::Tensor& hidden, const at::Tensor& weight,
                                    bool training, bool d_weight, std::int64_t order,
                                    std::int64_t accumulate, double sparse_threshold) {
  check_input_dtype(hidden);
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(),
                   "xent: weight must have hidden's dtype ", hidden.scalar_type(), ", got ",
                   weight.scalar_type());
  check_same_device(hidden, weight, "weight");
  TORCH_CHECK_VALUE(hidden.dim() == 2 && weight.dim() == 2 && weight.size(1) == hidden.size(1),
                    "xent: hidden (N, D) and weight (V, D) must be 2-D with one D, got ",
                    hidden.sizes(), " and ", weight.sizes());
  const typename B::guard device_guard(hidden.device());
  xent::linear_options opts;
  set_linear_choices(opts, {order, accumulate, sparse_threshold});
  plan_without_unused_accumulator(opts, d_weight);
  const auto pass = training ? xent::linear_pass::training : xent::linear_pass::forward;
  std::size_t bytes = 0;
  dispatch_dtype<B>(hidden, [&](auto tag) {
    using T = decltype(tag);
    const auto call = B::exec(hidden, false, true);
    call_xent([&] { bytes = linear_workspace_bytes_of<T>(call.exec, hidden, weight, pass, opts); });
  });
  return static_cast<std::int64_t>(bytes);
}

}  // namespace xent_torch
