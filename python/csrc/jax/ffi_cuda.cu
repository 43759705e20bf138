// xent's XLA FFI handlers for CUDA: the bodies of ffi_ops.h on xent::cuda, registered by
// xent/jax/_ffi.py with jax.ffi.register_ffi_target(platform="CUDA"). Built by CMakeLists.txt
// when nvcc is found.
//
// Every handler runs on the stream XLA gives it and only enqueues work: no host synchronisation,
// no allocation outside XLA's. xent's reduced-loss workspace (xent::cuda::workspace) is an FFI
// scratch allocation from XLA's allocator, zero-filled on the stream by each call
// (cudaMemsetAsync), since XLA's memory holds whatever it last held; the calls of one handler's
// batch share it in stream order (each leaves it zeroed for the next).
//
// Out-of-range class ids (not ignore_index, outside [0, V)) cannot be reported without a
// synchronisation: such a row gets a NaN loss and LSE and a zero gradient row (xent::cuda's
// contract), and no counter is kept.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "ffi_ops.h"

namespace xent_jax {
namespace {

// A CUDA failure as the FFI error the handler returns (run_checked catches it).
void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    fail(what, std::string("failed: ") + cudaGetErrorString(status), ffi::ErrorCode::kInternal);
}

struct cuda_exec {
  xent::cuda exec;
  const xent::cuda& get() const { return exec; }
};

// The execution object on XLA's stream; for calls with a reduced loss, a zero-filled workspace
// from XLA's scratch allocator (freed when the handler returns, after its work is enqueued: XLA
// orders the reuse on the same stream).
auto cuda_exec_maker(cudaStream_t stream, ffi::ScratchAllocator& scratch) {
  return [stream, &scratch](bool reduced, std::int64_t rows) {
    cuda_exec c;
    c.exec.stream = stream;
    if (reduced) {
      const std::size_t bytes = xent::cuda_workspace_size(rows);
      const auto ws = scratch.Allocate(bytes, 256);
      if (!ws.has_value())
        fail("workspace", "of " + std::to_string(bytes) + " bytes could not be allocated",
             ffi::ErrorCode::kResourceExhausted);
      check_cuda(cudaMemsetAsync(*ws, 0, bytes, stream), "cudaMemsetAsync (workspace)");
      c.exec.workspace = *ws;
      c.exec.workspace_bytes = bytes;
    }
    return c;
  };
}

ffi::Error fwd(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer logits,
               ffi::AnyBuffer labels, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> loss,
               ffi::Result<ffi::AnyBuffer> lse, loss_attrs attrs) {
  return cross_entropy_fwd<false>(cuda_exec_maker(stream, scratch), logits, labels, weight, loss,
                                  lse, attrs);
}

ffi::Error bwd(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer logits,
               ffi::AnyBuffer labels, ffi::AnyBuffer weight, ffi::AnyBuffer lse, ffi::AnyBuffer g,
               ffi::Result<ffi::AnyBuffer> grad, loss_attrs attrs) {
  return cross_entropy_bwd<false>(cuda_exec_maker(stream, scratch), logits, labels, weight, lse, g,
                                  grad, attrs);
}

ffi::Error fwd_bwd(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer logits,
                   ffi::AnyBuffer labels, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> loss,
                   ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> grad,
                   loss_attrs attrs) {
  return cross_entropy_fwd_bwd<false>(cuda_exec_maker(stream, scratch), logits, labels, weight,
                                      loss, lse, grad, attrs);
}

// --- the saved gradient times the loss's gradient ------------------------------------------------
//
// The scale is read on the device (nothing waits for it, and a replayed graph reads whatever it
// holds). Every thread reads it first: at exactly 1 (jax.grad of the loss itself) over an aliased
// gradient it returns at once, since x * 1 == x for every float, NaN included; otherwise each
// element is multiplied in float and rounded to the gradient's dtype, as xent rounds the gradient
// it writes.
template <class T>
__global__ void scale_elements(const T* in, T* out, std::int64_t n, const float* scale) {
  const float s = *scale;
  if (s == 1.0f && in == out) return;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += step)
    out[i] = static_cast<T>(static_cast<float>(in[i]) * s);
}

template <class T>
void launch_scale(const void* in, void* out, std::int64_t n, const void* scale,
                  cudaStream_t stream) {
  if (n == 0) return;
  constexpr int threads = 256;
  // The loop strides over what a grid of this size leaves: enough blocks to fill any GPU, and
  // when the scale is 1 each block only reads it and returns.
  const auto blocks =
      static_cast<unsigned>(std::min<std::int64_t>(4096, (n + threads - 1) / threads));
  scale_elements<T><<<blocks, threads, 0, stream>>>(static_cast<const T*>(in), static_cast<T*>(out),
                                                    n, static_cast<const float*>(scale));
  check_cuda(cudaGetLastError(), "scale_elements launch");
}

ffi::Error scale(cudaStream_t stream, ffi::AnyBuffer grad_in, ffi::AnyBuffer s,
                 ffi::Result<ffi::AnyBuffer> grad) {
  return scale_grad(
      grad_in, s, grad,
      [stream](ffi::DataType t, const void* in, void* out, std::int64_t n, const void* sp) {
        if (t == ffi::DataType::F32) return launch_scale<float>(in, out, n, sp, stream);
        if (t == ffi::DataType::BF16) return launch_scale<__nv_bfloat16>(in, out, n, sp, stream);
        if (t == ffi::DataType::F16) return launch_scale<__half>(in, out, n, sp, stream);
        fail("grad", "is float64, which runs on the CPU only", ffi::ErrorCode::kUnimplemented);
      });
}

// The CUDA handlers' context: XLA's stream, then (cross-entropy) its scratch allocator.
auto stream_binding() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
auto stream_scratch_binding() { return stream_binding().Ctx<ffi::ScratchAllocator>(); }

}  // namespace
}  // namespace xent_jax

XENT_JAX_HANDLER(xent_cross_entropy_fwd_cuda, xent_jax::fwd,
                 xent_jax::loss_binding(xent_jax::stream_scratch_binding()));
XENT_JAX_HANDLER(xent_cross_entropy_bwd_cuda, xent_jax::bwd,
                 xent_jax::backward_binding(xent_jax::stream_scratch_binding()));
XENT_JAX_HANDLER(xent_cross_entropy_fwd_bwd_cuda, xent_jax::fwd_bwd,
                 xent_jax::fused_binding(xent_jax::stream_scratch_binding()));
XENT_JAX_HANDLER(xent_scale_grad_cuda, xent_jax::scale,
                 xent_jax::scale_binding(xent_jax::stream_binding()));
