// The dispatch of vocab-parallel cross-entropy on the CUDA backend (vocab_parallel_traits<cuda>).
//
// A call is the CPU one (cpu/vocab_parallel.hpp) with every step enqueued on exec.stream, nothing
// waiting for the host:
//   1. vp_begin_kernel writes this rank's header (and, for an empty shard, empty records) into the
//      send block;
//   2. the row kernel's forward pass over the shard (row_args::first / vocab / records) writes one
//      record per row into the send block instead of the row's outputs (parallel/records.hpp:
//      the fields of a slice_partial that the call's merge reads);
//   3. group.all_gather(send, recv, block bytes): every rank's block, in rank order;
//   4. vp_merge_kernel checks the tiling, merges each row's R records in rank order with
//      slice_partial::merge (the CPU's order, so every rank gets the same bits), and writes the
//      loss, LSE, argmax and the deterministic reduction, and each row's LSE and target mass for
//      step 5;
//   5. the row kernel's backward pass from that LSE writes this rank's gradient shard.
// Class-id backward runs step 5 alone (its row mass follows from the target's weight); soft-target
// backward runs 1-4 for the rows' mass (the sum over all shards of w_c t'_c).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../../detail/validate.hpp"
#include "../../loss_math.hpp"
#include "../../options.hpp"
#include "../../parallel/communicator.hpp"
#include "../../parallel/records.hpp"
#include "../../parallel/shard.hpp"
#include "../../targets.hpp"
#include "../../views.hpp"
#include "../cuda.cuh"
#include "../kernels/vocab_parallel_kernels.cuh"
#include "../runtime.cuh"
#include "rows.cuh"

