// The device-neutral half of xent's XLA FFI handlers: argument checks, the vmap batch layout and
// the handler bodies, written once as templates over an execution-object maker (ffi_cpu.cpp
// instantiates them for xent::cpu, ffi_cuda.cu for xent::cuda on the stream XLA gives).
//
// Every handler takes logits of shape (B..., N, V): N rows of V classes, row-major (XLA's default
// layout, which ffi_call asks for). The leading B... dimensions exist only under jax.vmap
// (ffi_call's vmap_method="expand_dims"): every operand then has the same number of them, each
// either the batch's size or 1 for an operand that is not batched (broadcast, never copied), and
// the handler runs one xent call per batch element. Outside vmap there are none.
//
// Reductions, row losses, the LSE and the upstream gradient are of xent's accumulator type
// (float64 for float64 logits, float32 otherwise). Class weights are V float32 values, or an
// array of shape (0,) for none. The reduction attribute is torch's enum order: 0 none, 1 mean,
// 2 sum.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <xent/xent.hpp>

#include "xla/ffi/api/ffi.h"

namespace xent_jax {

namespace ffi = xla::ffi;

// An FFI error naming the argument, raised by the checks below (and turned into ffi::Error by
// run_checked).
struct bad_argument {
  ffi::ErrorCode code;
  std::string message;
};

[[noreturn]] inline void fail(const std::string& name, const std::string& what,
                              ffi::ErrorCode code = ffi::ErrorCode::kInvalidArgument) {
  throw bad_argument{code, "xent: " + name + " " + what};
}

inline std::string shape_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    default:
      return "an unsupported dtype";
  }
}

inline void expect_dtype(const std::string& name, const ffi::AnyBuffer& b, ffi::DataType t) {
  if (b.element_type() != t)
    fail(name, std::string("must be ") + dtype_name(t) + ", got " + dtype_name(b.element_type()));
}

// The vmap batch: the leading dimensions of a result (whose shape XLA gives in full), which every
// operand matches dimension by dimension or broadcasts (size 1).
class batch_layout {
 public:
  // The leading dimensions of `result` (its rank less its core rank) are the batch's.
  batch_layout(const std::string& name, const ffi::AnyBuffer& result, int core) {
    const auto dims = result.dimensions();
    if (static_cast<int>(dims.size()) < core)
      fail(name, "must have at least " + std::to_string(core) + " dimensions, got shape " +
                     shape_string(dims));
    shape_.assign(dims.begin(), dims.end() - core);
    for (std::int64_t d : shape_) count_ *= d;
  }

  // The batch's size, the product of its dimensions.
  std::int64_t count() const { return count_; }
  std::size_t rank() const { return shape_.size(); }

  // An operand of this call: its element offset for each batch element, after checking that its
  // leading dimensions match the batch (or are 1) and that its core dimensions are `core`
  // (negative entries: any size, returned through `sizes`).
  struct operand {
    std::vector<std::int64_t> strides;  // elements per step of each batch dimension, 0 if size 1
  };

  operand check(const std::string& name, const ffi::AnyBuffer& b,
                std::initializer_list<std::int64_t> core) const {
    const auto dims = b.dimensions();
    const std::size_t want = shape_.size() + core.size();
    auto mismatch = [&] {
      std::string expected = "(";
      for (std::size_t i = 0; i < shape_.size(); ++i) expected += std::to_string(shape_[i]) + ", ";
      std::size_t k = 0;
      for (std::int64_t c : core)
        expected += (k++ ? ", " : "") + (c < 0 ? std::string("any") : std::to_string(c));
      fail(name, "has shape " + shape_string(dims) + ", expected " + expected + ")");
    };
    if (dims.size() != want) mismatch();
    std::size_t i = shape_.size();
    for (std::int64_t c : core) {
      if (c >= 0 && dims[i] != c) mismatch();
      ++i;
    }
    std::int64_t inner = 1;
    for (std::size_t k = shape_.size(); k < dims.size(); ++k) inner *= dims[k];
    operand op;
    op.strides.assign(shape_.size(), 0);
    for (std::size_t k = shape_.size(); k-- > 0;) {
      if (dims[k] != shape_[k] && dims[k] != 1) mismatch();
      op.strides[k] = dims[k] == 1 ? 0 : inner;
      inner *= dims[k];
    }
    return op;
  }

