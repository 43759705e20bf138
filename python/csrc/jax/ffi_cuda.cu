// xent's XLA FFI handlers for CUDA: the bodies of ffi_ops.h and ffi_linear.h on xent::cuda,
// registered by xent/jax/_ffi.py with jax.ffi.register_ffi_target(platform="CUDA"). Built by
// CMakeLists.txt when nvcc is found.
//
// Every handler runs on the stream XLA gives it and only enqueues work: no host synchronisation,
// no allocation outside XLA's. xent's reduced-loss workspace (xent::cuda::workspace) is an FFI
// scratch allocation from XLA's allocator, zero-filled on the stream by each call
// (cudaMemsetAsync), since XLA's memory holds whatever it last held; the calls of one handler's
// batch share it in stream order (each leaves it zeroed for the next).
//
// The fused linear handlers need a cuBLAS handle, which XLA does not give an FFI call: each thread
// keeps one per device, created on its first call and kept for the process (cublasCreate
// allocates, and a handle must not serve two threads at once). A call binds it to XLA's stream
// and gives it a workspace from XLA's scratch allocator (cublasSetStream resets the handle's
// workspace to cuBLAS's own pool, which would allocate behind XLA's back); the linear workspace
// comes from the same allocator.
//
// Out-of-range class ids (not ignore_index, outside [0, V)) cannot be reported without a
// synchronisation: such a row gets a NaN loss and LSE and a zero gradient row (xent::cuda's
// contract), and no counter is kept.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "ffi_linear.h"
#include "ffi_ops.h"
#include "ffi_vocab_parallel.h"

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

// The execution object on XLA's stream with, when `bytes` is not 0, a zero-filled workspace
// from XLA's scratch allocator (freed when the handler returns, after its work is enqueued: XLA
// orders the reuse on the same stream).
cuda_exec exec_with_workspace(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                              std::size_t bytes) {
  cuda_exec c;
  c.exec.stream = stream;
  if (bytes != 0) {
    const auto ws = scratch.Allocate(bytes, 256);
    if (!ws.has_value())
      fail("workspace", "of " + std::to_string(bytes) + " bytes could not be allocated",
           ffi::ErrorCode::kResourceExhausted);
    check_cuda(cudaMemsetAsync(*ws, 0, bytes, stream), "cudaMemsetAsync (workspace)");
    c.exec.workspace = *ws;
    c.exec.workspace_bytes = bytes;
  }
  return c;
}

// Calls with a reduced loss need xent::cuda's workspace.
auto cuda_exec_maker(cudaStream_t stream, ffi::ScratchAllocator& scratch) {
  return [stream, &scratch](bool reduced, std::int64_t rows) {
    return exec_with_workspace(stream, scratch, reduced ? xent::cuda_workspace_size(rows) : 0);
  };
}

