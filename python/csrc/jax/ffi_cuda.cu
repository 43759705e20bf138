// xent's XLA FFI handlers for CUDA: the bodies of ffi_ops.h and ffi_linear.h on xent::cuda,
// registered by xent/jax/_ffi.py with jax.ffi.register_ffi_target(platform="CUDA"). Built by
// CMakeLists.txt when nvcc is found.
//
// Every handler runs on the stream XLA gives it and only enqueues work: no host synchronisation
// and no allocation, so each declares XLA's command-buffer trait and XLA may capture it into a
// CUDA graph (--xla_gpu_enable_command_buffer). Device workspace is a result buffer of the call
// (ffi_ops.h's bindings), which XLA allocates with the executable's other buffers, at an address
// a replayed graph finds again, sized by the caller with xent_jax_cuda_workspace_bytes below.
// xent's reduced-loss workspace (xent::cuda::workspace) is zero-filled on the stream by each call
// (cudaMemsetAsync, a graph node like the kernels), since XLA's memory holds whatever it last
// held; the calls of one handler's batch share it in stream order (each leaves it zeroed for the
// next).
//
// The fused linear handlers need a cuBLAS handle, which XLA does not give an FFI call: each thread
// keeps one per device, created on its first call and kept for the process (a handle must not
// serve two threads at once). cublasCreate allocates, which stream capture forbids, so a first
// call under capture creates it in relaxed capture mode (nothing of it goes on the captured
// stream). A call binds the handle to XLA's stream and to the first 32 MiB of its workspace
// (cublasSetStream resets the handle's workspace to cuBLAS's own pool, which would allocate
// behind XLA's back and cannot be captured); the linear workspace follows in the same buffer.
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

// Bytes of a workspace buffer (a result of the call).
std::size_t buffer_bytes(const ffi::AnyBuffer& b) {
  return b.element_count() * ffi::ByteWidth(b.element_type());
}

// The execution object on XLA's stream with, when `bytes` is not 0, the call's workspace result
// `ws` zero-filled as its workspace.
cuda_exec exec_with_workspace(cudaStream_t stream, ffi::AnyBuffer& ws, std::size_t bytes) {
  cuda_exec c;
  c.exec.stream = stream;
  if (bytes != 0) {
    if (buffer_bytes(ws) < bytes)
      fail("workspace", "must hold " + std::to_string(bytes) + " bytes, got " +
                            std::to_string(buffer_bytes(ws)) +
                            " (size it with xent_jax_cuda_workspace_bytes)");
    check_cuda(cudaMemsetAsync(ws.untyped_data(), 0, bytes, stream), "cudaMemsetAsync (workspace)");
    c.exec.workspace = ws.untyped_data();
    c.exec.workspace_bytes = bytes;
  }
  return c;
}

// Calls with a reduced loss need xent::cuda's workspace; the others none (ws: null).
auto cuda_exec_maker(cudaStream_t stream, ffi::AnyBuffer* ws) {
  return [stream, ws](bool reduced, std::int64_t rows) {
    if (!reduced || ws == nullptr) return cuda_exec{xent::cuda{stream}};
    return exec_with_workspace(stream, *ws, xent::cuda_workspace_size(rows));
  };
}

// The vocab-parallel merge needs the finish phase's workspace; records and backward none.
auto vp_exec_maker(cudaStream_t stream, ffi::AnyBuffer* ws) {
  return [stream, ws](vp_phase phase, std::int64_t rows) {
    if (phase != vp_phase::merge || ws == nullptr) return cuda_exec{xent::cuda{stream}};
    return exec_with_workspace(stream, *ws, xent::cuda_vocab_parallel_finish_workspace_size(rows));
  };
}

ffi::Error fwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
               ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> loss,
               ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> ws, loss_attrs attrs) {
  return cross_entropy_fwd<false>(cuda_exec_maker(stream, &*ws), logits, labels, weight, loss, lse,
                                  attrs);
}