  // The element offset of batch element `b` (0 <= b < count()) in an operand.
  std::int64_t offset(const operand& op, std::int64_t b) const {
    std::int64_t off = 0;
    for (std::size_t k = shape_.size(); k-- > 0;) {
      off += (b % shape_[k]) * op.strides[k];
      b /= shape_[k];
    }
    return off;
  }

 private:
  std::vector<std::int64_t> shape_;
  std::int64_t count_ = 1;
};

// Element `offset` of a buffer, as T.
template <class T>
T* at(const ffi::AnyBuffer& b, std::int64_t offset) {
  return static_cast<T*>(b.untyped_data()) + offset;
}

// The accumulator dtype of a call on logits of dtype t.
inline ffi::DataType accumulator_dtype(ffi::DataType t) {
  return t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

// The attributes every cross-entropy handler takes, as xent's options (class weights are set
// per batch element).
struct loss_attrs {
  std::int64_t ignore_index;
  std::int32_t reduction;
  float label_smoothing, z_loss, softcap;

  xent::options options() const {
    if (reduction < 0 || reduction > 2)
      fail("reduction", "must be 0 (none), 1 (mean) or 2 (sum), got " + std::to_string(reduction));
    xent::options o;
    o.reduce = reduction == 0 ? xent::reduction::none
                              : (reduction == 1 ? xent::reduction::mean : xent::reduction::sum);
    o.ignore_index = ignore_index;
    o.label_smoothing = label_smoothing;
    o.z_loss = z_loss;
    o.softcap = softcap;
    return o;
  }
};

// The operands every cross-entropy handler reads: logits (B..., N, V), labels (B..., N) int32 or
// int64, class weights (B..., V) or (B..., 0) float32; their batch layout and xent's options.
struct ce_call {
  ffi::AnyBuffer logits, labels, weight;
  batch_layout batch;
  batch_layout::operand logits_op, labels_op, weight_op;
  std::int64_t rows = 0, classes = 0;
  xent::options opts;

  // The batch is that of `result` (`core` dimensions of its own): the LSE (1) or the gradient (2).
  ce_call(ffi::AnyBuffer logits_, ffi::AnyBuffer labels_, ffi::AnyBuffer weight_,
          const loss_attrs& attrs, const std::string& result_name, const ffi::AnyBuffer& result,
          int core)
      : logits(logits_), labels(labels_), weight(weight_), batch(result_name, result, core) {
    const auto dims = logits.dimensions();
    if (dims.size() < 2) fail("logits", "must be (N, V), got shape " + shape_string(dims));
    rows = dims[dims.size() - 2];
    classes = dims[dims.size() - 1];
    logits_op = batch.check("logits", logits, {rows, classes});
    if (labels.element_type() != ffi::DataType::S32 && labels.element_type() != ffi::DataType::S64)
      fail("labels",
           std::string("must be int32 or int64, got ") + dtype_name(labels.element_type()));
    labels_op = batch.check("labels", labels, {rows});
    expect_dtype("weight", weight, ffi::DataType::F32);
    const auto wd = weight.dimensions();
    const bool weighted = wd.size() != 0 && wd[wd.size() - 1] != 0;
    weight_op = batch.check("weight", weight, {weighted ? classes : 0});
    opts = attrs.options();
  }

  bool weighted() const {
    const auto wd = weight.dimensions();
    return wd[wd.size() - 1] != 0;
  }

  // The per-row operands (rows,) of accumulator dtype `acc`, as the LSE and a row-loss.
  batch_layout::operand rows_operand(const std::string& name, const ffi::AnyBuffer& b,
                                     ffi::DataType acc) const {
    expect_dtype(name, b, acc);
    return batch.check(name, b, {rows});
  }

  // The loss (B...,) for mean and sum, (B..., N) for none.
  batch_layout::operand loss_operand(const std::string& name, const ffi::AnyBuffer& b,
                                     ffi::DataType acc) const {
    expect_dtype(name, b, acc);
    if (opts.reduce == xent::reduction::none) return batch.check(name, b, {rows});
    return batch.check(name, b, {});
  }

  // A gradient of the logits' shape and dtype.
  batch_layout::operand grad_operand(const std::string& name, const ffi::AnyBuffer& b) const {
    expect_dtype(name, b, logits.element_type());
    return batch.check(name, b, {rows, classes});
  }

  ffi::DataType acc() const { return accumulator_dtype(logits.element_type()); }

  // xent's options for batch element `b` (its class weights).
  xent::options options_at(std::int64_t b) const {
    xent::options o = opts;
    if (weighted())
      o.class_weights = {
          static_cast<const float*>(weight.untyped_data()) + batch.offset(weight_op, b), classes};
    return o;
  }

  template <class T>
  xent::matrix_view<const T> logits_at(std::int64_t b) const {
    return {static_cast<const T*>(logits.untyped_data()) + batch.offset(logits_op, b), rows,
            classes, classes};
  }

  // Calls f(targets view) with batch element b's class ids.
  template <class F>
  void with_labels_at(std::int64_t b, F&& f) const {
    const std::int64_t off = batch.offset(labels_op, b);
    if (labels.element_type() == ffi::DataType::S64)
      f(xent::vector_view<const std::int64_t>(
          static_cast<const std::int64_t*>(labels.untyped_data()) + off, rows));
    else
      f(xent::vector_view<const std::int32_t>(
          static_cast<const std::int32_t*>(labels.untyped_data()) + off, rows));
  }
};

// Calls f(T{}) with xent's element type for the logits' dtype: float32, bfloat16, float16, and
// float64 where the backend runs it (`float64`).
template <bool float64, class F>
void dispatch_dtype(const ffi::AnyBuffer& logits, F&& f) {
  switch (logits.element_type()) {
    case ffi::DataType::F32:
      return f(float{});
    case ffi::DataType::BF16:
      return f(Eigen::bfloat16{});
    case ffi::DataType::F16:
      return f(Eigen::half{});
    case ffi::DataType::F64:
      if constexpr (float64) return f(double{});
      fail("logits", "is float64, which runs on the CPU only (use float32, bfloat16 or float16)",
           ffi::ErrorCode::kUnimplemented);
    default:
      fail("logits", std::string("must be float32, bfloat16, float16 or float64, got ") +
                         dtype_name(logits.element_type()));
  }
}

// Runs a handler body, turning its exceptions into an FFI error: a bad argument keeps its code,
// xent::error (a class id out of range, an option out of its range) names its argument.
template <class F>
ffi::Error run_checked(F&& f) {
  try {
    f();
    return ffi::Error::Success();
  } catch (const bad_argument& e) {
    return ffi::Error(e.code, e.message);
  } catch (const xent::error& e) {
    return ffi::Error::InvalidArgument(std::string("xent: ") + e.what());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("xent: ") + e.what());
  }
}

