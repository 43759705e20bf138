// The vocab-parallel ops' CUDA kernels (xent_vocab_parallel.h over xent::cuda), the exchange
// through the NCCL process group of the logits' device: torch's all-gather on its collective
// stream, ordered after the current stream's work and before what follows on it, with no host
// synchronisation (XENT_CHECK_RANKS=1 adds one, to check that the ranks agree).
#include <torch/library.h>

#include "xent_cuda_backend.h"
#include "xent_vocab_parallel.h"

namespace xent_torch {
namespace {

// torch_group with the stream the CUDA vocab-parallel calls check against their own: the current
// stream, on which torch orders its collective.
class torch_cuda_group : public torch_group {
 public:
  torch_cuda_group(const std::string& name, const at::Device& device, std::int64_t rows,
                   std::int64_t digest)
      : torch_group(name, device, rows, digest),
        stream_(c10::cuda::getCurrentCUDAStream(device.index()).stream()) {}
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;
};

struct cuda_vp_backend : cuda_backend {
  // The workspace of cuda_vocab_parallel_workspace_size: a head that calls leave zeroed (the
  // reduced loss) and scratch for the exchange, cached per stream apart from the single-device
  // calls' workspace, whose whole length must stay zero.
  static call vp_exec(const at::Tensor& x, std::int64_t rows, int ranks) {
    call c = exec(x, false);
    const std::size_t bytes = xent::cuda_vocab_parallel_workspace_size(rows, ranks);
    c.hold = cuda_vp_workspace(c10::cuda::getCurrentCUDAStream(x.get_device()), bytes);
    c.exec.workspace = c.hold.data_ptr();
    c.exec.workspace_bytes = bytes;
    return c;
  }
  static torch_cuda_group vp_group(const std::string& name, const at::Device& device,
                                   std::int64_t rows, std::int64_t digest) {
    return torch_cuda_group(name, device, rows, digest);
  }
};

}  // namespace
}  // namespace xent_torch

TORCH_LIBRARY_IMPL(xent, CUDA, m) {
  xent_torch::register_vocab_parallel<xent_torch::cuda_vp_backend>(m);
}