ffi::Error bwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
               ffi::AnyBuffer weight, ffi::AnyBuffer lse, ffi::AnyBuffer g,
               ffi::Result<ffi::AnyBuffer> grad, loss_attrs attrs) {
  return cross_entropy_bwd<false>(cuda_exec_maker(stream, nullptr), logits, labels, weight, lse, g,
                                  grad, attrs);
}

ffi::Error fwd_bwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                   ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> loss,
                   ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> grad,
                   ffi::Result<ffi::AnyBuffer> ws, loss_attrs attrs) {
  return cross_entropy_fwd_bwd<false>(cuda_exec_maker(stream, &*ws), logits, labels, weight, loss,
                                      lse, grad, attrs);
}

// --- vocab-parallel phases
// ------------------------------------------------------------------------
//
// A bad tiling of the gathered headers cannot throw here (the host does not read them): every
// device's merge writes NaN (cuda/vocab_parallel.cuh), with no counter kept, as for a class id out
// of range.

ffi::Error vp_rec(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                  ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> send, vp_attrs attrs) {
  return vp_records(vp_exec_maker(stream, nullptr), logits, labels, weight, send, attrs);
}

ffi::Error vp_mrg(cudaStream_t stream, ffi::AnyBuffer recv, ffi::AnyBuffer labels,
                  ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> loss,
                  ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> ws, vp_attrs attrs) {
  return vp_merge(vp_exec_maker(stream, &*ws), recv, labels, weight, loss, lse, attrs);
}

ffi::Error vp_bwd(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                  ffi::AnyBuffer weight, ffi::AnyBuffer lse, ffi::AnyBuffer g,
                  ffi::Result<ffi::AnyBuffer> grad, vp_attrs attrs) {
  return vp_backward(vp_exec_maker(stream, nullptr), logits, labels, weight, lse, g, grad, attrs);
}

// --- fused linear cross-entropy -----------------------------------------------------------------

void check_blas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail(what, std::string("failed: ") + cublasGetStatusString(status), ffi::ErrorCode::kInternal);
}

// cuBLAS's workspace for its GEMMs: what NVIDIA's cuBLAS guide recommends on Hopper, 32 MiB (it
// also covers the smaller recommendations for older GPUs). It leads the linear calls' workspace.
constexpr std::size_t blas_workspace_bytes = std::size_t{32} << 20;

