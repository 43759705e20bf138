// xent's XLA FFI handlers for the CPU: the bodies of ffi_ops.h and ffi_linear.h on xent::cpu,
// exported as plain C symbols (XLA_FFI_DEFINE_HANDLER_SYMBOL) that xent/jax/_ffi.py loads with
// ctypes and registers with jax.ffi.register_ffi_target(platform="cpu").
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "ffi_linear.h"
#include "ffi_ops.h"
#include "ffi_vocab_parallel.h"

namespace xent_jax {
namespace {

// xent::cpu with a thread per hardware thread: XLA runs the handler on one of its own threads
// and waits for it, so the call may use the machine (xent starts its workers per call).
struct cpu_exec {
  xent::cpu exec{std::max(1, static_cast<int>(std::thread::hardware_concurrency()))};
  const xent::cpu& get() const { return exec; }
};

// The fused linear calls' workspace: host memory that lives for the handler's call.
struct host_workspace {
  std::vector<unsigned char> bytes;
  void* operator()(std::size_t n) {
    bytes.resize(n);
    return bytes.data();
  }
};

// No workspace on the CPU.
cpu_exec make_cpu_exec(bool /*reduced*/, std::int64_t /*rows*/) { return {}; }
cpu_exec make_vp_exec(vp_phase /*phase*/, std::int64_t /*rows*/) { return {}; }

ffi::Error fwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
               ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
               loss_attrs attrs) {
  return cross_entropy_fwd<true>(make_cpu_exec, logits, labels, weight, loss, lse, attrs);
}

ffi::Error bwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
               ffi::AnyBuffer lse, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> grad,
               loss_attrs attrs) {
  return cross_entropy_bwd<true>(make_cpu_exec, logits, labels, weight, lse, g, grad, attrs);
}

ffi::Error fwd_bwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
                   ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                   ffi::Result<ffi::AnyBuffer> grad, loss_attrs attrs) {
  return cross_entropy_fwd_bwd<true>(make_cpu_exec, logits, labels, weight, loss, lse, grad, attrs);
}

ffi::Error lin_fwd(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                   ffi::AnyBuffer labels, ffi::AnyBuffer class_weight,
                   ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                   linear_attrs attrs) {
  return linear_fwd<true>(cpu_exec{}.exec, host_workspace{}, hidden, weight, bias, labels,
                          class_weight, loss, lse, attrs);
}

ffi::Error lin_bwd(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                   ffi::AnyBuffer labels, ffi::AnyBuffer class_weight, ffi::AnyBuffer lse,
                   ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> dh, ffi::Result<ffi::AnyBuffer> dw,
                   ffi::Result<ffi::AnyBuffer> db, linear_attrs attrs) {
  return linear_bwd<true>(cpu_exec{}.exec, host_workspace{}, hidden, weight, bias, labels,
                          class_weight, lse, g, dh, dw, db, attrs);
}

ffi::Error lin_fwd_bwd(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                       ffi::AnyBuffer labels, ffi::AnyBuffer class_weight,
                       ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> dh, ffi::Result<ffi::AnyBuffer> dw,
                       ffi::Result<ffi::AnyBuffer> db, linear_attrs attrs) {
  return linear_fwd_bwd<true>(cpu_exec{}.exec, host_workspace{}, hidden, weight, bias, labels,
                              class_weight, loss, lse, dh, dw, db, attrs);
}

ffi::Error vp_rec(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
                  ffi::Result<ffi::AnyBuffer> send, vp_attrs attrs) {
  return vp_records(make_vp_exec, logits, labels, weight, send, attrs);
}

ffi::Error vp_mrg(ffi::AnyBuffer recv, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
                  ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                  vp_attrs attrs) {
  return vp_merge(make_vp_exec, recv, labels, weight, loss, lse, attrs);
}

ffi::Error vp_bwd(ffi::AnyBuffer logits, ffi::AnyBuffer labels, ffi::AnyBuffer weight,
                  ffi::AnyBuffer lse, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> grad,
                  vp_attrs attrs) {
  return vp_backward(make_vp_exec, logits, labels, weight, lse, g, grad, attrs);
}