// --- handler bodies ------------------------------------------------------------------------------
// `make_exec(reduced, rows)` returns a holder whose get() is the execution object for the call's
// batch elements of `rows` rows (`reduced`: whether they produce a reduced loss, which xent::cuda
// needs a workspace for); `float64` says whether that backend runs float64.

// One batch element of a call: its index b, the execution object, and xent's views of its logits
// (element type T), targets and options.
template <class T, class Targets, class Exec>
struct element {
  using value_type = T;
  using acc_type = xent::accumulator_t<T>;
  std::int64_t b;
  const Exec& exec;
  xent::matrix_view<const T> logits;
  Targets targets;
  xent::options opts;
};

// Runs f(element) for every batch element of a call, with xent's element type of the logits.
template <bool float64, class MakeExec, class F>
void for_each_element(const ce_call& c, MakeExec& make_exec, bool reduced, F&& f) {
  dispatch_dtype<float64>(c.logits, [&](auto tag) {
    using T = decltype(tag);
    const auto holder = make_exec(reduced, c.rows);
    const auto& exec = holder.get();
    for (std::int64_t b = 0; b < c.batch.count(); ++b)
      c.with_labels_at(b, [&](auto tv) {
        f(element<T, decltype(tv), std::decay_t<decltype(exec)>>{b, exec, c.logits_at<T>(b), tv,
                                                                 c.options_at(b)});
      });
  });
}

// Batch element b's N values of accumulator type A, and its N x V gradient of element type T.
template <class A>
xent::vector_view<A> rows_at(const ce_call& c, const ffi::AnyBuffer& buf,
                             const batch_layout::operand& op, std::int64_t b) {
  return {at<A>(buf, c.batch.offset(op, b)), c.rows};
}

template <class T>
xent::matrix_view<T> grad_at(const ce_call& c, const ffi::AnyBuffer& buf,
                             const batch_layout::operand& op, std::int64_t b) {
  return {at<T>(buf, c.batch.offset(op, b)), c.rows, c.classes, c.classes};
}

