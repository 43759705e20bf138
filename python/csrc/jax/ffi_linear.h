// The fused linear cross-entropy handlers' bodies (logits = hidden · weightᵀ + bias, never
// materialised), over an execution-object maker as in ffi_ops.h, which also gives the checks and
// the attributes. Operands: hidden (N, D), weight (V, D) and bias (V,) or (0,) for none, all of
// one dtype; labels (N,) int32 / int64; class weights (V,) or (0,) float32. No vmap batch: these
// calls are batched by jax as a loop over the batch (ffi_call's vmap_method="sequential"). Each
// handler takes an execution object and alloc(bytes), the workspace's memory of its kind.
#pragma once

#include <cstdint>
#include <string>

#include "../linear_choices.h"
#include "ffi_ops.h"

namespace xent_jax {

// The loss attributes and a training call's choices (../linear_choices.h).
struct linear_attrs {
  std::int64_t ignore_index;
  std::int32_t reduction;
  float label_smoothing, z_loss, softcap;
  std::int32_t order, accumulate;
  float sparse_threshold;

  xent::linear_options options() const {
    const xent_bindings::choice_error e = xent_bindings::check_linear_choices(order, accumulate);
    if (!e.argument.empty()) fail(e.argument, e.what);
    xent::linear_options o;
    static_cast<xent::options&>(o) =
        loss_attrs{ignore_index, reduction, label_smoothing, z_loss, softcap}.options();
    xent_bindings::set_linear_choices(o, order, accumulate, sparse_threshold);
    return o;
  }
};

struct linear_call {
  ffi::AnyBuffer hidden, weight, bias, labels, class_weight;
  std::int64_t rows = 0, dim = 0, vocab = 0;
  xent::linear_options opts;

  linear_call(ffi::AnyBuffer hidden_, ffi::AnyBuffer weight_, ffi::AnyBuffer bias_,
              ffi::AnyBuffer labels_, ffi::AnyBuffer class_weight_, const linear_attrs& attrs)
      : hidden(hidden_),
        weight(weight_),
        bias(bias_),
        labels(labels_),
        class_weight(class_weight_) {
    const auto h = hidden.dimensions(), w = weight.dimensions();
    if (h.size() != 2) fail("hidden", "must be (N, D), got shape " + shape_string(h));
    if (w.size() != 2 || w[1] != h[1])
      fail("weight",
           "must be (V, D) with D = " + std::to_string(h[1]) + ", got shape " + shape_string(w));
    rows = h[0];
    dim = h[1];
    vocab = w[0];
    expect_dtype("weight", weight, hidden.element_type());
    expect_dtype("bias", bias, hidden.element_type());
    expect_shape("bias", bias, has_bias() ? vocab : 0);
    if (labels.element_type() != ffi::DataType::S32 && labels.element_type() != ffi::DataType::S64)
      fail("labels",
           std::string("must be int32 or int64, got ") + dtype_name(labels.element_type()));
    expect_shape("labels", labels, rows);
    expect_dtype("weight (class weights)", class_weight, ffi::DataType::F32);
    expect_shape("weight (class weights)", class_weight, weighted() ? vocab : 0);
    opts = attrs.options();
    if (weighted())
      opts.class_weights = {static_cast<const float*>(class_weight.untyped_data()), vocab};
  }

  static void expect_shape(const std::string& name, const ffi::AnyBuffer& b, std::int64_t n) {
    const auto d = b.dimensions();
    if (d.size() != 1 || d[0] != n)
      fail(name, "must be (" + std::to_string(n) + ",), got shape " + shape_string(d));
  }

  bool has_bias() const { return bias.dimensions().size() == 1 && bias.dimensions()[0] != 0; }
  bool weighted() const {
    return class_weight.dimensions().size() == 1 && class_weight.dimensions()[0] != 0;
  }

  template <class T>
  xent::matrix_view<const T> hidden_view() const {
    return {static_cast<const T*>(hidden.untyped_data()), rows, dim, dim};
  }
  template <class T>
  xent::matrix_view<const T> weight_view() const {
    return {static_cast<const T*>(weight.untyped_data()), vocab, dim, dim};
  }
  template <class T>
  xent::vector_view<const T> bias_view() const {
    if (!has_bias()) return {};
    return {static_cast<const T*>(bias.untyped_data()), vocab};
  }