// One batch element's gradient times its scale, in the accumulator type and rounded once to the
// gradient's (as xent rounds the gradient it writes). A scale of exactly 1 (jax.grad of the loss
// itself) leaves an aliased gradient untouched: x * 1 == x for every float, NaN included.
template <class T, class A>
void scale_elements(const T* in, T* out, std::int64_t n, A s) {
  if (s == A(1)) {
    if (out != in) std::memcpy(out, in, static_cast<std::size_t>(n) * sizeof(T));
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(static_cast<A>(in[i]) * s);
}

ffi::Error scale(ffi::AnyBuffer grad_in, ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> grad) {
  return scale_grad(grad_in, s, grad,
                    [](ffi::DataType t, const void* in, void* out, std::int64_t n, const void* sp) {
                      auto run = [&](auto tag) {
                        using T = decltype(tag);
                        using A = xent::accumulator_t<T>;
                        scale_elements(static_cast<const T*>(in), static_cast<T*>(out), n,
                                       *static_cast<const A*>(sp));
                      };
                      if (t == ffi::DataType::F32) return run(float{});
                      if (t == ffi::DataType::BF16) return run(Eigen::bfloat16{});
                      if (t == ffi::DataType::F16) return run(Eigen::half{});
                      run(double{});
                    });
}

}  // namespace
}  // namespace xent_jax

XENT_JAX_HANDLER(xent_cross_entropy_fwd_cpu, xent_jax::fwd,
                 xent_jax::loss_binding(xla::ffi::Ffi::Bind()));
XENT_JAX_HANDLER(xent_cross_entropy_bwd_cpu, xent_jax::bwd,
                 xent_jax::backward_binding(xla::ffi::Ffi::Bind()));
XENT_JAX_HANDLER(xent_cross_entropy_fwd_bwd_cpu, xent_jax::fwd_bwd,
                 xent_jax::fused_binding(xla::ffi::Ffi::Bind()));
XENT_JAX_HANDLER(xent_scale_grad_cpu, xent_jax::scale,
                 xent_jax::scale_binding(xla::ffi::Ffi::Bind()));
XENT_JAX_HANDLER(xent_linear_cross_entropy_fwd_cpu, xent_jax::lin_fwd,
                 xent_jax::linear_loss_binding(xla::ffi::Ffi::Bind()));
XENT_JAX_HANDLER(xent_linear_cross_entropy_bwd_cpu, xent_jax::lin_bwd,
                 xent_jax::linear_backward_binding(xla::ffi::Ffi::Bind()));
XENT_JAX_HANDLER(xent_linear_cross_entropy_fwd_bwd_cpu, xent_jax::lin_fwd_bwd,
                 xent_jax::linear_fused_binding(xla::ffi::Ffi::Bind()));
XENT_JAX_HANDLER(xent_vocab_parallel_records_cpu, xent_jax::vp_rec,
                 xent_jax::vp_records_binding(xla::ffi::Ffi::Bind()));
XENT_JAX_HANDLER(xent_vocab_parallel_merge_cpu, xent_jax::vp_mrg,
                 xent_jax::vp_merge_binding(xla::ffi::Ffi::Bind()));
XENT_JAX_HANDLER(xent_vocab_parallel_backward_cpu, xent_jax::vp_bwd,
                 xent_jax::vp_backward_binding(xla::ffi::Ffi::Bind()));

// Bytes of one device's records block for `rows` rows (class ids; label smoothing widens the
// records), the same on every backend: xent/jax/vocab_parallel.py sizes the records call's result
// with it, so the layout is written in parallel/records.hpp alone. -1 for rows the exchange
// refuses.
extern "C" __attribute__((visibility("default"))) std::int64_t xent_jax_records_bytes(
    std::int64_t rows, float label_smoothing) {
  xent::options opts;
  opts.label_smoothing = label_smoothing;
  try {
    return static_cast<std::int64_t>(
        xent::vocab_parallel_exchange_bytes(xent::cpu{}, rows, false, opts, false));
  } catch (const std::exception&) {
    return -1;
  }
}
