// The autograd formulas of the xent ops, in C++: a torch::autograd::Function per differentiable
// op, registered under the Autograd dispatch key (an alias of AutogradCPU, AutogradCUDA, ...), so
// one registration serves the CPU kernels of xent_ops.cpp and the CUDA kernels of
// xent_ops_cuda.cu. A call from Python is one dispatcher call forward (this kernel, then the
// device kernel below autograd) and records one C++ node; no Python runs on either side.
//
// Two paths, chosen per call:
//   fused   when the call records a node, the gradient flows to the logits (hidden / weight) and
//           the reduction is mean or sum: the forward runs the *_fwd_bwd op, which reads the
//           logits once (the linear op computes each chunk's logits once) and writes the gradient
//           with upstream 1; the node saves only that gradient, and its backward scales it by
//           the loss's gradient (scale_grad_, read on the device: on CUDA one launch that
//           returns at once when it is 1). The logits (hidden, weight) are not kept for backward.
//   split   otherwise (reduction none, whose per-row upstream gradient is known only in backward;
//           a node that no gradient reaches the logits through; float16, see fuses below;
//           cross_entropy under torch.compile, see traced below): the forward saves the LSE and
//           the backward calls the matching *_bwd op. A call that records no node (no_grad,
//           evaluation) runs the forward op alone.
//
// The formulas call the ops through the dispatcher, not the device code directly: under
// torch.compile the same kernels run on fake tensors, where the dispatcher routes the calls to
// the fake kernels (xent/torch/ops.py), and the traced graph holds the xent ops themselves.
// Nothing here reads a tensor's values, so nothing synchronises with a device; every result is
// allocated by the device kernel on the current stream (CUDA-graph capture sees the same calls as
// an eager run).
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "layout.h"

namespace xent_torch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using opt_tensor = std::optional<at::Tensor>;

// The schemas of xent_ops.cpp as C++ signatures, and each op's handle, found once.
using ce_fwd_t = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&,
                                                                const at::Tensor&,
                                                                const opt_tensor&, std::int64_t,
                                                                std::int64_t, double, double,
                                                                double, bool, bool, bool);
using ce_bwd_t = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const opt_tensor&, const at::Tensor&, std::int64_t, std::int64_t,
                            double, double, double);
using ce_bwd_inplace_t = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const opt_tensor&, const at::Tensor&, std::int64_t, std::int64_t,
                              double, double, double);
using lce_fwd_t = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                     const opt_tensor&, const at::Tensor&,
                                                     const opt_tensor&, std::int64_t, std::int64_t,
                                                     double, double, double, std::int64_t,
                                                     std::int64_t, double);
using lce_bwd_t = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const opt_tensor&, const at::Tensor&,
    const opt_tensor&, const at::Tensor&, std::int64_t, std::int64_t, double, double, double,
    std::array<bool, 3>, std::int64_t, std::int64_t, double);
using ce_fused_t = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const opt_tensor&, std::int64_t, std::int64_t, double,
    double, double, bool, bool);
using ce_fused_inplace_t = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const opt_tensor&, std::int64_t, std::int64_t, double,
    double, double, bool, bool);
using lce_fused_t = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const opt_tensor&, const at::Tensor&, const opt_tensor&,
    std::int64_t, std::int64_t, double, double, double, std::array<bool, 3>, std::int64_t,
    std::int64_t, double);
using scale_grad_t = void(const at::Tensor&, const at::Tensor&);

template <class Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

const c10::TypedOperatorHandle<ce_fwd_t>& ce_fwd() {
  static const auto op = find_op<ce_fwd_t>("xent::cross_entropy_fwd");
  return op;
}
const c10::TypedOperatorHandle<ce_bwd_t>& ce_bwd() {
  static const auto op = find_op<ce_bwd_t>("xent::cross_entropy_bwd");
  return op;
}
const c10::TypedOperatorHandle<ce_bwd_inplace_t>& ce_bwd_inplace() {
  static const auto op = find_op<ce_bwd_inplace_t>("xent::cross_entropy_bwd_");
  return op;
}
const c10::TypedOperatorHandle<lce_fwd_t>& lce_fwd() {
  static const auto op = find_op<lce_fwd_t>("xent::linear_cross_entropy_fwd");
  return op;
}
const c10::TypedOperatorHandle<lce_bwd_t>& lce_bwd() {
  static const auto op = find_op<lce_bwd_t>("xent::linear_cross_entropy_bwd");
  return op;
}
const c10::TypedOperatorHandle<ce_fused_t>& ce_fused() {
  static const auto op = find_op<ce_fused_t>("xent::cross_entropy_fwd_bwd");
  return op;
}
const c10::TypedOperatorHandle<ce_fused_inplace_t>& ce_fused_inplace() {
  static const auto op = find_op<ce_fused_inplace_t>("xent::cross_entropy_fwd_bwd_");
  return op;
}
const c10::TypedOperatorHandle<lce_fused_t>& lce_fused() {
  static const auto op = find_op<lce_fused_t>("xent::linear_cross_entropy_fwd_bwd");
  return op;
}
const c10::TypedOperatorHandle<scale_grad_t>& scale_grad() {
  static const auto op = find_op<scale_grad_t>("xent::scale_grad_");
  return op;
}

