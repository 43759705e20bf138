// The CUDA backend of the op bodies in xent_ops.h, shared by the .cu files that instantiate them
// (xent_cuda_*.cu: one file per group of ops, so that their nvcc runs go in parallel).
//
// Every call runs on torch's current stream of the input's device and only enqueues work: no host
// synchronisation, no .item(), no allocation outside torch's caching allocator, so each op can be
// captured in a CUDA graph (torch.cuda.graph) and traced by torch.compile. The per-(device,
// stream) workspaces and per-device error counters that calls borrow live in one place,
// xent_ops_cuda.cu, which says how they are kept.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstddef>

#include <xent/xent.hpp>

namespace xent_torch {

// A zero-filled reduced-loss workspace of at least `bytes` for calls on `stream` (the current
// stream of its device); see xent_ops_cuda.cu.
at::Tensor cuda_workspace(const c10::cuda::CUDAStream& stream, std::size_t bytes);

// The same for vocab-parallel calls (xent::cuda_vocab_parallel_workspace_size), cached apart.
at::Tensor cuda_vp_workspace(const c10::cuda::CUDAStream& stream, std::size_t bytes);

// The device's counter of out-of-range class ids; nullptr under a capture that finds none.
int* cuda_error_count(const c10::cuda::CUDAStream& stream);

struct cuda_backend {
  using guard = c10::cuda::CUDAGuard;
  struct call {
    xent::cuda exec;
    at::Tensor hold;  // the workspace, alive until the call has been enqueued
  };
  // x is on the current device (the guard); `reduced`: the call writes a reduced loss.
  static call exec(const at::Tensor& x, bool reduced, bool blas = false) {
    TORCH_CHECK_VALUE(x.is_cuda(), "xent: a CUDA kernel got a tensor on ", x.device());
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(x.get_device());
    call c;
    c.exec.stream = stream.stream();
    // torch's handle for this thread and device, bound to the current stream: fused linear calls
    // only (getting it sets the handle's stream and workspace).
    if (blas) c.exec.cublas = at::cuda::getCurrentCUDABlasHandle();
    c.exec.error_count = cuda_error_count(stream);
    if (reduced) {
      const std::size_t bytes = xent::cuda_workspace_size(x.size(0));
      c.hold = cuda_workspace(stream, bytes);
      c.exec.workspace = c.hold.data_ptr();
      c.exec.workspace_bytes = bytes;
    }
    return c;
  }
};

}  // namespace xent_torch
