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
#include <type_traits>

#include "../backend.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../parallel/records.hpp"
#include "../parallel/shard.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "cuda.cuh"
#include "dispatch/vocab_parallel.cuh"
#include "instances.cuh"

namespace xent {

/// Bytes of exec.workspace a CUDA vocab-parallel call over `rows` rows on `ranks` ranks needs
/// (zero-filled once before its first use; see cuda/vocab_parallel.cuh), whatever its options and
/// outputs: room for the widest records (record_layout::largest, parallel/records.hpp).
inline std::size_t cuda_vocab_parallel_workspace_size(std::int64_t rows, int ranks) {
  detail::check_exchange_rows("xent::cuda_vocab_parallel_workspace_size", "rows", rows,
                              ranks < 1 ? 1 : ranks);
  return cuda_detail::vp_layout(rows, ranks, record_layout::largest()).total;
}

/// Bytes of exec.workspace a CUDA vocab_parallel_finish over `rows` rows needs (zero-filled once
/// before its first use): the reduction's and each row's merged LSE and target mass; the exchange
/// is in the caller's buffers.
inline std::size_t cuda_vocab_parallel_finish_workspace_size(std::int64_t rows) {
  detail::check_exchange_rows("xent::cuda_vocab_parallel_finish_workspace_size", "rows", rows, 1);
  return cuda_detail::vp_layout(rows, 0, record_layout{}).total;
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

  // The split phases (parallel/vocab_parallel_phases.hpp): send, recv and row_mass are device
  // memory; each phase is enqueued on exec.stream.
  template <class T, class Tgt>
  static void records(const cuda& exec, matrix_view<const T> logits, vocab_shard shard,
                      const Tgt& targets, const options& opts, record_layout layout,
                      unsigned char* send) {
    cuda_detail::vp_send("xent::vocab_parallel_records", exec, send, layout, logits, shard,
                         cuda_detail::device_targets(targets), opts);
  }

  template <class T, class Tgt, class G>
  static void finish(const cuda& exec, int ranks, matrix_view<const T> logits, vocab_shard shard,
                     const Tgt& targets, const options& opts, record_layout layout,
                     const unsigned char* recv, const forward_outputs& out, float* row_mass,
                     const upstream* up, matrix_view<G> grad) {
    constexpr const char* fn = "xent::vocab_parallel_finish";
    const cuda_detail::vp_layout lay(logits.rows, 0, layout);
    cuda_detail::require_vp_workspace(fn, exec, lay,
                                      "cuda_vocab_parallel_finish_workspace_size(rows)");
    cuda_detail::vp_finish(fn, exec, lay, recv, ranks, logits, shard,
                           cuda_detail::device_targets(targets), opts, out, row_mass, up, grad);
  }

  template <class T, class Tgt, class G>
  static void backward_from_mass(const cuda& exec, matrix_view<const T> logits, vocab_shard shard,
                                 const Tgt& targets, const options& opts,
                                 vector_view<const float> lse, const float* row_mass,
                                 const upstream& up, matrix_view<G> grad) {
    const auto dt = cuda_detail::device_targets(targets);
    constexpr bool soft = std::decay_t<decltype(dt)>::soft;
    // Class ids: no merge ran in this call, so the gradient pass counts out-of-range ids.
    cuda_detail::vp_gradient("xent::vocab_parallel_backward", exec, logits, shard, dt, opts,
                             lse.data, soft ? row_mass : nullptr, up, grad,
                             soft ? nullptr : exec.error_count);
  }
};

}  // namespace xent