// Where a backward calls the *_bwd ops: straight to the device kernel, past the autograd fallback
// those ops would otherwise pass through (boxing every argument), also under
// backward(create_graph=True), where first_derivative_only marks what they return.
template <class F>
decltype(auto) call_bwd(F&& f) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return f();
}

// A new autograd node, held as this torch holds them (std::shared_ptr in older versions,
// c10::intrusive_ptr in newer ones).
template <class T, class... Args>
auto make_node(Args&&... args) {
  using held = decltype(torch::autograd::get_current_node());
  if constexpr (std::is_same_v<held, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<T>(std::forward<Args>(args)...);
  else
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
}

// xent has no second derivative. Under backward(create_graph=True) the gradients a backward
// returns carry a node that raises when anything differentiates through them, whatever the loss's
// gradient (the gradient depends on the logits even where that is a constant). The node's edges
// are those of the node running now (to the forward's inputs) and of the loss's gradient, so it
// lies on every path that autograd.grad or a Hessian follows from these gradients back to them;
// torch's once_differentiable hangs its error on fresh leaves, which such a call prunes, and a
// Hessian came back all zeros. Without any, a gradient penalty got a silent zero (reduction none,
// behind the autograd fallback's warning) or "element 0 of tensors does not require grad".
variable_list first_derivative_only(variable_list grads, const at::Tensor& grad_output) {
  if (!at::GradMode::is_enabled()) return grads;
  torch::autograd::edge_list edges;
  if (const auto node = torch::autograd::get_current_node()) edges = node->next_edges();
  if (grad_output.requires_grad())
    edges.push_back(torch::autograd::impl::gradient_edge(grad_output));
  const auto error = make_node<torch::autograd::Error>(
      "xent_torch: cross-entropy has no second derivative (a backward reached a gradient that "
      "xent computed under create_graph=True)",
      std::move(edges));
  for (at::Tensor& g : grads) {
    if (!g.defined()) continue;
    g = g.detach();  // the same memory and version counter, its history replaced by the error
    torch::autograd::create_gradient_edge(g, error);
  }
  return grads;
}

// A saved tensor back as the optional argument it was (an undefined tensor when absent).
opt_tensor present(const at::Tensor& t) { return t.defined() ? opt_tensor(t) : std::nullopt; }

bool wants_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
bool wants_grad(const opt_tensor& t) { return t.has_value() && wants_grad(*t); }

// Whether a call records a node: grad mode on and some tensor argument requiring grad (what
// Function::apply decides). Otherwise the kernels below call the op straight below autograd,
// without building a node and its saved variables only to drop them (evaluation, no_grad).
template <class... Tensors>
bool records(const Tensors&... tensors) {
  return at::GradMode::is_enabled() && (wants_grad(tensors) || ...);
}

// The options every formula saves beside its tensors, one entry of ctx->saved_data.
struct saved_options {
  std::int64_t ignore_index, reduction;
  double label_smoothing, z_loss, softcap;
};

void save_options(AutogradContext* ctx, const saved_options& o) {
  ctx->saved_data["options"] =
      std::make_tuple(o.ignore_index, o.reduction, o.label_smoothing, o.z_loss, o.softcap);
}

saved_options load_options(AutogradContext* ctx) {
  const auto o = ctx->saved_data["options"].toTuple();
  const auto& e = o->elements();
  return {e[0].toInt(), e[1].toInt(), e[2].toDouble(), e[3].toDouble(), e[4].toDouble()};
}

// Whether a forward takes the fused path (see the top of the file): the loss is a scalar
// (at::Reduction::None is 0), one of the tensors the logits' gradient flows to wants it, and the
// inputs are not float16. A float16 gradient formed at upstream 1 underflows where it is small
// (p / N below 6e-8 is 0), and scaling it afterwards cannot bring it back: a GradScaler's factor
// exists to keep it in range, so float16 takes the split path, which multiplies before rounding.
template <class... Tensors>
bool fuses(std::int64_t reduction, at::ScalarType dtype, const Tensors&... into) {
  return reduction != 0 && dtype != at::kHalf && (wants_grad(into) || ...);
}

// Whether the call is being traced (torch.compile runs the formulas on fake and functional
// tensors, which carry the Python dispatch key). Traced, cross_entropy keeps the split path:
// inductor copies a saved gradient before an op mutates it in place (scale_grad_), so a compiled
// fused step reads and writes N x V twice, where the split one reads twice and writes once. The
// linear op stays fused (its copy is V x D, against a logits GEMM saved).
bool traced(const at::Tensor& t) { return t.key_set().has(c10::DispatchKey::Python); }

// The node of a fused forward saves its gradients (and nothing else) and says so.
void save_fused(AutogradContext* ctx, const variable_list& grads) {
  ctx->save_for_backward(grads);
  ctx->saved_data["fused"] = true;
}

bool is_fused(AutogradContext* ctx) { return ctx->saved_data.count("fused") != 0; }

// A gradient a fused forward saved (computed with upstream 1) times the loss's gradient, which
// scale_grad_ reads on the device (no .item(): nothing waits for the device, and a CUDA graph
// replays the call for any value). In place, unless the graph is kept for another backward
// (retain_graph, create_graph): that one needs the saved gradient unscaled, so a copy is scaled.
at::Tensor scaled(const at::Tensor& grad, const at::Tensor& grad_output) {
  const at::Tensor g = torch::autograd::get_current_graph_task_keep_graph() ? grad.clone() : grad;
  call_bwd([&] { scale_grad().call(g, grad_output); });
  // scale_grad_ writes through a pointer, which autograd cannot see; an in-place gradient is the
  // caller's logits (see cross_entropy_function::forward).
  torch::autograd::impl::bump_version(g);
  return g;
}

}  // namespace