namespace xent {
namespace cuda_detail {

using detail::shard_header;
static_assert(sizeof(shard_header) % 8 == 0, "records after the header stay word-aligned");

/// Where a vocab-parallel call keeps its bookkeeping in exec.workspace: xent::cuda's workspace
/// (the reduction's per-row losses and counter; left out by calls that reduce nothing, such as
/// the fused linear calls' chunks), the send block (header + N records of `record`), the receive
/// blocks (R of them, in rank order), and per row the merged LSE and target mass. ranks = 0: a
/// finish phase's, whose exchange is in the caller's buffers.
struct vp_layout {
  record_layout record;
  std::size_t block = 0;  ///< bytes of one rank's block: what all_gather moves per rank
  std::size_t send = 0, recv = 0, lse = 0, mass = 0, total = 0;
  vp_layout(std::int64_t rows, int ranks, record_layout record_, bool reduction = true)
      : record(record_) {
    const std::size_t n = static_cast<std::size_t>(rows < 0 ? 0 : rows);
    const auto blocks = static_cast<std::size_t>(ranks < 0 ? 0 : ranks);
    block = detail::exchange_block_bytes(rows, record);
    send = reduction ? align_up(cuda_workspace_size(rows), 256) : 0;
    recv = align_up(send + (blocks > 0 ? block : 0), 256);
    lse = align_up(recv + block * blocks, 256);
    mass = align_up(lse + sizeof(float) * n, 256);
    total = align_up(mass + sizeof(float) * n, 256);
  }
};

template <class G, class = void>
struct has_stream : std::false_type {};
template <class G>
struct has_stream<G, std::void_t<decltype(cudaStream_t{std::declval<const G&>().stream()})>>
    : std::true_type {};

/// The group enqueues on the call's stream, so the collective is ordered between the kernels.
template <class Group>
void check_device_group(const char* fn, const cuda& exec, const Group& group) {
  static_assert(has_stream<Group>::value,
                "xent: a CUDA vocab-parallel call needs a device communicator: one whose stream() "
                "names the CUDA stream its all_gather enqueues on (xent::nccl_group)");
  detail::require(group.stream() == exec.stream, fn, "group",
                  "its stream differs from exec.stream; the collective must be enqueued on the "
                  "stream of the call's kernels");
}

/// exec.workspace holds lay.total bytes (`query` names the size query that answers them).
inline void require_vp_workspace(
    const char* fn, const cuda& exec, const vp_layout& lay,
    const char* query = "cuda_vocab_parallel_workspace_size(rows, ranks)") {
  const std::size_t need = lay.total;
  detail::require(
      exec.workspace != nullptr && exec.workspace_bytes >= need, fn, "exec.workspace", [&] {
        return "needs " + std::to_string(need) + " bytes of zero-filled device memory (" + query +
               "), got " + std::to_string(exec.workspace ? exec.workspace_bytes : 0);
      });
}

/// The row kernel's arguments for this rank's shard (see row_args::first).
template <class T, class G, class Tgt>
row_args<device_t<T>, device_t<G>, Tgt> shard_args(const cuda& exec, matrix_view<const T> logits,
                                                   vocab_shard shard, Tgt targets,
                                                   const options& opts) {
  auto a = make_args<T, G>(exec, logits, targets, opts);
  a.first = shard.first;
  a.vocab = shard.vocab;
  a.weights = opts.class_weights.data ? opts.class_weights.data + shard.first : nullptr;
  a.k = make_loss_constants(opts, shard.vocab, static_cast<float>(shard.vocab));
  a.workspace = nullptr;    // nothing is reduced by the row kernel here
  a.error_count = nullptr;  // counted once, by the merge (or by the caller of this, backward)
  return a;
}

/// Step 5's arguments: the gradient shard `grad` of `logits` from each row's LSE (and, soft
/// targets, mass), as the row kernel's backward pass takes them (and the sparse backward's
/// gradient epilogue, linear_sparse.cuh).
template <class T, class Tgt, class G>
row_args<device_t<T>, device_t<G>, Tgt> gradient_args(const cuda& exec, matrix_view<const T> logits,
                                                      vocab_shard shard, Tgt targets,
                                                      const options& opts, const float* lse,
                                                      const float* mass, const upstream& up,
                                                      matrix_view<G> grad, int* error_count) {
  auto a = shard_args<T, G>(exec, logits, shard, targets, opts);
  a.lse_in = lse;
  a.mass_in = mass;
  a.grad = reinterpret_cast<device_t<G>*>(grad.data);
  a.grad_ld = grad.ld;
  a.scale = up.scale;
  a.scale_ptr = up.scale_ptr;
  a.up_rows = up.rows.data;
  a.error_count = error_count;
  return a;
}

/// Step 5: this rank's gradient shard from each row's LSE (and, soft targets, mass).
template <class T, class Tgt, class G>
void vp_gradient(const char* fn, const cuda& exec, matrix_view<const T> logits, vocab_shard shard,
                 Tgt targets, const options& opts, const float* lse, const float* mass,
                 const upstream& up, matrix_view<G> grad, int* error_count) {
  if (logits.rows == 0 || logits.cols == 0) return;
  const auto a =
      gradient_args(exec, logits, shard, targets, opts, lse, mass, up, grad, error_count);
  const bool aligned = aligned16(logits.data, logits.ld * std::int64_t{sizeof(T)}) &&
                       aligned16(grad.data, grad.ld * std::int64_t{sizeof(G)});
  dispatch_rows<pass::backward>(fn, exec, a, aligned);
}

/// Steps 1-2 into the send block `send`: this rank's header and, per row, its shard's record of
/// `record` (with the shard's argmax when the layout has it: an output asks for it).
template <class T, class Tgt>
void vp_send(const char* fn, const cuda& exec, unsigned char* send, record_layout record,
             matrix_view<const T> logits, vocab_shard shard, Tgt targets, const options& opts) {
  const std::int64_t rows = logits.rows;
  const record_sink sink{send, record};
  const bool empty = logits.cols == 0;
  const unsigned begin_grid =
      empty ? static_cast<unsigned>(rows / 256 + 1 < 1024 ? rows / 256 + 1 : 1024) : 1u;
  vp_begin_kernel<256><<<begin_grid, 256, 0, exec.stream>>>(
      shard_header{shard.first, logits.cols, shard.vocab, rows}, sink, empty);
  check_cuda(fn, cudaGetLastError());
  if (empty || rows == 0) return;
  // The row kernel's forward pass writes records (no outputs): the merge writes the outputs.
  auto stats = shard_args<T, float>(exec, logits, shard, targets, opts);
  stats.records = sink;
  stats.want_argmax = record.has(record_layout::argmax);
  dispatch_rows<pass::forward>(fn, exec, stats,
                               aligned16(logits.data, logits.ld * std::int64_t{sizeof(T)}));
}

/// Step 4 on the gathered blocks at `recv`: `out` (null: soft-target backward, only the rows'
/// mass is wanted) is written for every row, and each row's LSE and target mass at `lse` (null:
/// ws + lay.lse) and at `mass` (null: ws + lay.mass). A reduced loss or num_correct is summed in
/// exec.workspace.
template <class T, class Tgt>
void vp_merge(const char* fn, const cuda& exec, unsigned char* ws, const vp_layout& lay,
              const unsigned char* recv, int ranks, matrix_view<const T> logits, vocab_shard shard,
              Tgt targets, const options& opts, const forward_outputs* out, float* mass,
              float* lse = nullptr) {
  const std::int64_t rows = logits.rows;
  // The row kernel's arguments of the call, for the merge to write its outputs.
  auto a = shard_args<T, float>(exec, logits, shard, targets, opts);
  if (out) set_outputs(a, opts, *out);
  if (a.loss || a.num_correct) a.workspace = exec.workspace;
  a.error_count = exec.error_count;
  const vp_gathered x{recv,
                      lay.block,
                      ranks,
                      lay.record,
                      lse ? lse : reinterpret_cast<float*>(ws + lay.lse),
                      mass ? mass : reinterpret_cast<float*>(ws + lay.mass)};
  constexpr int block = 256;
  // At most 64 CTAs: each sums the mean's normaliser over every row's target (as the row
  // kernel's CTAs do), and one thread per row is plenty for a few floats per rank.
  const std::int64_t ctas = (rows + block - 1) / block;
  const unsigned grid = static_cast<unsigned>(ctas < 1 ? 1 : (ctas > 64 ? 64 : ctas));
  vp_merge_kernel<block><<<grid, block, 0, exec.stream>>>(a, x);
  check_cuda(fn, cudaGetLastError());
}

/// The finish phase (step 4, then step 5 when `grad` is given) on the gathered blocks at `recv`,
/// with exec.workspace laid out as `lay`: the outputs, each row's target mass at `mass` when given,
/// and this rank's gradient shard from the upstream `up`.
template <class T, class Tgt, class G>
void vp_finish(const char* fn, const cuda& exec, const vp_layout& lay, const unsigned char* recv,
               int ranks, matrix_view<const T> logits, vocab_shard shard, Tgt targets,
               const options& opts, const forward_outputs& out, float* mass, const upstream* up,
               matrix_view<G> grad) {
  unsigned char* ws = static_cast<unsigned char*>(exec.workspace);
  vp_merge(fn, exec, ws, lay, recv, ranks, logits, shard, targets, opts, &out, mass);
  if (!grad.data) return;
  const float* merged_mass = mass ? mass : reinterpret_cast<const float*>(ws + lay.mass);
  vp_gradient(fn, exec, logits, shard, targets, opts, reinterpret_cast<const float*>(ws + lay.lse),
              Tgt::soft ? merged_mass : nullptr, *up, grad, nullptr);
}

/// A group call's exchange in exec.workspace, laid out as `lay`: the records phase into the send
/// block, then the all-gather into the receive blocks.
template <class Group, class T, class Tgt>
void vp_exchange(const char* fn, const cuda& exec, const Group& group, const vp_layout& lay,
                 matrix_view<const T> logits, vocab_shard shard, Tgt targets, const options& opts) {
  unsigned char* ws = static_cast<unsigned char*>(exec.workspace);
  vp_send(fn, exec, ws + lay.send, lay.record, logits, shard, targets, opts);
  group.all_gather(ws + lay.send, ws + lay.recv, lay.block);
}

/// vocab-parallel forward, and forward_backward when `grad` is non-null: the two phases around
/// group.all_gather.
template <class Group, class T, class Tgt, class G>
void vp_run(const char* fn, const cuda& exec, const Group& group, matrix_view<const T> logits,
            vocab_shard shard, const Tgt& targets, const options& opts, const upstream* up,
            const forward_outputs& out, matrix_view<G> grad) {
  check_device_group(fn, exec, group);
  const auto dt = device_targets(targets);
  const vp_layout lay(logits.rows, group.size(),
                      record_layout::statistics(std::decay_t<decltype(dt)>::soft, opts,
                                                out.argmax.data || out.num_correct));
  require_vp_workspace(fn, exec, lay);
  vp_exchange(fn, exec, group, lay, logits, shard, dt, opts);
  vp_finish(fn, exec, lay, static_cast<unsigned char*>(exec.workspace) + lay.recv, group.size(),
            logits, shard, dt, opts, out, nullptr, up, grad);
}

template <class Group, class T, class Tgt, class G>
void vp_backward(const cuda& exec, const Group& group, matrix_view<const T> logits,
                 vocab_shard shard, const Tgt& targets, const options& opts,
                 vector_view<const float> lse, const upstream& up, matrix_view<G> grad) {
  constexpr const char* fn = "xent::vocab_parallel_backward";
  check_device_group(fn, exec, group);
  const auto dt = device_targets(targets);
  if constexpr (std::decay_t<decltype(dt)>::soft) {
    // sum_c w_c t'_c spans every shard: exchange each shard's part of it (4 bytes a row).
    const vp_layout lay(logits.rows, group.size(), record_layout::mass_only());
    require_vp_workspace(fn, exec, lay);
    vp_exchange(fn, exec, group, lay, logits, shard, dt, opts);
    unsigned char* ws = static_cast<unsigned char*>(exec.workspace);
    vp_merge(fn, exec, ws, lay, ws + lay.recv, group.size(), logits, shard, dt, opts, nullptr,
             nullptr);
    vp_gradient(
        fn, exec, logits, shard, dt, opts, lse.data,
        reinterpret_cast<const float*>(static_cast<unsigned char*>(exec.workspace) + lay.mass), up,
        grad, nullptr);
  } else {
    // No collective: each rank counts its own rows with out-of-range class ids.
    vp_gradient(fn, exec, logits, shard, dt, opts, lse.data, nullptr, up, grad, exec.error_count);
  }
}

}  // namespace cuda_detail
}  // namespace xent
