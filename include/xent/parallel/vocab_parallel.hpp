// Vocab-parallel cross-entropy: the vocabulary is split across ranks (tensor parallelism), each
// rank holds logits[:, first : first + V_local] of every row, and each call returns, on every
// rank, the loss of the unsharded computation and that rank's shard of its gradient.
//
// Every rank of the group makes the same call with its own shard; targets, options, upstream and
// the reduction are the same on every rank. One collective per call (group.all_gather,
// parallel/communicator.hpp) exchanges a few floats per row; each rank then merges the rows'
// statistics in rank order, so every rank gets bitwise-identical forward outputs. The semantics
// are exactly the unsharded calls' (loss.hpp), for every option:
//   - class ids are global, in [0, V) or ignore_index; ignored rows: loss 0, LSE 0, argmax -1,
//     gradient 0; the mean's W is the same global sum of w[y] over rows not ignored;
//   - label smoothing spreads eps over the full vocabulary: eps / V with the full V and the sum of
//     all V weights (not Megatron's eps / V_local per shard);
//   - class weights: every rank passes the full vector of V weights (opts.class_weights). The
//     smoothing term needs the sum of all of them and W needs w[y] for targets in other shards;
//     V floats per rank is small next to a shard of logits;
//   - soft targets: the rank's shard of the N x V probabilities (N x V_local);
//   - argmax is a global class id; num_correct counts against the global targets.
// A rank's shard may be empty (more ranks than classes). Nothing N x V is materialised.
//
// Errors. Each rank checks its own arguments before the collective (xent::error naming the
// argument). An error in arguments that are the same on every rank (targets, options, upstream,
// outputs) is therefore raised on every rank. After the exchange every rank checks that the
// ranks declared the same V and that the shards tile [0, V) (argument "shard"), so those errors,
// too, are raised on every rank before any output is written. A rank-local error (a bad view on
// one rank) leaves the other ranks in the collective: as with NCCL, the caller aborts the group
// (inprocess_group::run does).
#pragma once

#include <type_traits>

#include "../backend.hpp"
#include "../detail/disjoint.hpp"
#include "../detail/static_shape.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "communicator.hpp"
#include "shard.hpp"

