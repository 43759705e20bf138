// vocab_parallel_traits<cuda>: vocab-parallel cross-entropy on the CUDA backend, each rank a GPU
// holding a device communicator (parallel/nccl_group.cuh, or any type whose all_gather enqueues on
// the stream that its stream() names). Included only by nvcc (xent.hpp). A call is the CPU one
// (cpu/vocab_parallel.hpp) with every step enqueued on exec.stream, nothing waiting for the host:
// dispatch/vocab_parallel.cuh has the steps.
//
// Workspace. exec.workspace holds at least cuda_vocab_parallel_workspace_size(rows, ranks) bytes
// of device memory, zero-filled once before its first use (as xent::cuda's workspace: its head is
// that workspace, which every call leaves zeroed again). Class-id backward needs none.
//
// Errors found on the device. The host cannot learn, without a synchronisation, what the ranks'
// headers say, so a bad tiling (the ranks' shards overlap, leave a gap, or the ranks declare
// different V or N) cannot throw: every rank sees the same gathered headers, and every rank then
// writes NaN for the loss, every row's loss and LSE (so every gradient row not ignored is NaN),
// argmax -1, num_correct 0, and adds 1 to *exec.error_count. A class id outside [0, V) that is not
// ignore_index makes its row NaN with a zero gradient and adds 1 to exec.error_count (once per row
// and call), as in the unsharded calls. Ranks whose calls pass different row counts move different
// byte counts through the collective, which NCCL does not detect: that is the caller's contract.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../backend.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../parallel/shard.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "cuda.cuh"
#include "dispatch/vocab_parallel.cuh"
#include "instances.cuh"

namespace xent {

/// Bytes of exec.workspace a CUDA vocab-parallel call over `rows` rows on `ranks` ranks needs
/// (zero-filled once before its first use; see cuda/vocab_parallel.cuh).
inline std::size_t cuda_vocab_parallel_workspace_size(std::int64_t rows, int ranks) {
  detail::check_exchange_rows("xent::cuda_vocab_parallel_workspace_size", "rows", rows,
                              ranks < 1 ? 1 : ranks);
  return cuda_detail::vp_layout(rows, ranks).total;
}

/// Bytes each rank sends through the collective per call: a 32-byte header and one record per row.
inline std::size_t cuda_vocab_parallel_exchange_bytes(std::int64_t rows) {
  detail::check_exchange_rows("xent::cuda_vocab_parallel_exchange_bytes", "rows", rows, 1);
  return cuda_detail::vp_layout(rows, 1).block;
}

template <>
struct vocab_parallel_traits<cuda> {
  template <class Group, class T, class Tgt>
  static void forward(const cuda& exec, const Group& group, matrix_view<const T> logits,
                      vocab_shard shard, const Tgt& targets, const options& opts,
                      const forward_outputs& out) {
    cuda_detail::vp_run("xent::vocab_parallel_forward", exec, group, logits, shard, targets, opts,
                        nullptr, out, matrix_view<float>{});
  }

  template <class Group, class T, class Tgt, class G>
  static void backward(const cuda& exec, const Group& group, matrix_view<const T> logits,
                       vocab_shard shard, const Tgt& targets, const options& opts,
                       vector_view<const float> lse, const upstream& up, matrix_view<G> grad) {
    cuda_detail::vp_backward(exec, group, logits, shard, targets, opts, lse, up, grad);
  }

  template <class Group, class T, class Tgt, class G>
  static void forward_backward(const cuda& exec, const Group& group, matrix_view<const T> logits,
                               vocab_shard shard, const Tgt& targets, const options& opts,
                               const upstream& up, const forward_outputs& out,
                               matrix_view<G> grad) {
    cuda_detail::vp_run("xent::vocab_parallel_forward_backward", exec, group, logits, shard,
                        targets, opts, &up, out, grad);
  }
};

}  // namespace xent