// Forward: loss (B...,) or (B..., N) for none, lse (B..., N).
template <bool float64, class MakeExec>
ffi::Error cross_entropy_fwd(MakeExec&& make_exec, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                             ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> loss,
                             ffi::Result<ffi::AnyBuffer> lse, const loss_attrs& attrs) {
  return run_checked([&] {
    const ce_call c(logits, labels, weight, attrs, "lse", *lse, 1);
    const auto loss_op = c.loss_operand("loss", *loss, c.acc());
    const auto lse_op = c.rows_operand("lse", *lse, c.acc());
    const bool reduced = c.opts.reduce != xent::reduction::none;
    for_each_element<float64>(c, make_exec, reduced, [&](const auto& e) {
      using A = typename std::decay_t<decltype(e)>::acc_type;
      xent::basic_forward_outputs<A> out;
      if (reduced)
        out.loss = at<A>(*loss, c.batch.offset(loss_op, e.b));
      else
        out.row_loss = rows_at<A>(c, *loss, loss_op, e.b);
      out.lse = rows_at<A>(c, *lse, lse_op, e.b);
      xent::forward(e.exec, e.logits, e.targets, e.opts, out);
    });
  });
}

// Backward from the LSE a forward saved: grad (B..., N, V) = d loss / d logits times the upstream
// gradient g, (B...,) for mean and sum, (B..., N) for none.
template <bool float64, class MakeExec>
ffi::Error cross_entropy_bwd(MakeExec&& make_exec, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                             ffi::AnyBuffer weight, ffi::AnyBuffer lse, ffi::AnyBuffer g,
                             ffi::Result<ffi::AnyBuffer> grad, const loss_attrs& attrs) {
  return run_checked([&] {
    const ce_call c(logits, labels, weight, attrs, "grad", *grad, 2);
    const auto lse_op = c.rows_operand("lse", lse, c.acc());
    const auto g_op = c.loss_operand("g", g, c.acc());
    const auto grad_op = c.grad_operand("grad", *grad);
    for_each_element<float64>(c, make_exec, false, [&](const auto& e) {
      using T = typename std::decay_t<decltype(e)>::value_type;
      using A = typename std::decay_t<decltype(e)>::acc_type;
      xent::basic_upstream<A> up;
      if (c.opts.reduce == xent::reduction::none)
        up.rows = rows_at<const A>(c, g, g_op, e.b);
      else
        up.scale_ptr = at<const A>(g, c.batch.offset(g_op, e.b));  // on CUDA, read on the device
      xent::backward(e.exec, e.logits, e.targets, e.opts, rows_at<const A>(c, lse, lse_op, e.b), up,
                     grad_at<T>(c, *grad, grad_op, e.b));
    });
  });
}

// Forward and backward in one pass for mean and sum: loss, lse and the gradient for an upstream
// gradient of 1, which the caller scales later (scale handler). `grad` may be the logits' own
// buffer (ffi_call's input_output_aliases): xent reads each row before writing its gradient.
template <bool float64, class MakeExec>
ffi::Error cross_entropy_fwd_bwd(MakeExec&& make_exec, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                                 ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> loss,
                                 ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> grad,
                                 const loss_attrs& attrs) {
  return run_checked([&] {
    const ce_call c(logits, labels, weight, attrs, "lse", *lse, 1);
    if (c.opts.reduce == xent::reduction::none)
      fail("reduction",
           "must be mean or sum for a fused forward and backward (with none, each row's upstream "
           "gradient is known only in backward)");
    const auto loss_op = c.loss_operand("loss", *loss, c.acc());
    const auto lse_op = c.rows_operand("lse", *lse, c.acc());
    const auto grad_op = c.grad_operand("grad", *grad);
    for_each_element<float64>(c, make_exec, true, [&](const auto& e) {
      using T = typename std::decay_t<decltype(e)>::value_type;
      using A = typename std::decay_t<decltype(e)>::acc_type;
      xent::basic_forward_outputs<A> out;
      out.loss = at<A>(*loss, c.batch.offset(loss_op, e.b));
      out.lse = rows_at<A>(c, *lse, lse_op, e.b);
      xent::forward_backward(e.exec, e.logits, e.targets, e.opts, xent::basic_upstream<A>{}, out,
                             grad_at<T>(c, *grad, grad_op, e.b));
    });
  });
}