  // The gradients' views: d_hidden (N, D), d_weight (V, D), d_bias (V,) or (0,) without a bias.
  template <class T>
  xent::linear_grads<T> grads(ffi::AnyBuffer& dh, ffi::AnyBuffer& dw, ffi::AnyBuffer& db) const {
    expect_dtype("d_hidden", dh, hidden.element_type());
    expect_dtype("d_weight", dw, hidden.element_type());
    expect_dtype("d_bias", db, hidden.element_type());
    if (dh.element_count() != static_cast<std::size_t>(rows * dim))
      fail("d_hidden", "must be (N, D)");
    if (dw.element_count() != static_cast<std::size_t>(vocab * dim))
      fail("d_weight", "must be (V, D)");
    expect_shape("d_bias", db, has_bias() ? vocab : 0);
    xent::linear_grads<T> g;
    g.d_hidden = {static_cast<T*>(dh.untyped_data()), rows, dim, dim};
    g.d_weight = {static_cast<T*>(dw.untyped_data()), vocab, dim, dim};
    if (has_bias()) g.d_bias = {static_cast<T*>(db.untyped_data()), vocab};
    return g;
  }

  // Calls f(T{}, targets view, workspace) with a workspace of the size xent plans for `pass`
  // (xent's default budget), from alloc(bytes): memory of the exec's kind.
  template <bool float64, class Exec, class Alloc, class F>
  void run(const Exec& exec, xent::linear_pass pass, Alloc& alloc, F&& f) const {
    dispatch_dtype<float64>(hidden, [&](auto tag) {
      using T = decltype(tag);
      const auto size = xent::linear_workspace_size<T>(exec, {rows, dim, vocab}, pass, opts);
      const xent::linear_workspace workspace{alloc(size.bytes), size.bytes};
      if (labels.element_type() == ffi::DataType::S64)
        f(tag,
          xent::vector_view<const std::int64_t>(
              static_cast<const std::int64_t*>(labels.untyped_data()), rows),
          workspace);
      else
        f(tag,
          xent::vector_view<const std::int32_t>(
              static_cast<const std::int32_t*>(labels.untyped_data()), rows),
          workspace);
    });
  }
};

// Forward: loss (() or (N,) for none) and the per-row LSE (N,).
template <bool float64, class Exec, class Alloc>
ffi::Error linear_fwd(const Exec& exec, Alloc&& alloc, ffi::AnyBuffer hidden, ffi::AnyBuffer weight,
                      ffi::AnyBuffer bias, ffi::AnyBuffer labels, ffi::AnyBuffer class_weight,
                      ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                      const linear_attrs& attrs) {
  return run_checked([&] {
    linear_call c(hidden, weight, bias, labels, class_weight, attrs);
    // A forward has one order and no backward: the training choices are only checked.
    xent::detail::check_sparse("xent::linear_forward", c.opts);
    c.opts.sparse_threshold = 0.0f;
    c.run<float64>(exec, xent::linear_pass::forward, alloc, [&](auto tag, auto tv, auto ws) {
      using A = xent::accumulator_t<decltype(tag)>;
      using T = decltype(tag);
      xent::basic_forward_outputs<A> out;
      if (c.opts.reduce == xent::reduction::none)
        out.row_loss = {static_cast<A*>(loss->untyped_data()), c.rows};
      else
        out.loss = static_cast<A*>(loss->untyped_data());
      out.lse = {static_cast<A*>(lse->untyped_data()), c.rows};
      xent::linear_forward(exec, c.hidden_view<T>(), c.weight_view<T>(), c.bias_view<T>(), tv,
                           c.opts, out, ws);
    });
  });
}

// Backward from the LSE: d_hidden, d_weight, d_bias for the upstream gradient g (() for mean and
// sum, (N,) for none); each chunk's logits are recomputed.
template <bool float64, class Exec, class Alloc>
ffi::Error linear_bwd(const Exec& exec, Alloc&& alloc, ffi::AnyBuffer hidden, ffi::AnyBuffer weight,
                      ffi::AnyBuffer bias, ffi::AnyBuffer labels, ffi::AnyBuffer class_weight,
                      ffi::AnyBuffer lse, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> dh,
                      ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> db,
                      const linear_attrs& attrs) {
  return run_checked([&] {
    const linear_call c(hidden, weight, bias, labels, class_weight, attrs);
    c.run<float64>(exec, xent::linear_pass::training, alloc, [&](auto tag, auto tv, auto ws) {
      using T = decltype(tag);
      using A = xent::accumulator_t<T>;
      const A* gp = static_cast<const A*>(g.untyped_data());
      xent::basic_upstream<A> up;
      if (c.opts.reduce == xent::reduction::none)
        up.rows = {gp, c.rows};
      else
        up.scale_ptr = gp;
      xent::linear_backward(
          exec, c.hidden_view<T>(), c.weight_view<T>(), c.bias_view<T>(), tv, c.opts,
          xent::vector_view<const A>(static_cast<const A*>(lse.untyped_data()), c.rows), up,
          c.grads<T>(*dh, *dw, *db), ws);
    });
  });
}

// Training in one pass for mean and sum: loss, lse and the three gradients for an upstream
// gradient of 1 (the caller scales them), each chunk's logits computed once.
template <bool float64, class Exec, class Alloc>
ffi::Error linear_fwd_bwd(const Exec& exec, Alloc&& alloc, ffi::AnyBuffer hidden,
                          ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::AnyBuffer labels,
                          ffi::AnyBuffer class_weight, ffi::Result<ffi::AnyBuffer> loss,
                          ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> dh,
                          ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> db,
                          const linear_attrs& attrs) {
  return run_checked([&] {
    const linear_call c(hidden, weight, bias, labels, class_weight, attrs);
    if (c.opts.reduce == xent::reduction::none)
      fail("reduction", "must be mean or sum for a fused forward and backward");
    c.run<float64>(exec, xent::linear_pass::training, alloc, [&](auto tag, auto tv, auto ws) {
      using T = decltype(tag);
      using A = xent::accumulator_t<T>;
      xent::basic_forward_outputs<A> out;
      out.loss = static_cast<A*>(loss->untyped_data());
      out.lse = {static_cast<A*>(lse->untyped_data()), c.rows};
      xent::linear_forward_backward(exec, c.hidden_view<T>(), c.weight_view<T>(), c.bias_view<T>(),
                                    tv, c.opts, xent::basic_upstream<A>{}, out,
                                    c.grads<T>(*dh, *dw, *db), ws);
    });
  });
}

// As ffi_ops.h's bindings (ws: a workspace result after the others).
template <int ws = 0, class B>
auto linear_loss_binding(B&& ctx) {  // hidden, weight, bias, labels, class weights -> loss, lse
  return buffers<5, 2 + ws>(std::move(ctx)).template Attrs<linear_attrs>();
}

template <int ws = 0, class B>
auto linear_backward_binding(B&& ctx) {  // ..., lse, g -> d_hidden, d_weight, d_bias
  return buffers<7, 3 + ws>(std::move(ctx)).template Attrs<linear_attrs>();
}

template <int ws = 0, class B>
auto linear_fused_binding(B&& ctx) {  // ... -> loss, lse, d_hidden, d_weight, d_bias
  return buffers<5, 5 + ws>(std::move(ctx)).template Attrs<linear_attrs>();
}

}  // namespace xent_jax

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(xent_jax::linear_attrs,
                                      xla::ffi::StructMember<std::int64_t>("ignore_index"),
                                      xla::ffi::StructMember<std::int32_t>("reduction"),
                                      xla::ffi::StructMember<float>("label_smoothing"),
                                      xla::ffi::StructMember<float>("z_loss"),
                                      xla::ffi::StructMember<float>("softcap"),
                                      xla::ffi::StructMember<std::int32_t>("order"),
                                      xla::ffi::StructMember<std::int32_t>("accumulate"),
                                      xla::ffi::StructMember<float>("sparse_threshold"));
