// The CUDA state every xent op shares, defined once: the reduced-loss workspaces and the error
// counters that cuda_backend (xent_cuda_backend.h) hands each call; and the two CUDA ops that run
// no xent kernel, scale_grad_ and cuda_target_errors. The op bodies of xent_ops.h are instantiated
// for CUDA in xent_cuda_*.cu. Built by CMakeLists.txt only when torch has CUDA and nvcc is found.
//
// The reduced-loss workspace (xent::cuda::workspace: zero-filled once, left zeroed by every call)
// follows one rule: ONE WORKSPACE PER (DEVICE, STREAM), cached for the life of the process and
// grown on demand (a new zero-filled tensor; the old one goes back to the caching allocator,
// stream-ordered, after the calls already queued on that stream). Calls on one stream are ordered,
// so they can share it; calls on two streams never do. Under stream capture the cache is not
// used: the call takes a fresh zero-filled workspace from the graph's pool, whose memset is a node
// of the graph, so every replay starts from zeros whatever ran eagerly in between. (A workspace
// first zero-filled inside a capture would hold garbage for eager calls, since nothing captured
// runs before a replay.)
//
// Out-of-range class ids (not ignore_index, outside [0, C)) cannot be checked on the host without
// a synchronisation: such a row gets a NaN loss and LSE and a zero gradient row, and is added to a
// per-device int32 counter (xent::cuda::error_count), which xent.torch.cuda_target_errors(device)
// returns without synchronising. The counter is created by the first call on a device outside a
// capture (or by cuda_target_errors); captured calls before that one do not count.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include "xent_cuda_backend.h"
#include "xent_ops.h"

namespace xent_torch {
namespace {

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// The per-(device, stream) workspaces and per-device error counters (see the top of the file).
class cuda_state {
 public:
  static cuda_state& get() {
    static cuda_state* s = new cuda_state;  // never destroyed: tensors outlive static teardown
    return *s;
  }

  // A zero-filled workspace of at least `bytes` for calls on `stream` (the current stream). The
  // vocab-parallel calls have a cache of their own: they leave only its head zeroed (the rest is
  // their exchange's scratch), where the single-device calls need every byte of theirs zero.
  at::Tensor workspace(const c10::cuda::CUDAStream& stream, std::size_t bytes,
                       bool vocab_parallel) {
    const auto n = static_cast<std::int64_t>(bytes);
    const auto opts = at::TensorOptions().dtype(at::kByte).device(stream.device());
    if (capturing(stream.stream())) return at::zeros({n}, opts);
    const std::lock_guard<std::mutex> lock(mutex_);
    at::Tensor& ws = (vocab_parallel ? vp_workspaces_ : workspaces_)[stream.unwrap()];
    if (!ws.defined() || ws.numel() < n) ws = at::zeros({n}, opts);  // on `stream`, in order
    return ws;
  }

  // The device's error counter, created (zero) outside a capture; nullptr under a capture that
  // finds none.
  int* error_count(const c10::cuda::CUDAStream& stream) {
    const std::lock_guard<std::mutex> lock(mutex_);
    at::Tensor& counter = counters_[stream.device_index()];
    if (!counter.defined()) {
      if (capturing(stream.stream())) return nullptr;
      counter = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(stream.device()));
    }
    return counter.data_ptr<int>();
  }

