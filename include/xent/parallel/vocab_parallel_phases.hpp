// Vocab-parallel cross-entropy in two phases, for a caller whose collective lives outside xent
// (JAX's shard_map all-gathers between two FFI calls; any framework's own process group). The
// group calls (vocab_parallel.hpp) are exactly these phases around group.all_gather:
//
//   const std::size_t block = xent::vocab_parallel_exchange_bytes(exec, N, soft, opts, argmax);
//   xent::vocab_parallel_records(exec, logits_shard, shard, targets, opts, argmax,
//                                {send, block});                       // phase 1, every rank
//   // the caller all-gathers: recv = every rank's send block, rank 0 first (R x block bytes)
//   xent::vocab_parallel_finish(exec, R, logits_shard, shard, targets, opts, {recv, R * block},
//                               outputs, row_mass);                    // phase 2: forward
//   xent::vocab_parallel_finish(exec, R, logits_shard, shard, targets, opts, {recv, R * block},
//                               outputs, up, grad);                    // or forward_backward
//   xent::vocab_parallel_backward(exec, logits_shard, shard, targets, opts, lse, row_mass, up,
//                                 grad);                               // later, no collective
//
// Semantics, options and results are the group calls': every rank's finish writes the same loss,
// LSE and argmax, bit for bit, and its own gradient shard. `argmax` says whether the finish will
// be asked for outputs.argmax or outputs.num_correct (its records then carry each shard's argmax).
// Backward without a collective: class ids need only the saved LSE; soft targets also need each
// row's target mass, sum_c w_c t'_c over the whole vocabulary, which a forward finish writes into
// `row_mass` (N floats) for the caller to keep beside the LSE.
//
// The contract of the exchange. Every rank's send block has the same size (the same rows, kind of
// targets, label smoothing on or off and `argmax` on every rank: the size is
// vocab_parallel_exchange_bytes of those alone), and every rank's recv holds the R blocks in the
// same order (rank order), which is what makes the merged bits the same on every rank. Byte layout
// of a block (host byte order; parallel/records.hpp):
//   bytes [0, 32)   header: int64 first class, int64 classes in this shard, int64 vocabulary,
//                   int64 rows;
//   then rows records of record_layout::statistics(soft, opts, argmax).bytes() each, 32-bit words
//                   in this order, each present or not: LSE max, LSE sum (always) | target logit
//                   (class ids) | dot (soft targets; class ids with label smoothing) | mass (soft
//                   targets) | argmax value, class id low word, class id high word (argmax);
//   then zero to 7 bytes of padding to a multiple of 8.
// 12 bytes a row for class ids, 16 with label smoothing or soft targets, 12 more with argmax.
//
// Errors. Each phase checks its arguments as the group calls do (xent::error naming the
// argument; "send" / "recv" for a buffer of the wrong size). The finish phase checks the gathered
// headers, as the group calls check theirs: shards that do not tile [0, V), ranks that declare
// different V or rows throw on the CPU naming "recv" before anything is written; on CUDA, where
// the host does not read device memory, every rank writes NaN and counts an error in
// exec.error_count (cuda/vocab_parallel.cuh). On CUDA send, recv and row_mass are device memory,
// every phase is enqueued on exec.stream without a host synchronisation, and the finish phase
// needs cuda_vocab_parallel_finish_workspace_size(rows) bytes of exec.workspace.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../backend.hpp"
#include "../detail/disjoint.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "records.hpp"
#include "shard.hpp"
#include "vocab_parallel.hpp"