// cublasCreate under stream capture: in relaxed mode, which lets this thread allocate while its
// stream is captured (cublasCreate enqueues nothing on it).
cublasStatus_t create_handle(cublasHandle_t* h, cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
  if (capturing == cudaStreamCaptureStatusNone) return cublasCreate(h);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  check_cuda(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
  const cublasStatus_t created = cublasCreate(h);
  check_cuda(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
  return created;
}

// This thread's handle for `device`, bound to `stream` with `workspace` (blas_workspace_bytes).
cublasHandle_t blas_handle(int device, cudaStream_t stream, void* workspace) {
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  cublasHandle_t& h = handles[device];
  if (h == nullptr) {
    int current = 0;
    check_cuda(cudaGetDevice(&current), "cudaGetDevice");
    if (current != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    const cublasStatus_t created = create_handle(&h, stream);
    if (current != device) cudaSetDevice(current);
    if (created != CUBLAS_STATUS_SUCCESS) h = nullptr;
    check_blas(created, "cublasCreate");
  }
  check_blas(cublasSetStream(h, stream), "cublasSetStream");
  check_blas(cublasSetWorkspace(h, workspace, blas_workspace_bytes), "cublasSetWorkspace");
  return h;
}

// The linear workspace's allocator: the bytes of the call's workspace result past cuBLAS's.
struct linear_alloc {
  ffi::AnyBuffer* ws;
  void* operator()(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    if (buffer_bytes(*ws) < blas_workspace_bytes + bytes)
      fail("workspace", "must hold " + std::to_string(blas_workspace_bytes + bytes) +
                            " bytes, got " + std::to_string(buffer_bytes(*ws)) +
                            " (size it with xent_jax_cuda_workspace_bytes)");
    return static_cast<unsigned char*>(ws->untyped_data()) + blas_workspace_bytes;
  }
};

// The execution object of a fused linear call, cuBLAS bound to the first bytes of `ws`. hidden's
// dtype is checked first: the workspace query knows no float64 and sizes such a call's workspace
// 0, so a workspace error would otherwise hide the one that names float64.
template <class F>
ffi::Error with_linear_exec(cudaStream_t stream, int device, const ffi::AnyBuffer& hidden,
                            ffi::AnyBuffer& ws, F&& f) {
  xent::cuda exec{stream};
  ffi::Error bound = run_checked([&] {
    dispatch_dtype<false>(hidden, [](auto) {});
    if (buffer_bytes(ws) < blas_workspace_bytes)
      fail("workspace", "must hold at least the " + std::to_string(blas_workspace_bytes) +
                            " bytes of cuBLAS's, got " + std::to_string(buffer_bytes(ws)));
    exec.cublas = blas_handle(device, stream, ws.untyped_data());
  });
  if (!bound.success()) return bound;
  return f(exec, linear_alloc{&ws});
}

ffi::Error lin_fwd(cudaStream_t stream, int device, ffi::AnyBuffer hidden, ffi::AnyBuffer weight,
                   ffi::AnyBuffer bias, ffi::AnyBuffer labels, ffi::AnyBuffer class_weight,
                   ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                   ffi::Result<ffi::AnyBuffer> ws, linear_attrs attrs) {
  return with_linear_exec(stream, device, hidden, *ws, [&](const xent::cuda& exec, auto alloc) {
    return linear_fwd<false>(exec, alloc, hidden, weight, bias, labels, class_weight, loss, lse,
                             attrs);
  });
}

ffi::Error lin_bwd(cudaStream_t stream, int device, ffi::AnyBuffer hidden, ffi::AnyBuffer weight,
                   ffi::AnyBuffer bias, ffi::AnyBuffer labels, ffi::AnyBuffer class_weight,
                   ffi::AnyBuffer lse, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> dh,
                   ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> db,
                   ffi::Result<ffi::AnyBuffer> ws, linear_attrs attrs) {
  return with_linear_exec(stream, device, hidden, *ws, [&](const xent::cuda& exec, auto alloc) {
    return linear_bwd<false>(exec, alloc, hidden, weight, bias, labels, class_weight, lse, g, dh,
                             dw, db, attrs);
  });
}

ffi::Error lin_fwd_bwd(cudaStream_t stream, int device, ffi::AnyBuffer hidden,
                       ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::AnyBuffer labels,
                       ffi::AnyBuffer class_weight, ffi::Result<ffi::AnyBuffer> loss,
                       ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> dh,
                       ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> db,
                       ffi::Result<ffi::AnyBuffer> ws, linear_attrs attrs) {
  return with_linear_exec(stream, device, hidden, *ws, [&](const xent::cuda& exec, auto alloc) {
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

// The CUDA handlers' context: XLA's stream; the fused linear handlers' also the device (for this
// thread's cuBLAS handle).
auto stream_binding() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
auto linear_context_binding() { return stream_binding().Ctx<ffi::DeviceOrdinal>(); }

// The workspace query of the calls that take one, for the CUDA handlers (see the file comment).
enum class workspace_kind : int {
  cross_entropy = 0,         // cross_entropy fwd and fwd_bwd with a reduced loss: `rows` rows
  vocab_parallel_merge = 1,  // vocab-parallel merge of `rows` rows
  linear_forward = 2,        // fused linear forward of (rows, dim, vocab), dtype as below
  linear_training = 3,       // fused linear fwd_bwd and bwd
};

template <class T>
std::size_t linear_bytes(xent::linear_pass pass, std::int64_t rows, std::int64_t dim,
                         std::int64_t vocab, const xent::linear_options& opts) {
  return blas_workspace_bytes +
         xent::linear_workspace_size<T>(xent::cuda{}, {rows, dim, vocab}, pass, opts).bytes;
}

}  // namespace
}  // namespace xent_jax

// Bytes of the workspace result a call of `kind` takes (host code: no GPU needed), or -1 for a
// kind, dtype (0 float32, 1 bfloat16, 2 float16), shape or training choice (the linear kinds'
// order, accumulate and sparse_threshold, as linear_attrs takes them) that no call takes.
extern "C" __attribute__((visibility("default"))) std::int64_t xent_jax_cuda_workspace_bytes(
    int kind, int dtype, std::int64_t rows, std::int64_t dim, std::int64_t vocab, int order,
    int accumulate, float sparse_threshold) {
  using xent_jax::workspace_kind;
  try {
    switch (static_cast<workspace_kind>(kind)) {
      case workspace_kind::cross_entropy:
        return static_cast<std::int64_t>(xent::cuda_workspace_size(rows));
      case workspace_kind::vocab_parallel_merge:
        return static_cast<std::int64_t>(xent::cuda_vocab_parallel_finish_workspace_size(rows));
      case workspace_kind::linear_forward:
      case workspace_kind::linear_training: {
        const auto pass = static_cast<workspace_kind>(kind) == workspace_kind::linear_forward
                              ? xent::linear_pass::forward
                              : xent::linear_pass::training;
        xent::linear_options opts =
            xent_jax::linear_attrs{0, 1, 0.0f, 0.0f, 0.0f, order, accumulate, sparse_threshold}
                .options();
        if (pass == xent::linear_pass::forward) opts.sparse_threshold = 0.0f;  // as lin_fwd
        if (dtype == 0) return xent_jax::linear_bytes<float>(pass, rows, dim, vocab, opts);
        if (dtype == 1)
          return xent_jax::linear_bytes<Eigen::bfloat16>(pass, rows, dim, vocab, opts);
        if (dtype == 2) return xent_jax::linear_bytes<Eigen::half>(pass, rows, dim, vocab, opts);
        return -1;
      }
    }
  } catch (const std::exception&) {
  } catch (const xent_jax::bad_argument&) {
  }
  return -1;
}

// Every CUDA handler is capturable into XLA's command buffers (see the file comment).
#define XENT_JAX_CUDA_HANDLER(name, impl, binding) \
  XENT_JAX_HANDLER(name, impl, binding, {xla::ffi::Traits::kCmdBufferCompatible})

XENT_JAX_CUDA_HANDLER(xent_cross_entropy_fwd_cuda, xent_jax::fwd,
                      xent_jax::loss_binding<1>(xent_jax::stream_binding()));
XENT_JAX_CUDA_HANDLER(xent_cross_entropy_bwd_cuda, xent_jax::bwd,
                      xent_jax::backward_binding(xent_jax::stream_binding()));
XENT_JAX_CUDA_HANDLER(xent_cross_entropy_fwd_bwd_cuda, xent_jax::fwd_bwd,
                      xent_jax::fused_binding<1>(xent_jax::stream_binding()));
XENT_JAX_CUDA_HANDLER(xent_scale_grad_cuda, xent_jax::scale,
                      xent_jax::scale_binding(xent_jax::stream_binding()));
XENT_JAX_CUDA_HANDLER(xent_linear_cross_entropy_fwd_cuda, xent_jax::lin_fwd,
                      xent_jax::linear_loss_binding<1>(xent_jax::linear_context_binding()));
XENT_JAX_CUDA_HANDLER(xent_linear_cross_entropy_bwd_cuda, xent_jax::lin_bwd,
                      xent_jax::linear_backward_binding<1>(xent_jax::linear_context_binding()));
XENT_JAX_CUDA_HANDLER(xent_linear_cross_entropy_fwd_bwd_cuda, xent_jax::lin_fwd_bwd,
                      xent_jax::linear_fused_binding<1>(xent_jax::linear_context_binding()));
XENT_JAX_CUDA_HANDLER(xent_vocab_parallel_records_cuda, xent_jax::vp_rec,
                      xent_jax::vp_records_binding(xent_jax::stream_binding()));
XENT_JAX_CUDA_HANDLER(xent_vocab_parallel_merge_cuda, xent_jax::vp_mrg,
                      xent_jax::vp_merge_binding<1>(xent_jax::stream_binding()));
XENT_JAX_CUDA_HANDLER(xent_vocab_parallel_backward_cuda, xent_jax::vp_bwd,
                      xent_jax::vp_backward_binding(xent_jax::stream_binding()));