// The Function types are named outside the anonymous namespace: a node's name (loss.grad_fn.name())
// is torch::autograd::CppNode<xent_torch::cross_entropy_function>.

// cross_entropy_fwd(input, target, weight, ignore_index, reduction, label_smoothing, z_loss,
// softcap, inplace_backward, return_argmax, return_num_correct) -> (loss, lse, stats). The
// gradient flows to `input` only: targets (class ids, or soft targets that xent.torch.cross_entropy
// refuses to differentiate) and class weights get none, as in torch's cross_entropy. lse is a
// saved statistic, stats integer side outputs; a gradient reaching either is ignored.
struct cross_entropy_function : torch::autograd::Function<cross_entropy_function> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& target, const opt_tensor& weight,
                               std::int64_t ignore_index, std::int64_t reduction,
                               double label_smoothing, double z_loss, double softcap,
                               bool inplace_backward, bool return_argmax, bool return_num_correct) {
    // Undefined gradients stay undefined (lse's is never used; a zero-filled one would cost a
    // kernel launch per backward).
    ctx->set_materialize_grads(false);
    at::Tensor loss, lse, stats;
    if (fuses(reduction, input.scalar_type(), input) && !traced(input)) {
      at::Tensor grad;
      // In place needs rows with a contiguous last dimension (that do not overlap); other layouts
      // get a fresh gradient (the same values; only the memory saving is lost).
      if (inplace_backward && rows_readable_in_place(input)) {
        {
          const at::AutoDispatchBelowADInplaceOrView below_autograd;
          std::tie(loss, lse, stats) = ce_fused_inplace().call(
              input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
              return_argmax, return_num_correct);
        }
        // The kernel wrote the gradient over the logits through a pointer, which autograd cannot
        // see: bump the version counter (shared with every view of the caller's logits) so that a
        // backward which saved these logits (e.g. tanh's output) fails loudly instead of reading
        // the gradient as the logits.
        torch::autograd::impl::bump_version(input);
        grad = input.detach();  // the same memory and version counter, no history
      } else {
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(loss, lse, stats, grad) =
            ce_fused().call(input, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                            softcap, return_argmax, return_num_correct);
      }
      save_fused(ctx, {grad});
      ctx->mark_non_differentiable({stats});
      return {loss, lse, stats};
    }
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(loss, lse, stats) =
          ce_fwd().call(input, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                        softcap, inplace_backward, return_argmax, return_num_correct);
    }
    ctx->save_for_backward({input, target, weight.value_or(at::Tensor()), lse});
    save_options(ctx, {ignore_index, reduction, label_smoothing, z_loss, softcap});
    ctx->saved_data["inplace"] = inplace_backward;
    ctx->mark_non_differentiable({stats});
    return {loss, lse, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(11);  // one per forward argument; undefined: no gradient
    const at::Tensor& grad_loss = grads[0];
    if (!grad_loss.defined()) return result;  // only lse was used: zero gradient
    const variable_list saved = ctx->get_saved_variables();
    if (is_fused(ctx)) {
      result[0] = scaled(saved[0], grad_loss);
      return first_derivative_only(std::move(result), grad_loss);
    }
    const at::Tensor& input = saved[0];
    const opt_tensor weight = present(saved[2]);
    const saved_options o = load_options(ctx);
    // In place needs rows with a contiguous last dimension (that do not overlap); other layouts
    // get a fresh gradient (the same values; only the memory saving is lost).
    if (ctx->saved_data["inplace"].toBool() && rows_readable_in_place(input)) {
      call_bwd([&] {
        ce_bwd_inplace().call(grad_loss, input, saved[1], weight, saved[3], o.ignore_index,
                              o.reduction, o.label_smoothing, o.z_loss, o.softcap);
      });
      // The kernel wrote through a pointer, which autograd cannot see: bump the version counter
      // (shared with every view of the caller's logits) so that a backward which saved these
      // logits (e.g. tanh's output) fails loudly instead of reading the gradient as the logits.
      torch::autograd::impl::bump_version(input);
      result[0] = input;
    } else {
      result[0] = call_bwd([&] {
        return ce_bwd().call(grad_loss, input, saved[1], weight, saved[3], o.ignore_index,
                             o.reduction, o.label_smoothing, o.z_loss, o.softcap);
      });
    }
    return first_derivative_only(std::move(result), grad_loss);
  }
};