// The vocab-parallel merge needs the finish phase's workspace; records and class-id backward none.
auto vp_exec_maker(cudaStream_t stream, ffi::ScratchAllocator& scratch) {
  return [stream, &scratch](vp_phase phase, std::int64_t rows) {
    return exec_with_workspace(
        stream, scratch,
        phase == vp_phase::merge ? xent::cuda_vocab_parallel_finish_workspace_size(rows) : 0);
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

// --- vocab-parallel phases
// ------------------------------------------------------------------------
//
// A bad tiling of the gathered headers cannot throw here (the host does not read them): every
// device's merge writes NaN (cuda/vocab_parallel.cuh), with no counter kept, as for a class id out
// of range.

ffi::Error vp_rec(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer logits,
                  ffi::AnyBuffer labels, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> send,
                  vp_attrs attrs) {
  return vp_records(vp_exec_maker(stream, scratch), logits, labels, weight, send, attrs);
}

ffi::Error vp_mrg(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer recv,
                  ffi::AnyBuffer labels, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> loss,
                  ffi::Result<ffi::AnyBuffer> lse, vp_attrs attrs) {
  return vp_merge(vp_exec_maker(stream, scratch), recv, labels, weight, loss, lse, attrs);
}

ffi::Error vp_bwd(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer logits,
                  ffi::AnyBuffer labels, ffi::AnyBuffer weight, ffi::AnyBuffer lse,
                  ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> grad, vp_attrs attrs) {
  return vp_backward(vp_exec_maker(stream, scratch), logits, labels, weight, lse, g, grad, attrs);
}

// --- fused linear cross-entropy -----------------------------------------------------------------

void check_blas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail(what, std::string("failed: ") + cublasGetStatusString(status), ffi::ErrorCode::kInternal);
}

// cuBLAS's workspace for its GEMMs: what NVIDIA's cuBLAS guide recommends on Hopper, 32 MiB (it
// also covers the smaller recommendations for older GPUs).
constexpr std::size_t blas_workspace_bytes = std::size_t{32} << 20;

void* scratch_bytes(ffi::ScratchAllocator& scratch, std::size_t bytes, const char* what) {
  if (bytes == 0) return nullptr;
  const auto p = scratch.Allocate(bytes, 256);
  if (!p.has_value())
    fail(what, "of " + std::to_string(bytes) + " bytes could not be allocated",
         ffi::ErrorCode::kResourceExhausted);
  return *p;
}

// This thread's handle for `device`, bound to `stream` with a workspace from `scratch`.
cublasHandle_t blas_handle(int device, cudaStream_t stream, ffi::ScratchAllocator& scratch) {
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  cublasHandle_t& h = handles[device];
  if (h == nullptr) {
    int current = 0;
    check_cuda(cudaGetDevice(&current), "cudaGetDevice");
    if (current != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    const cublasStatus_t created = cublasCreate(&h);
    if (current != device) cudaSetDevice(current);
    if (created != CUBLAS_STATUS_SUCCESS) h = nullptr;
    check_blas(created, "cublasCreate");
  }
  check_blas(cublasSetStream(h, stream), "cublasSetStream");
  check_blas(cublasSetWorkspace(h, scratch_bytes(scratch, blas_workspace_bytes, "cuBLAS workspace"),
                                blas_workspace_bytes),
             "cublasSetWorkspace");
  return h;
}

// The execution object of a fused linear call and its workspace's allocator; the exec's own
// reduced-loss workspace stays empty (the linear calls keep their sums in the linear workspace).
struct linear_exec {
  xent::cuda exec;
  ffi::ScratchAllocator* scratch;
  void* operator()(std::size_t bytes) { return scratch_bytes(*scratch, bytes, "workspace"); }
};

template <class F>
ffi::Error with_linear_exec(cudaStream_t stream, ffi::ScratchAllocator& scratch, int device,
                            F&& f) {
  linear_exec le{};
  le.exec.stream = stream;
  le.scratch = &scratch;
  ffi::Error bound = run_checked([&] { le.exec.cublas = blas_handle(device, stream, scratch); });
  if (!bound.success()) return bound;
  return f(le.exec, le);
}

ffi::Error lin_fwd(cudaStream_t stream, ffi::ScratchAllocator scratch, int device,
                   ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                   ffi::AnyBuffer labels, ffi::AnyBuffer class_weight,
                   ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                   loss_attrs attrs) {
  return with_linear_exec(stream, scratch, device, [&](const xent::cuda& exec, auto& alloc) {
    return linear_fwd<false>(exec, alloc, hidden, weight, bias, labels, class_weight, loss, lse,
                             attrs);
  });
}

ffi::Error lin_bwd(cudaStream_t stream, ffi::ScratchAllocator scratch, int device,
                   ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                   ffi::AnyBuffer labels, ffi::AnyBuffer class_weight, ffi::AnyBuffer lse,
                   ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> dh, ffi::Result<ffi::AnyBuffer> dw,
                   ffi::Result<ffi::AnyBuffer> db, loss_attrs attrs) {
  return with_linear_exec(stream, scratch, device, [&](const xent::cuda& exec, auto& alloc) {
    return linear_bwd<false>(exec, alloc, hidden, weight, bias, labels, class_weight, lse, g, dh,
                             dw, db, attrs);
  });
}

ffi::Error lin_fwd_bwd(cudaStream_t stream, ffi::ScratchAllocator scratch, int device,
                       ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                       ffi::AnyBuffer labels, ffi::AnyBuffer class_weight,
                       ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> dh, ffi::Result<ffi::AnyBuffer> dw,
                       ffi::Result<ffi::AnyBuffer> db, loss_attrs attrs) {
  return with_linear_exec(stream, scratch, device, [&](const xent::cuda& exec, auto& alloc) {
    return linear_fwd_bwd<false>(exec, alloc, hidden, weight, bias, labels, class_weight, loss, lse,
                                 dh, dw, db, attrs);
  });
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

// The CUDA handlers' context: XLA's stream, then (cross-entropy, fused linear) its scratch
// allocator.
auto stream_binding() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
auto stream_scratch_binding() { return stream_binding().Ctx<ffi::ScratchAllocator>(); }
// The fused linear handlers': also the device (for this thread's cuBLAS handle).
auto linear_context_binding() { return stream_scratch_binding().Ctx<ffi::DeviceOrdinal>(); }

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
XENT_JAX_HANDLER(xent_linear_cross_entropy_fwd_cuda, xent_jax::lin_fwd,
                 xent_jax::linear_loss_binding(xent_jax::linear_context_binding()));
XENT_JAX_HANDLER(xent_linear_cross_entropy_bwd_cuda, xent_jax::lin_bwd,
                 xent_jax::linear_backward_binding(xent_jax::linear_context_binding()));
XENT_JAX_HANDLER(xent_linear_cross_entropy_fwd_bwd_cuda, xent_jax::lin_fwd_bwd,
                 xent_jax::linear_fused_binding(xent_jax::linear_context_binding()));
XENT_JAX_HANDLER(xent_vocab_parallel_records_cuda, xent_jax::vp_rec,
                 xent_jax::vp_records_binding(xent_jax::stream_scratch_binding()));
XENT_JAX_HANDLER(xent_vocab_parallel_merge_cuda, xent_jax::vp_mrg,
                 xent_jax::vp_merge_binding(xent_jax::stream_scratch_binding()));
XENT_JAX_HANDLER(xent_vocab_parallel_backward_cuda, xent_jax::vp_bwd,
                 xent_jax::vp_backward_binding(xent_jax::stream_scratch_binding()));