// The scale handler: grad (B..., N, V) times its scale (B...,), of the gradient's accumulator
// dtype; `scale_rows(dtype, in, out, elements, scale)` scales one batch element's gradient (`out`
// is `in` where ffi_call aliased them).
template <class ScaleRows>
ffi::Error scale_grad(ffi::AnyBuffer grad_in, ffi::AnyBuffer scale,
                      ffi::Result<ffi::AnyBuffer> grad, ScaleRows&& scale_rows) {
  return run_checked([&] {
    const batch_layout batch("grad (output)", *grad, 2);
    const auto dims = grad_in.dimensions();
    if (dims.size() < 2) fail("grad", "must be (N, V), got shape " + shape_string(dims));
    const std::int64_t rows = dims[dims.size() - 2], classes = dims[dims.size() - 1];
    const ffi::DataType t = grad_in.element_type();
    if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16 &&
        t != ffi::DataType::F64)
      fail("grad",
           std::string("must be float32, bfloat16, float16 or float64, got ") + dtype_name(t));
    const auto in_op = batch.check("grad", grad_in, {rows, classes});
    expect_dtype("grad (output)", *grad, t);
    const auto out_op = batch.check("grad (output)", *grad, {rows, classes});
    const ffi::DataType acc = accumulator_dtype(t);
    expect_dtype("scale", scale, acc);
    const auto scale_op = batch.check("scale", scale, {});
    const std::size_t width = ffi::ByteWidth(t);
    for (std::int64_t b = 0; b < batch.count(); ++b)
      scale_rows(t, at<const unsigned char>(grad_in, batch.offset(in_op, b) * width),
                 at<unsigned char>(*grad, batch.offset(out_op, b) * width), rows * classes,
                 at<const unsigned char>(scale, batch.offset(scale_op, b) * ffi::ByteWidth(acc)));
  });
}

// --- bindings ------------------------------------------------------------------------------------
// The handlers' operands after a backend's context arguments (`ctx`: none on the CPU; the stream
// on CUDA), in the order xent/jax/_ffi.py passes them: `args` buffers in, `rets` buffers out. A
// handler that needs device workspace takes it as one more result (`ws` = 1, CUDA), a uint8
// buffer that XLA allocates with the call's others and the caller sizes from
// xent_jax_cuda_workspace_bytes (ffi_cuda.cu), so that nothing is allocated while the call runs.

template <int args, int rets, class B>
auto buffers(B&& ctx) {
  static_assert(rets > 0, "every handler has a result");
  if constexpr (args > 0)
    return buffers<args - 1, rets>(std::move(ctx).template Arg<ffi::AnyBuffer>());
  else if constexpr (rets > 1)
    return buffers<0, rets - 1>(std::move(ctx).template Ret<ffi::AnyBuffer>());
  else
    return std::move(ctx).template Ret<ffi::AnyBuffer>();
}

template <int ws = 0, class B>
auto loss_binding(B&& ctx) {  // logits, labels, weight -> loss, lse
  return buffers<3, 2 + ws>(std::move(ctx)).template Attrs<loss_attrs>();
}

template <class B>
auto backward_binding(B&& ctx) {  // logits, labels, weight, lse, g -> grad
  return buffers<5, 1>(std::move(ctx)).template Attrs<loss_attrs>();
}

template <int ws = 0, class B>
auto fused_binding(B&& ctx) {  // logits, labels, weight -> loss, lse, grad
  return buffers<3, 3 + ws>(std::move(ctx)).template Attrs<loss_attrs>();
}

template <class B>
auto scale_binding(B&& ctx) {  // grad, scale -> grad
  return buffers<2, 1>(std::move(ctx));
}

}  // namespace xent_jax

// The attributes arrive as one dictionary (ffi_call's keyword arguments), decoded by name.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(xent_jax::loss_attrs,
                                      xla::ffi::StructMember<std::int64_t>("ignore_index"),
                                      xla::ffi::StructMember<std::int32_t>("reduction"),
                                      xla::ffi::StructMember<float>("label_smoothing"),
                                      xla::ffi::StructMember<float>("z_loss"),
                                      xla::ffi::StructMember<float>("softcap"));

// A handler exported as the C symbol `name` (the library is built with hidden visibility; only
// the handlers are its interface), with XLA's handler traits where given (...).
#define XENT_JAX_HANDLER(name, impl, ...)                                \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name( \
      XLA_FFI_CallFrame* call_frame);                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, __VA_ARGS__)