// linear_cross_entropy_fwd(hidden, weight, bias, target, class_weight, ignore_index, reduction,
// label_smoothing, z_loss, softcap, order, accumulate, sparse_threshold) -> (loss, lse): gradients
// for hidden,
// weight and bias (when given). Fused, xent::linear_forward_backward computes them in forward
// (each chunk's logits once); split, xent::linear_backward recomputes each chunk's logits from
// the saved LSE. Either call trains in the order and accumulation given (the split path's
// backward gets them from the node).
struct linear_cross_entropy_function : torch::autograd::Function<linear_cross_entropy_function> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden,
                               const at::Tensor& weight, const opt_tensor& bias,
                               const at::Tensor& target, const opt_tensor& class_weight,
                               std::int64_t ignore_index, std::int64_t reduction,
                               double label_smoothing, double z_loss, double softcap,
                               std::int64_t order, std::int64_t accumulate,
                               double sparse_threshold) {
    ctx->set_materialize_grads(false);
    at::Tensor loss, lse;
    // The logits' gradient flows to hidden, weight and bias: any of them may be the one that
    // wants it (a frozen LM head, frozen activations).
    if (fuses(reduction, hidden.scalar_type(), hidden, weight, bias)) {
      at::Tensor d_hidden, d_weight, d_bias;
      // Only the gradients some tensor wants: a frozen LM head skips its d_weight GEMM.
      const std::array<bool, 3> mask{wants_grad(hidden), wants_grad(weight), wants_grad(bias)};
      {
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(loss, lse, d_hidden, d_weight, d_bias) = lce_fused().call(
            hidden, weight, bias, target, class_weight, ignore_index, reduction, label_smoothing,
            z_loss, softcap, mask, order, accumulate, sparse_threshold);
      }
      save_fused(ctx, {mask[0] ? d_hidden : at::Tensor(), mask[1] ? d_weight : at::Tensor(),
                       mask[2] ? d_bias : at::Tensor()});
      return {loss, lse};
    }
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(loss, lse) =
          lce_fwd().call(hidden, weight, bias, target, class_weight, ignore_index, reduction,
                         label_smoothing, z_loss, softcap, order, accumulate, sparse_threshold);
    }
    ctx->save_for_backward({hidden, weight, bias.value_or(at::Tensor()), target,
                            class_weight.value_or(at::Tensor()), lse});
    save_options(ctx, {ignore_index, reduction, label_smoothing, z_loss, softcap});
    ctx->saved_data["order"] = order;
    ctx->saved_data["accumulate"] = accumulate;
    ctx->saved_data["sparse_threshold"] = sparse_threshold;
    return {loss, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(13);
    const at::Tensor& grad_loss = grads[0];
    if (!grad_loss.defined()) return result;
    const variable_list saved = ctx->get_saved_variables();
    if (is_fused(ctx)) {
      // d_hidden, d_weight, d_bias (undefined without a bias): only those that reach a tensor
      // requiring grad are scaled.
      for (int i = 0; i < 3; ++i)
        if (saved[i].defined() && ctx->needs_input_grad(i)) result[i] = scaled(saved[i], grad_loss);
      return first_derivative_only(std::move(result), grad_loss);
    }
    const opt_tensor bias = present(saved[2]);
    const saved_options o = load_options(ctx);
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   bias.has_value() && ctx->needs_input_grad(2)};
    auto [d_hidden, d_weight, d_bias] = call_bwd([&] {
      return lce_bwd().call(grad_loss, saved[0], saved[1], bias, saved[3], present(saved[4]),
                            saved[5], o.ignore_index, o.reduction, o.label_smoothing, o.z_loss,
                            o.softcap, mask, ctx->saved_data["order"].toInt(),
                            ctx->saved_data["accumulate"].toInt(),
                            ctx->saved_data["sparse_threshold"].toDouble());
    });
    if (mask[0]) result[0] = std::move(d_hidden);
    if (mask[1]) result[1] = std::move(d_weight);
    if (mask[2]) result[2] = std::move(d_bias);
    return first_derivative_only(std::move(result), grad_loss);
  }
};