  at::Tensor counter(c10::DeviceIndex device) {
    const c10::cuda::CUDAGuard guard(device);
    TORCH_CHECK(error_count(c10::cuda::getCurrentCUDAStream(device)) != nullptr,
                "xent: cuda_target_errors creates the counter; call it before a graph capture");
    const std::lock_guard<std::mutex> lock(mutex_);
    return counters_.at(device);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<c10::Stream, at::Tensor> workspaces_, vp_workspaces_;
  std::unordered_map<c10::DeviceIndex, at::Tensor> counters_;
};

}  // namespace

at::Tensor cuda_workspace(const c10::cuda::CUDAStream& stream, std::size_t bytes) {
  return cuda_state::get().workspace(stream, bytes, false);
}

at::Tensor cuda_vp_workspace(const c10::cuda::CUDAStream& stream, std::size_t bytes) {
  return cuda_state::get().workspace(stream, bytes, true);
}

int* cuda_error_count(const c10::cuda::CUDAStream& stream) {
  return cuda_state::get().error_count(stream);
}

namespace {

// --- scale_grad_: the saved gradient of a fused forward times the loss's gradient ---------------
//
// The scale is read on the device, never on the host: nothing waits for the backward's upstream
// gradient, and a captured graph replays the launch for whatever value it holds. Every thread
// reads it first and returns when it is exactly 1 (loss.backward(): the gradient is already
// right), so the common case costs one launch and no pass over the gradient; x * 1 == x for every
// float, infinities and NaN included, so skipping the pass changes nothing. Otherwise each element
// is multiplied in float32 and rounded to grad's dtype (what torch's mul_ does).

template <class T>
__device__ __forceinline__ T scaled(T v, float scale) {
  return static_cast<T>(static_cast<float>(v) * scale);
}

// 16 bytes of T: the pass only streams memory, and one 128-bit load and store per 4 (float) or 8
// (16-bit) elements keeps as many bytes in flight with a quarter or an eighth of the instructions.
template <class T>
struct alignas(16) packet {
  static constexpr int size = 16 / sizeof(T);
  T e[size];
};

// A contiguous gradient of n elements: whole packets from the first 16-byte boundary (`head`
// elements in), then one element per thread for the head and the tail, all grid-stride.
template <class T>
__global__ void scale_contiguous(T* data, std::int64_t n, std::int64_t head, const float* scale) {
  const float s = *scale;
  if (s == 1.0f) return;
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t packets = (n - head) / packet<T>::size;
  auto* p = reinterpret_cast<packet<T>*>(data + head);
  for (std::int64_t i = first; i < packets; i += step) {
    packet<T> v = p[i];
#pragma unroll
    for (int k = 0; k < packet<T>::size; ++k) v.e[k] = scaled(v.e[k], s);
    p[i] = v;
  }
  const std::int64_t tail = head + packets * packet<T>::size;
  for (std::int64_t i = first; i < head + (n - tail); i += step) {
    T& e = data[i < head ? i : tail + (i - head)];
    e = scaled(e, s);
  }
}

// Any other 2-D layout (an in-place gradient is the caller's logits, whose rows may be padded):
// blocks stride over rows, a block's threads over a row's elements, one element each (no index
// division per element; this layout is rare enough not to need packets).
template <class T>
__global__ void scale_strided(T* data, std::int64_t rows, std::int64_t cols, std::int64_t stride0,
                              std::int64_t stride1, const float* scale) {
  const float s = *scale;
  if (s == 1.0f) return;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* row = data + r * stride0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      row[c * stride1] = scaled(row[c * stride1], s);
  }
}

template <class T>
void launch_scale(const at::Tensor& grad, const float* scale, cudaStream_t stream) {
  constexpr int threads = 256;
  const std::int64_t n = grad.numel();
  // Enough blocks to fill the GPU (the loops stride over the rest), no more: when the scale is 1
  // each block only reads it and returns.
  const std::int64_t fill = 4 * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  auto blocks_for = [&](std::int64_t work) {
    return static_cast<unsigned>(
        std::max<std::int64_t>(1, std::min(fill, (work + threads - 1) / threads)));
  };
  auto* data = reinterpret_cast<T*>(grad.data_ptr());
  if (grad.is_contiguous()) {
    const auto misalignment = reinterpret_cast<std::uintptr_t>(data) % 16;
    const std::int64_t head =
        std::min<std::int64_t>(n, misalignment == 0 ? 0 : (16 - misalignment) / sizeof(T));
    scale_contiguous<T>
        <<<blocks_for(n / packet<T>::size + 1), threads, 0, stream>>>(data, n, head, scale);
  } else {  // 2-D, or a 1-D vector taken as one row
    const bool matrix = grad.dim() == 2;
    const std::int64_t rows = matrix ? grad.size(0) : 1;
    scale_strided<T><<<static_cast<unsigned>(std::min(fill, rows)), threads, 0, stream>>>(
        data, rows, matrix ? grad.size(1) : n, matrix ? grad.stride(0) : 0, grad.stride(-1), scale);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scale_grad_cuda(const at::Tensor& grad, const at::Tensor& grad_output) {
  const at::Tensor scale = grad_scale_of(grad, grad_output);  // on the device: a cast, no sync
  TORCH_CHECK_VALUE(grad.is_cuda(), "xent: a CUDA kernel got a tensor on ", grad.device());
  if (grad.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(grad.get_device()).stream();
  const float* s = scale.data_ptr<float>();
  switch (grad.scalar_type()) {
    case at::kFloat:
      return launch_scale<float>(grad, s, stream);
    case at::kBFloat16:
      return launch_scale<c10::BFloat16>(grad, s, stream);
    default:
      return launch_scale<c10::Half>(grad, s, stream);  // grad_scale_of admits no other dtype
  }
}

at::Tensor cuda_target_errors(std::int64_t device) {
  TORCH_CHECK_VALUE(device >= 0 && device < c10::cuda::device_count(), "xent: no CUDA device ",
                    device);
  return cuda_state::get().counter(static_cast<c10::DeviceIndex>(device));
}

}  // namespace
}  // namespace xent_torch

TORCH_LIBRARY_FRAGMENT(xent, m) {
  // The device's counter of out-of-range class ids (int32, 0-d, on that device); see above.
  m.def("cuda_target_errors(int device) -> Tensor", &xent_torch::cuda_target_errors);
}

TORCH_LIBRARY_IMPL(xent, CUDA, m) { m.impl("scale_grad_", &xent_torch::scale_grad_cuda); }