namespace xent {
namespace detail {

/// A caller's byte buffer holds exactly `bytes` bytes.
template <class B>
void check_bytes(const char* fn, const char* arg, const vector_view<B>& v, std::size_t bytes) {
  require(v.size >= 0 && static_cast<std::size_t>(v.size) == bytes, fn, arg, [&] {
    return "holds " + std::to_string(v.size) + " bytes, the exchange needs " +
           std::to_string(bytes) + " (vocab_parallel_exchange_bytes, times the ranks for recv)";
  });
  require(v.data != nullptr || bytes == 0, fn, arg, "null data with non-zero size");
}

template <class Targets>
record_layout vp_records_of(const options& opts, bool argmax) {
  return record_layout::statistics(target_traits<Targets>::soft, opts, argmax);
}

/// A finish phase's arguments, before its outputs: the rank's own, the ranks, and recv.
template <class Exec, class L, class Targets>
record_layout check_vp_finish(const char* fn, int ranks, const matrix_view<L>& logits,
                              vocab_shard shard, const Targets& targets, const options& opts,
                              const vector_view<const unsigned char>& recv,
                              const forward_outputs& outputs) {
  require(ranks >= 1, fn, "ranks", [&] { return "must be >= 1, got " + std::to_string(ranks); });
  check_vp_arguments<Exec>(fn, ranks, logits, shard, targets, opts);
  const record_layout layout =
      vp_records_of<Targets>(opts, outputs.argmax.data || outputs.num_correct);
  check_bytes(fn, "recv", recv,
              exchange_block_bytes(logits.rows, layout) * static_cast<std::size_t>(ranks));
  return layout;
}

/// A checked finish's memory (what it reads and writes must not overlap), then the backend's
/// finish: a forward's (up null, grad empty) or a forward_backward's.
template <class Exec, class L, class Targets, class G>
void finish_call(const char* fn, const Exec& exec, int ranks, const matrix_view<L>& logits,
                 vocab_shard shard, const Targets& targets, const options& opts,
                 const vector_view<const unsigned char>& recv, record_layout layout,
                 const forward_outputs& outputs, const vector_view<float>& row_mass,
                 const upstream* up, const matrix_view<G>& grad) {
  call_memory mem(fn);
  mem.reads_logits(logits, grad)
      .reads_targets(targets, opts)
      .reads("recv", recv)
      .reads_upstream(up ? *up : upstream{})
      .writes("grad", grad)
      .writes_outputs(outputs)
      .writes("row_mass", row_mass);
  exec_writes(mem, exec);
  mem.check();
  using T = std::remove_const_t<L>;
  vocab_parallel_traits<Exec>::finish(exec, ranks, matrix_view<const T>(logits), shard,
                                      typename target_traits<Targets>::type(targets), opts, layout,
                                      recv.data, outputs, row_mass.data, up, grad);
}

}  // namespace detail

/// Bytes of one rank's block (what each rank sends, and R of them what each receives) for a call
/// of `rows` rows: soft_targets (soft_targets rather than class ids), the options (label smoothing
/// on or off is what matters) and argmax (outputs.argmax or num_correct asked of the finish).
/// The same for every backend and every rank.
template <class Exec>
std::size_t vocab_parallel_exchange_bytes(const Exec&, std::int64_t rows, bool soft_targets,
                                          const options& opts, bool argmax) {
  static_assert(detail::has_vocab_parallel<Exec>::value,
                "xent: no vocab-parallel backend for this execution object");
  constexpr const char* fn = "xent::vocab_parallel_exchange_bytes";
  detail::require(rows >= 0, fn, "rows",
                  [&] { return "must be >= 0, got " + std::to_string(rows); });
  detail::check_exchange_rows(fn, "rows", rows, 1);
  return detail::exchange_block_bytes(rows, record_layout::statistics(soft_targets, opts, argmax));
}

/// Phase 1: this rank's block (its header and one record per row of its shard's statistics) into
/// `send`, vocab_parallel_exchange_bytes(exec, rows, soft, opts, argmax) bytes. Reads the logits
/// shard once; writes nothing else.
template <class Exec, class L, class Targets>
void vocab_parallel_records(const Exec& exec, matrix_view<L> logits, vocab_shard shard,
                            const Targets& targets, const options& opts, bool argmax,
                            vector_view<unsigned char> send) {
  constexpr const char* fn = "xent::vocab_parallel_records";
  detail::check_vp_arguments<Exec>(fn, 1, logits, shard, targets, opts);
  const record_layout layout = detail::vp_records_of<Targets>(opts, argmax);
  detail::check_bytes(fn, "send", send, detail::exchange_block_bytes(logits.rows, layout));
  detail::call_memory mem(fn);
  mem.reads("logits", logits).reads_targets(targets, opts).writes("send", send);
  mem.check();
  using T = std::remove_const_t<L>;
  vocab_parallel_traits<Exec>::records(exec, matrix_view<const T>(logits), shard,
                                       typename detail::target_traits<Targets>::type(targets), opts,
                                       layout, send.data);
}

/// Phase 2 of a forward: from every rank's block in `recv` (ranks x block bytes, rank order), the
/// outputs (as vocab_parallel_forward's, the same on every rank) and, when given, each row's
/// target mass into row_mass (N floats; 0 on ignored rows): what a later vocab_parallel_backward
/// of soft targets needs.
template <class Exec, class L, class Targets>
void vocab_parallel_finish(const Exec& exec, int ranks, matrix_view<L> logits, vocab_shard shard,
                           const Targets& targets, const options& opts,
                           vector_view<const unsigned char> recv, const forward_outputs& outputs,
                           vector_view<float> row_mass = {}) {
  constexpr const char* fn = "xent::vocab_parallel_finish";
  const record_layout layout =
      detail::check_vp_finish<Exec>(fn, ranks, logits, shard, targets, opts, recv, outputs);
  detail::check_outputs(fn, outputs, opts, logits.rows, detail::target_traits<Targets>::soft, true);
  detail::check_vector(fn, "row_mass", row_mass, logits.rows, true);
  detail::finish_call<Exec>(fn, exec, ranks, logits, shard, targets, opts, recv, layout, outputs,
                            row_mass, nullptr, matrix_view<float>{});
}

/// Phase 2 of a forward_backward: the outputs (each optional) and this rank's gradient shard from
/// the upstream gradient `up`; grad may be the logits shard itself. row_mass as above.
template <class Exec, class L, class Targets, class G>
void vocab_parallel_finish(const Exec& exec, int ranks, matrix_view<L> logits, vocab_shard shard,
                           const Targets& targets, const options& opts,
                           vector_view<const unsigned char> recv, const forward_outputs& outputs,
                           const upstream& up, matrix_view<G> grad,
                           vector_view<float> row_mass = {}) {
  constexpr const char* fn = "xent::vocab_parallel_finish";
  static_assert(!std::is_const<G>::value, "xent::vocab_parallel_finish: grad must be writable");
  static_assert(backend_traits<Exec>::template supports_gradient<std::remove_const_t<L>, G>,
                "xent: unsupported gradient dtype for these logits on this backend (CUDA: a "
                "gradient at least as wide as the logits)");
  const record_layout layout =
      detail::check_vp_finish<Exec>(fn, ranks, logits, shard, targets, opts, recv, outputs);
  detail::check_outputs(fn, outputs, opts, logits.rows, detail::target_traits<Targets>::soft,
                        false);
  detail::check_upstream(fn, up, opts, logits.rows);
  detail::check_gradient(fn, logits, grad);
  detail::check_vector(fn, "row_mass", row_mass, logits.rows, true);
  detail::finish_call<Exec>(fn, exec, ranks, logits, shard, targets, opts, recv, layout, outputs,
                            row_mass, &up, grad);
}

/// This rank's gradient shard from the per-row LSE a finish (or vocab_parallel_forward) wrote,
/// with no collective: soft targets also take each row's target mass (row_mass, N floats, from
/// a forward finish); class ids need none (row_mass may be empty). grad may be the logits shard.
template <class Exec, class L, class Targets, class G>
void vocab_parallel_backward(const Exec& exec, matrix_view<L> logits, vocab_shard shard,
                             const Targets& targets, const options& opts,
                             vector_view<const float> lse, vector_view<const float> row_mass,
                             const upstream& up, matrix_view<G> grad) {
  constexpr const char* fn = "xent::vocab_parallel_backward";
  static_assert(!std::is_const<G>::value, "xent::vocab_parallel_backward: grad must be writable");
  static_assert(backend_traits<Exec>::template supports_gradient<std::remove_const_t<L>, G>,
                "xent: unsupported gradient dtype for these logits on this backend (CUDA: a "
                "gradient at least as wide as the logits)");
  detail::check_vp_arguments<Exec>(fn, 1, logits, shard, targets, opts);
  detail::check_vector(fn, "lse", lse, logits.rows, false);
  detail::check_vector(fn, "row_mass", row_mass, logits.rows,
                       !detail::target_traits<Targets>::soft);
  detail::check_upstream(fn, up, opts, logits.rows);
  detail::check_gradient(fn, logits, grad);
  detail::call_memory mem(fn);
  mem.reads_logits(logits, grad)
      .reads_targets(targets, opts)
      .reads("lse", lse)
      .reads("row_mass", row_mass)
      .reads_upstream(up)
      .writes("grad", grad);
  detail::exec_writes(mem, exec);
  mem.check();
  using T = std::remove_const_t<L>;
  vocab_parallel_traits<Exec>::backward_from_mass(
      exec, matrix_view<const T>(logits), shard,
      typename detail::target_traits<Targets>::type(targets), opts, lse, row_mass.data, up, grad);
}

}  // namespace xent