// The Autograd kernels: what torch.ops.xent.*_fwd runs first (their tensors carry autograd's
// dispatch keys), before the device kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_autograd(
    const at::Tensor& input, const at::Tensor& target, const opt_tensor& weight,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap, bool inplace_backward, bool return_argmax, bool return_num_correct) {
  if (!records(input, target, weight)) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return ce_fwd().call(input, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                         softcap, inplace_backward, return_argmax, return_num_correct);
  }
  variable_list out = cross_entropy_function::apply(
      input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
      inplace_backward, return_argmax, return_num_correct);
  return {std::move(out[0]), std::move(out[1]), std::move(out[2])};
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_autograd(
    const at::Tensor& hidden, const at::Tensor& weight, const opt_tensor& bias,
    const at::Tensor& target, const opt_tensor& class_weight, std::int64_t ignore_index,
    std::int64_t reduction, double label_smoothing, double z_loss, double softcap,
    std::int64_t order, std::int64_t accumulate, double sparse_threshold) {
  if (!records(hidden, weight, bias, target, class_weight)) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return lce_fwd().call(hidden, weight, bias, target, class_weight, ignore_index, reduction,
                          label_smoothing, z_loss, softcap, order, accumulate, sparse_threshold);
  }
  variable_list out = linear_cross_entropy_function::apply(
      hidden, weight, bias, target, class_weight, ignore_index, reduction, label_smoothing, z_loss,
      softcap, order, accumulate, sparse_threshold);
  return {std::move(out[0]), std::move(out[1])};
}

}  // namespace xent_torch

// The vocab-parallel ops' backwards (Python, xent/torch/distributed.py) mark their gradients the
// same way: a kernel above autograd, so the node it hangs on them stays.
TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def("first_derivative_only(Tensor[] grads, Tensor grad_output) -> Tensor[]",
        [](std::vector<at::Tensor> grads, const at::Tensor& grad_output) {
          return xent_torch::first_derivative_only(std::move(grads), grad_output);
        });
}

TORCH_LIBRARY_IMPL(xent, Autograd, m) {
  m.impl("cross_entropy_fwd", &xent_torch::cross_entropy_autograd);
  m.impl("linear_cross_entropy_fwd", &xent_torch::linear_cross_entropy_autograd);
}