namespace xent {
namespace detail {

/// The group is a communicator and this rank is one of its members.
template <class Group>
void check_group(const char* fn, const Group& group) {
  static_assert(is_communicator<Group>::value,
                "xent: group must provide rank(), size() and all_gather(send, recv, bytes) "
                "(parallel/communicator.hpp)");
  require(group.size() >= 1 && group.rank() >= 0 && group.rank() < group.size(), fn, "group", [&] {
    return "rank " + std::to_string(group.rank()) + " of size " + std::to_string(group.size());
  });
}

/// This rank's `cols` classes, [first, first + cols), lie in a vocabulary of shard.vocab >= 1
/// classes (or there are no rows).
inline void check_shard(const char* fn, vocab_shard shard, std::int64_t cols, std::int64_t rows) {
  // First: shard.vocab - cols below must not overflow (a negative vocabulary with no rows).
  require(shard.vocab >= 0, fn, "shard.vocab",
          [&] { return "must be >= 0, got " + std::to_string(shard.vocab); });
  require(shard.vocab >= 1 || rows == 0, fn, "shard.vocab", [&] {
    return "a row needs at least one class (vocab = " + std::to_string(shard.vocab) + ")";
  });
  require(shard.vocab <= max_elements, fn, "shard.vocab",
          [&] { return std::to_string(shard.vocab) + " classes: more than 2^59"; });
  require(shard.first >= 0 && shard.first <= shard.vocab - cols, fn, "shard.first", [&] {
    return "the shard's classes [" + std::to_string(shard.first) + ", " +
           std::to_string(shard.first + cols) + ") (first, first + columns) are not inside [0, " +
           std::to_string(shard.vocab) + ")";
  });
}

/// A rank's own arguments of a call over `ranks` ranks: the types, logits, shard, targets and
/// options (the group calls' and the split phases' alike).
template <class Exec, class L, class Targets>
void check_vp_arguments(const char* fn, int ranks, const matrix_view<L>& logits, vocab_shard shard,
                        const Targets& targets, const options& opts) {
  static_assert(has_vocab_parallel<Exec>::value,
                "xent: no vocab-parallel backend for this execution object");
  static_assert(has_backend<Exec>::value &&
                    backend_traits<Exec>::template supports_dtype<std::remove_const_t<L>>,
                "xent: unsupported logits dtype for this backend (float, bfloat16 and half are)");
  static_assert(!std::is_same<std::remove_const_t<L>, double>::value,
                "xent: vocab-parallel calls take float, bfloat16 and half logits; float64 is for "
                "the single-device CPU calls");
  static_assert(target_traits<Targets>::valid,
                "xent: targets must be vector_view<int32_t / int64_t> or soft_targets<dtype>");
  check_matrix(fn, "logits", logits);
  check_shard(fn, shard, logits.cols, logits.rows);
  check_exchange_rows(fn, "logits", logits.rows, ranks);
  check_targets(fn, dynamic_targets(targets), logits.rows, logits.cols);
  check_options(fn, opts, shard.vocab);  // class_weights: all V of them
}

template <class Exec, class Group, class L, class Targets>
void check_vocab_parallel(const char* fn, const Group& group, const matrix_view<L>& logits,
                          vocab_shard shard, const Targets& targets, const options& opts) {
  check_group(fn, group);
  check_vp_arguments<Exec>(fn, group.size(), logits, shard, targets, opts);
}

}  // namespace detail

/// Loss of every row and the reduced loss over a vocabulary-sharded logits matrix.
///
/// exec: the backend (xent::cpu); group: this rank's communicator (parallel/communicator.hpp);
/// logits: this rank's N x V_local shard, classes [shard.first, shard.first + V_local) of
/// shard.vocab; targets: N global class ids (int32 / int64), or soft_targets of this rank's
/// N x V_local probabilities. outputs as xent::forward, written on every rank with the same values.
/// Static extents (views.hpp) are checked as in xent::forward, except the class weights' (all V
/// of them, not the shard's columns).
template <class Exec, class Group, class L, class LE, class Tgt, class W = dynamic_extent,
          class OE = dynamic_extent>
void vocab_parallel_forward(const Exec& exec, const Group& group, matrix_view<L, LE> static_logits,
                            vocab_shard shard, const Tgt& static_targets,
                            const basic_options<W>& static_opts,
                            const basic_forward_outputs<float, OE>& static_out) {
  constexpr const char* fn = "xent::vocab_parallel_forward";
  detail::static_call<LE::rows, LE::cols, Tgt, W, OE, dynamic_extent, false>();

  using Targets = typename detail::target_traits<Tgt>::type;
  const matrix_view<L> logits(static_logits);
  const Targets targets = detail::dynamic_targets(static_targets);
  const options opts(static_opts);
  const forward_outputs outputs = detail::dynamic_outputs(static_out);
  detail::check_vocab_parallel<Exec>(fn, group, logits, shard, targets, opts);
  detail::check_outputs(fn, outputs, opts, logits.rows, detail::target_traits<Targets>::soft, true);
  detail::check_forward_memory(fn, exec, logits, targets, opts, outputs);
  using T = std::remove_const_t<L>;
  vocab_parallel_traits<Exec>::forward(exec, group, matrix_view<const T>(logits), shard,
                                       detail::dynamic_targets(targets), opts, outputs);
}

/// This rank's shard of the gradient (N x V_local) from the global per-row LSE that
/// vocab_parallel_forward saved (the same on every rank). With class ids it needs no collective;
/// with soft targets it exchanges one float per row (the shards' target mass). grad may be the
/// logits shard itself (in place).
template <class Exec, class Group, class L, class LE, class Tgt, class W = dynamic_extent,
          class LseT = const float, class LseE = dynamic_extent, class UE = dynamic_extent, class G,
          class GE>
void vocab_parallel_backward(const Exec& exec, const Group& group, matrix_view<L, LE> static_logits,
                             vocab_shard shard, const Tgt& static_targets,
                             const basic_options<W>& static_opts,
                             vector_view<LseT, LseE> static_lse,
                             const basic_upstream<float, UE>& static_up,
                             matrix_view<G, GE> static_grad) {
  constexpr const char* fn = "xent::vocab_parallel_backward";
  detail::static_call<LE::rows, LE::cols, Tgt, W, dynamic_extent, UE, false>();

  detail::static_lse<LE::rows, float, LseT, LseE>();
  detail::static_grad<LE, GE>();
  using Targets = typename detail::target_traits<Tgt>::type;
  const matrix_view<L> logits(static_logits);
  const Targets targets = detail::dynamic_targets(static_targets);
  const options opts(static_opts);
  const vector_view<const float> lse(static_lse);
  const upstream up = detail::dynamic_upstream(static_up);
  const matrix_view<G> grad(static_grad);
  static_assert(!std::is_const<G>::value, "xent::vocab_parallel_backward: grad must be writable");
  static_assert(backend_traits<Exec>::template supports_gradient<std::remove_const_t<L>, G>,
                "xent: unsupported gradient dtype for these logits on this backend (CUDA: a "
                "gradient at least as wide as the logits)");
  detail::check_vocab_parallel<Exec>(fn, group, logits, shard, targets, opts);
  detail::check_vector(fn, "lse", lse, logits.rows, false);
  detail::check_upstream(fn, up, opts, logits.rows);
  detail::check_gradient(fn, logits, grad);
  detail::check_gradient_memory(fn, exec, logits, targets, opts, lse, up, forward_outputs{}, grad);
  using T = std::remove_const_t<L>;
  vocab_parallel_traits<Exec>::backward(exec, group, matrix_view<const T>(logits), shard,
                                        detail::dynamic_targets(targets), opts, lse, up, grad);
}

/// Loss and this rank's gradient shard in one call (one collective): the vocab-parallel
/// xent::forward_backward. Every output is optional; grad may be the logits shard itself.
template <class Exec, class Group, class L, class LE, class Tgt, class W = dynamic_extent,
          class UE = dynamic_extent, class OE = dynamic_extent, class G, class GE>
void vocab_parallel_forward_backward(const Exec& exec, const Group& group,
                                     matrix_view<L, LE> static_logits, vocab_shard shard,
                                     const Tgt& static_targets, const basic_options<W>& static_opts,
                                     const basic_upstream<float, UE>& static_up,
                                     const basic_forward_outputs<float, OE>& static_out,
                                     matrix_view<G, GE> static_grad) {
  constexpr const char* fn = "xent::vocab_parallel_forward_backward";
  detail::static_call<LE::rows, LE::cols, Tgt, W, OE, UE, false>();

  detail::static_grad<LE, GE>();
  using Targets = typename detail::target_traits<Tgt>::type;
  const matrix_view<L> logits(static_logits);
  const Targets targets = detail::dynamic_targets(static_targets);
  const options opts(static_opts);
  const upstream up = detail::dynamic_upstream(static_up);
  const forward_outputs outputs = detail::dynamic_outputs(static_out);
  const matrix_view<G> grad(static_grad);
  static_assert(!std::is_const<G>::value,
                "xent::vocab_parallel_forward_backward: grad must be writable");
  static_assert(backend_traits<Exec>::template supports_gradient<std::remove_const_t<L>, G>,
                "xent: unsupported gradient dtype for these logits on this backend (CUDA: a "
                "gradient at least as wide as the logits)");
  detail::check_vocab_parallel<Exec>(fn, group, logits, shard, targets, opts);
  detail::check_outputs(fn, outputs, opts, logits.rows, detail::target_traits<Targets>::soft,
                        false);
  detail::check_upstream(fn, up, opts, logits.rows);
  detail::check_gradient(fn, logits, grad);
  detail::check_gradient_memory(fn, exec, logits, targets, opts, vector_view<const float>{}, up,
                                outputs, grad);
  using T = std::remove_const_t<L>;
  vocab_parallel_traits<Exec>::forward_backward(exec, group, matrix_view<const T>(logits), shard,
                                                detail::dynamic_targets(targets), opts, up, outputs,
                                                grad);
}

}  // namespace xent
