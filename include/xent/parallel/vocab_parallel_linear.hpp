// Vocab-parallel fused linear cross-entropy: the LM head's weight is split by vocabulary across
// ranks (tensor parallelism). Each rank holds weight[first : first + V_local, :] (V_local x D),
// optionally bias[first : first + V_local], the whole hidden (N x D) and the global targets; each
// call returns, on every rank, the loss of the unsharded linear call (linear.hpp) and that rank's
// share of the gradients, without materialising any N x V_local logits.
//
//   auto ws = xent::vocab_parallel_linear_workspace_size<bf16>(exec, {N, D, V_local}, V, ranks,
//                                                             xent::linear_pass::training);
//   xent::vocab_parallel_linear_forward_backward(
//       exec, group, hidden, weight_shard, bias_shard, {first, V}, targets, opts, up, outputs,
//       {d_hidden_partial, d_weight_shard, d_bias_shard}, {{buffer, ws.bytes}, ws.chunk_rows});
//   // then all-reduce (sum) d_hidden_partial over the group: see "d_hidden" below.
//
// Semantics: exactly the unsharded linear calls', for every option, with vocab_parallel.hpp's
// rules for the shards: class ids are global, label smoothing spreads eps over the full V, class
// weights are the full vector of V on every rank, soft targets are the rank's N x V_local shard of
// the probabilities, argmax is a global class id. Forward outputs (loss, per-row loss, LSE,
// argmax, num_correct) are bitwise identical on every rank.
//
// How (parallel/linear_chunks.hpp): rows are taken workspace.chunk_rows at a time; per chunk a
// rank computes its shard's logits (GEMM), their per-row statistics, and makes one all-gather of
// those records (a 32-byte header and, per row, the fields the call merges from each rank:
// 12 bytes with class ids, parallel/records.hpp); every rank merges the R
// records of a row in rank order, then writes the logit gradient over the chunk's logits in place
// and folds it into its gradients. Backward from a saved LSE needs no collective with class ids;
// with soft targets it exchanges the rows' target mass per chunk.
//
// d_hidden. hidden's gradient is a sum over the whole vocabulary, G · W = sum over ranks of
// G_shard · W_shard, so no rank can have it alone: grads.d_hidden receives THIS RANK'S PARTIAL,
// G_shard · W_shard (N x D), and the caller sums the partials over the group: an all-reduce,
// as Megatron's column-parallel LM head does in its backward (or a reduce-scatter under sequence
// parallelism). xent does not do it: the communicator concept stays one all-gather of bytes (an
// all-reduce of floats would be a second collective every communicator must offer), and the
// caller usually overlaps that reduction with the rest of its backward or fuses it with others.
// A bf16 / fp16 partial is rounded once per rank before the sum; ask for float gradients (G =
// float) to round the sum once instead. d_weight and d_bias are this rank's rows, complete.
//
// Training orders (linear_order, as linear.hpp's calls). fast: the chunks above. low_memory: the
// same chunks and exchanges without their gradient steps, keeping every row's merged LSE and
// target mass, then this rank's shard in panels of weight rows as the outer loop, with no
// collective (the single-device order's panels over the shard: d_weight[panel] summed over every
// row in float and written once, the partial d_hidden in an N x D float sum); no V_local x D
// float accumulator, one GEMM more in forward_backward (and in soft-target backward). Both orders
// make the same collectives, chunk for chunk. linear_order::automatic decides on each rank from
// its workspace: the fast order when workspace.bytes holds the fast order's bytes for
// workspace.chunk_rows (linear_workspace_sizes::fast_minimal at one-row chunks), else the
// low-memory order when its bytes for them are fewer, else the error naming those; ranks that
// decide differently still exchange the same blocks. Forward calls have one order.
//
// Row chunks. Every chunk's all-gather must hold the same rows from every rank, so
// workspace.chunk_rows must be the same on every rank (a rank cannot plan its chunks from its own
// bytes: ranks with different shards would plan different chunks, and the host of a CUDA rank
// cannot learn the others' plans without waiting for the device).
// vocab_parallel_linear_workspace_size answers the same chunk_rows on every rank given the same
// rows, hidden, vocab, ranks, pass, options and budget (it plans the chunk for a shard of
// ceil(V / R) classes, the largest of Megatron's split), and this rank's bytes for it.
//
// Errors. As vocab_parallel.hpp: each rank checks its own arguments first (xent::error naming
// the argument; the workspace's size against this rank's shard); errors in arguments that are the
// same on every rank are raised on every rank. On the CPU the first chunk's exchange also checks,
// on every rank and before any output is written, that the shards tile [0, V) ("shard",
// "shard.vocab") and that the ranks have the same rows ("hidden"); ranks whose chunks differ in
// rows (chunk_rows, or rows, that differ) move different byte counts, which inprocess_group
// refuses ("bytes") on every rank. On CUDA a bad tiling
// gives NaN outputs and a count in exec.error_count on every rank (cuda/vocab_parallel.cuh), and
// equal rows and chunk_rows on every rank are the caller's contract, as NCCL cannot check them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../backend.hpp"
#include "../detail/static_shape.hpp"
#include "../detail/validate.hpp"
#include "../linear.hpp"
#include "../linear/options.hpp"
#include "../linear/plan.hpp"
#include "../linear/validate.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "linear_chunks.hpp"
#include "shard.hpp"
#include "vocab_parallel.hpp"

namespace xent {
namespace detail {

/// Whether a backend's low-memory order names the fewest chunk rows at which its panels take
/// every row (CUDA's: `low_memory_every_row(shape)`).
template <class Traits, class = void>
struct has_every_row_panels : std::false_type {};
template <class Traits>
struct has_every_row_panels<
    Traits, std::void_t<decltype(Traits::low_memory_every_row(std::declval<linear_shape>()))>>
    : std::true_type {};

/// The sizes of a rank's workspace: rows per chunk planned for a shard of ceil(V / R) classes
/// (the same on every rank), the bytes for this rank's `shape` at that chunk and at one row.
template <class T, class G, class Exec>
linear_workspace_sizes vp_linear_sizes(const char* fn, const Exec& exec, const linear_shape& shape,
                                       std::int64_t vocab, int ranks, linear_pass pass,
                                       dw_accumulation accumulate, linear_order order,
                                       std::size_t budget) {
  auto bytes_at = [&](const linear_shape& s, std::int64_t rows) {
    return vocab_parallel_linear_traits<Exec>::template workspace_bytes<T, G>(
        exec, s, ranks, pass, accumulate, order, rows);
  };
  const linear_shape reference{shape.rows, shape.hidden, (vocab + ranks - 1) / ranks};
  // The reference shard may be wider than this rank's (an empty one, say): its sizes too must fit.
  require(within_max_elements(reference.rows, reference.vocab) &&
              within_max_elements(reference.vocab, reference.hidden),
          fn, "vocab", [&] {
            return "a shard of ceil(" + std::to_string(vocab) + " / " + std::to_string(ranks) +
                   ") classes by " + std::to_string(shape.rows) + " rows or " +
                   std::to_string(shape.hidden) + " hidden units spans more than 2^59 elements";
          });
  struct sized {
    std::int64_t rows;
    std::size_t bytes;
  };
  auto sizes = [&](std::int64_t chunk) -> linear_workspace_sizes {
    chunk = std::min(chunk, shape.rows);
    return {bytes_at(shape, 1), bytes_at(shape, planned_chunk_rows(chunk, shape.rows)), chunk};
  };
  // Chunks of `limit` rows or fewer: the rank's every row, or where the backend's low-memory
  // panels take every row from low_memory_every_row(reference) chunk rows on, those first, within
  // the whole budget (the order's bound on its memory beyond the gradients,
  // linear_panels.cuh's query_low_memory); where they do not fit, the narrowest such plan or a
  // split below it.
  std::int64_t limit = shape.rows;
  using traits = vocab_parallel_linear_traits<Exec>;
  if constexpr (has_every_row_panels<traits>::value) {
    if (pass == linear_pass::training && order == linear_order::low_memory && shape.rows > 0) {
      limit = std::min(shape.rows, traits::low_memory_every_row(reference));
      const std::int64_t more = shape.rows - limit;
      if (bytes_at(reference, limit) <= budget)
        return sizes(largest_chunk_plan(more + 1, budget, [&](std::int64_t i) {
                       return sized{limit + i - 1, bytes_at(reference, limit + i - 1)};
                     }).rows);
    }
  }
  const std::size_t room = chunk_budget(bytes_at(reference, 0), budget);
  // One chunk of `limit` rows can need fewer bytes than slightly smaller chunks (CUDA's
  // low-memory panels then keep no float panel of d_weight), so it is tried before the search.
  const sized whole{limit, bytes_at(reference, limit)};
  const sized plan = shape.rows > 0 && whole.bytes <= room
                         ? whole
                         : largest_chunk_plan(limit, room, [&](std::int64_t rows) {
                             return sized{rows, bytes_at(reference, rows)};
                           });
  return sizes(plan.rows);
}

/// The bytes this rank's call needs with the workspace's chunk_rows, in the order of `opts`
/// (resolved: fast or low_memory; forward calls have one order).
template <class T, class G, class Exec>
std::size_t vp_linear_need(const Exec& exec, int ranks, const matrix_view<const T>& hidden,
                           const matrix_view<const T>& weight, linear_pass pass,
                           const linear_options& opts, const vocab_parallel_linear_workspace& ws) {
  return vocab_parallel_linear_traits<Exec>::template workspace_bytes<T, G>(
      exec, {hidden.rows, hidden.cols, weight.rows}, ranks, pass, opts.accumulate, opts.order,
      planned_chunk_rows(ws.chunk_rows, hidden.rows));
}

/// `opts` with linear_order::automatic resolved for a training workspace: the fast order when
/// its bytes hold the fast order's need at ws.chunk_rows (or the low-memory order needs no less),
/// else the low-memory order. Each rank decides from its own bytes; the orders make the same
/// collectives, chunk for chunk, so ranks that decide differently still agree on the exchanges.
template <class T, class G, class Exec>
linear_options vp_resolved_order(const Exec& exec, int ranks, const matrix_view<const T>& hidden,
                                 const matrix_view<const T>& weight, linear_options opts,
                                 const vocab_parallel_linear_workspace& ws) {
  if (opts.order != linear_order::automatic) return opts;
  auto need = [&](linear_order order) {
    opts.order = order;
    return vp_linear_need<T, G>(exec, ranks, hidden, weight, linear_pass::training, opts, ws);
  };
  const std::size_t fast = need(linear_order::fast);
  opts.order = ws.bytes >= fast || need(linear_order::low_memory) >= fast
                   ? linear_order::fast
                   : linear_order::low_memory;
  return opts;
}

constexpr const char* vp_linear_query = "xent::vocab_parallel_linear_workspace_size";

template <class Exec, class Group, class T, class Targets>
void check_vp_linear_call(const char* fn, const Group& group, const matrix_view<const T>& hidden,
                          const matrix_view<const T>& weight, const vector_view<const T>& bias,
                          vocab_shard shard, const Targets& targets, const linear_options& opts,
                          const vocab_parallel_linear_workspace& ws) {
  require_linear_types<Exec, has_vocab_parallel_linear<Exec>::value, T, Targets>();
  static_assert(!std::is_same<T, double>::value,
                "xent: vocab-parallel fused linear calls take float, bfloat16 and half; float64 is "
                "for the single-device CPU calls");
  check_group(fn, group);
  // Soft targets are the shard's (N x V_local); class weights all V of them.
  check_linear_inputs(fn, hidden, weight, bias, dynamic_targets(targets), opts, shard.vocab,
                      "shard.vocab");
  check_shard(fn, shard, weight.rows, hidden.rows);
  require_dense_backward(fn, opts, "the vocab-parallel calls");
  check_exchange_rows(fn, "hidden", hidden.rows, group.size());
  require(
      ws.chunk_rows >= 1 || (hidden.rows == 0 && ws.chunk_rows == 0), fn, "workspace.chunk_rows",
      [&] {
        return "must be >= 1 and the same on every rank (vocab_parallel_linear_workspace_size's "
               "chunk_rows), got " +
               std::to_string(ws.chunk_rows);
      });
}

template <class T, class G, class Targets>
vp_linear_args<T, G, typename target_traits<Targets>::type> vp_args(
    const matrix_view<const T>& hidden, const matrix_view<const T>& weight,
    const vector_view<const T>& bias, vocab_shard shard, const Targets& targets,
    const linear_options& opts, const vocab_parallel_linear_workspace& ws, int ranks) {
  vp_linear_args<T, G, typename target_traits<Targets>::type> a;
  a.hidden = hidden;
  a.weight = weight;
  a.bias = bias;
  a.shard = shard;
  a.targets = dynamic_targets(targets);
  a.opts = opts;
  a.ws = ws;
  a.ranks = ranks;
  return a;
}

/// A training call's checks (the call's, then the entry's own `outputs_check` of its outputs or
/// saved LSE, then its upstream, gradients and workspace; `mem` holds its targets and those
/// outputs or that LSE) and its arguments with the upstream and the gradients set.
template <class Exec, class Group, class T, class Targets, class G, class OutputsCheck>
vp_linear_args<T, G, typename target_traits<Targets>::type> vp_training_args(
    const char* fn, const Exec& exec, const Group& group, const matrix_view<const T>& x,
    const matrix_view<const T>& weight, const vector_view<const T>& bias, vocab_shard shard,
    const Targets& targets, const linear_options& opts, const upstream& up,
    const linear_grads<G>& grads, const vocab_parallel_linear_workspace& workspace,
    OutputsCheck&& outputs_check, call_memory mem) {
  check_vp_linear_call<Exec>(fn, group, x, weight, bias, shard, targets, opts, workspace);
  outputs_check();
  const linear_options planned =
      vp_resolved_order<T, G>(exec, group.size(), x, weight, opts, workspace);
  check_linear_training<Exec>(fn, x, weight, bias, opts, up, grads, workspace,
                              vp_linear_need<T, G>(exec, group.size(), x, weight,
                                                   linear_pass::training, planned, workspace),
                              vp_linear_query, mem);
  auto a = vp_args<T, G>(x, weight, bias, shard, targets, planned, workspace, group.size());
  a.up = &up;
  a.grads = grads;
  return a;
}

}  // namespace detail

/// Workspace sizes for one rank of a vocab-parallel linear call: `shape` is this rank's call
/// (rows N, hidden D, vocab = V_local, its weight shard's rows), `vocab` the whole vocabulary V
/// and `ranks` the group's size. chunk_rows is planned for a rank of ceil(V / R) classes within
/// `budget` bytes of chunk room on top of the fixed buffers (as linear_workspace_size): the same
/// on every rank given the same arguments other than shape.vocab. bytes: what this rank needs for
/// chunks of chunk_rows (its own shard's buffers, more than the budget when its shard is larger
/// than ceil(V / R)); minimal: what it needs for one-row chunks. On top of a single-device call's
/// buffers (linear.hpp) a rank holds its chunk's exchange: per chunk row (R + 1) records sent and
/// received, room for the widest (32 bytes, record_layout::largest: the options and outputs are
/// not known here), and up to 48 more bytes (the merged LSE and target mass; on the CPU this
/// shard's slice_partial too), and (R + 1) 32-byte headers. The order of `opts` picks the sizes
/// as linear_workspace_size's does (linear_workspace_sizes): training with low_memory answers that
/// order's, whose chunk_rows are its exchange chunks' (the statistics pass; a panel's sub-chunks
/// follow from them, detail::panel_chunk_rows) and whose fixed buffers are the N x D float sum, a
/// panel's d_weight sum and each row's LSE and mass; automatic answers the fast order's with the
/// smaller minimal of the two. fast_minimal: the fast order's minimal.
template <class T, class G = T, class Exec>
linear_workspace_sizes vocab_parallel_linear_workspace_size(
    const Exec& exec, const linear_shape& shape, std::int64_t vocab, int ranks, linear_pass pass,
    const linear_options& opts = {}, std::size_t budget = linear_default_budget) {
  static_assert(detail::has_vocab_parallel_linear<Exec>::value,
                "xent: no vocab-parallel fused linear backend for this execution object");
  constexpr const char* fn = "xent::vocab_parallel_linear_workspace_size";
  detail::check_linear_shape(fn, "shape", shape);
  detail::check_accumulation(fn, opts);
  detail::check_order(fn, opts);
  detail::require_dense_backward(fn, opts, "the vocab-parallel calls");
  detail::check_pass(fn, pass);
  detail::require(ranks >= 1, fn, "ranks",
                  [&] { return "must be >= 1, got " + std::to_string(ranks); });
  detail::require(vocab <= detail::max_elements, fn, "vocab",
                  [&] { return std::to_string(vocab) + " classes: more than 2^59"; });
  detail::require(vocab >= shape.vocab, fn, "vocab", [&] {
    return "the whole vocabulary (" + std::to_string(vocab) +
           ") is smaller than this rank's shard (shape.vocab = " + std::to_string(shape.vocab) +
           ")";
  });
  detail::check_exchange_rows(fn, "shape", shape.rows, ranks);
  return detail::sizes_of_order(pass, opts.order, [&](linear_order order) {
    return detail::vp_linear_sizes<T, G>(fn, exec, shape, vocab, ranks, pass, opts.accumulate,
                                         order, budget);
  });
}

/// Evaluation: the loss of every row and the reduced loss on every rank. hidden: N x D (the
/// same on every rank); weight: this rank's V_local x D rows, classes [shard.first, shard.first +
/// V_local) of shard.vocab; bias: those V_local entries or empty; targets: N global class ids
/// (int32 / int64) or soft_targets of this rank's N x V_local probabilities. outputs as
/// linear_forward's. workspace: vocab_parallel_linear_workspace_size(..., linear_pass::forward).
template <class Exec, class Group, class H, class HE, class WT = const std::remove_const_t<H>,
          class WE = dynamic_extents, class BT = const std::remove_const_t<H>,
          class BE = dynamic_extent, class Tgt, class W = dynamic_extent, class OE = dynamic_extent>
void vocab_parallel_linear_forward(const Exec& exec, const Group& group, matrix_view<H, HE> hidden,
                                   matrix_view<WT, WE> static_weight,
                                   vector_view<BT, BE> static_bias, vocab_shard shard,
                                   const Tgt& static_targets,
                                   const basic_linear_options<W>& static_opts,
                                   const basic_forward_outputs<float, OE>& static_out,
                                   const vocab_parallel_linear_workspace& workspace) {
  constexpr const char* fn = "xent::vocab_parallel_linear_forward";
  using T = std::remove_const_t<H>;
  detail::static_call<HE::rows, WE::rows, Tgt, W, OE, dynamic_extent, false>();

  const auto in = detail::dynamic_linear_inputs(hidden, static_weight, static_bias, static_targets,
                                                static_opts);
  using Targets = decltype(in.targets);
  const auto& [x, weight, bias, targets, opts] = in;
  const forward_outputs outputs = detail::dynamic_outputs(static_out);
  detail::check_vp_linear_call<Exec>(fn, group, x, weight, bias, shard, targets, opts, workspace);
  detail::check_outputs(fn, outputs, opts, x.rows, detail::target_traits<Targets>::soft, true);
  detail::check_forward_workspace(
      fn, x, weight, bias, workspace,
      detail::vp_linear_need<T, T>(exec, group.size(), x, weight, linear_pass::forward, opts,
                                   workspace),
      detail::vp_linear_query, detail::linear_memory(fn, targets, opts).writes_outputs(outputs));
  auto a = detail::vp_args<T, T>(x, weight, bias, shard, targets, opts, workspace, group.size());
  a.out = outputs;
  detail::run_vp_linear<detail::vp_linear_mode::forward>(fn, exec, group, a);
}

/// Training in one call: the forward outputs (each optional) and this rank's gradients, each
/// optional: d_weight (V_local x D) and d_bias (V_local) of its shard, and its PARTIAL d_hidden
/// (N x D), G_shard · W_shard, which the caller sums over the group (see the top of this file).
/// The upstream gradient is the same on every rank: a scalar for mean / sum, per row for none,
/// applied to each row before any sum over rows.
template <class Exec, class Group, class H, class HE, class WT = const std::remove_const_t<H>,
          class WE = dynamic_extents, class BT = const std::remove_const_t<H>,
          class BE = dynamic_extent, class Tgt, class W = dynamic_extent, class UE = dynamic_extent,
          class OE = dynamic_extent, class G, class GHE, class GWE>
void vocab_parallel_linear_forward_backward(
    const Exec& exec, const Group& group, matrix_view<H, HE> hidden,
    matrix_view<WT, WE> static_weight, vector_view<BT, BE> static_bias, vocab_shard shard,
    const Tgt& static_targets, const basic_linear_options<W>& static_opts,
    const basic_upstream<float, UE>& static_up, const basic_forward_outputs<float, OE>& static_out,
    const linear_grads<G, GHE, GWE>& static_grads,
    const vocab_parallel_linear_workspace& workspace) {
  constexpr const char* fn = "xent::vocab_parallel_linear_forward_backward";
  detail::static_call<HE::rows, WE::rows, Tgt, W, OE, UE, false>();

  detail::static_linear_grads<HE, WE, GHE, GWE>();
  const auto in = detail::dynamic_linear_inputs(hidden, static_weight, static_bias, static_targets,
                                                static_opts);
  using Targets = decltype(in.targets);
  const auto& [x, weight, bias, targets, opts] = in;
  const upstream up = detail::dynamic_upstream(static_up);
  const forward_outputs outputs = detail::dynamic_outputs(static_out);
  const linear_grads<G> grads = detail::dynamic_grads(static_grads);
  auto a = detail::vp_training_args(
      fn, exec, group, x, weight, bias, shard, targets, opts, up, grads, workspace,
      [&] {
        detail::check_outputs(fn, outputs, in.opts, in.x.rows, detail::target_traits<Targets>::soft,
                              false);
      },
      detail::linear_memory(fn, targets, opts).writes_outputs(outputs));
  a.out = outputs;
  detail::run_vp_linear<detail::vp_linear_mode::fused>(fn, exec, group, a);
}

/// This rank's gradients (as vocab_parallel_linear_forward_backward's: d_hidden is its partial)
/// from the per-row LSE a vocab-parallel forward saved (the same on every rank), recomputing each
/// chunk's logits. With class ids it makes no collective; with soft targets one per chunk (the
/// rows' target mass spans every shard).
template <class Exec, class Group, class H, class HE, class WT = const std::remove_const_t<H>,
          class WE = dynamic_extents, class BT = const std::remove_const_t<H>,
          class BE = dynamic_extent, class Tgt, class W = dynamic_extent, class LseT = const float,
          class LseE = dynamic_extent, class UE = dynamic_extent, class G, class GHE, class GWE>
void vocab_parallel_linear_backward(const Exec& exec, const Group& group, matrix_view<H, HE> hidden,
                                    matrix_view<WT, WE> static_weight,
                                    vector_view<BT, BE> static_bias, vocab_shard shard,
                                    const Tgt& static_targets,
                                    const basic_linear_options<W>& static_opts,
                                    vector_view<LseT, LseE> static_lse,
                                    const basic_upstream<float, UE>& static_up,
                                    const linear_grads<G, GHE, GWE>& static_grads,
                                    const vocab_parallel_linear_workspace& workspace) {
  constexpr const char* fn = "xent::vocab_parallel_linear_backward";
  detail::static_call<HE::rows, WE::rows, Tgt, W, dynamic_extent, UE, false>();

  detail::static_lse<HE::rows, float, LseT, LseE>();
  detail::static_linear_grads<HE, WE, GHE, GWE>();
  const auto in = detail::dynamic_linear_inputs(hidden, static_weight, static_bias, static_targets,
                                                static_opts);
  const auto& [x, weight, bias, targets, opts] = in;
  const vector_view<const float> lse(static_lse);
  const upstream up = detail::dynamic_upstream(static_up);
  const linear_grads<G> grads = detail::dynamic_grads(static_grads);
  auto a = detail::vp_training_args(
      fn, exec, group, x, weight, bias, shard, targets, opts, up, grads, workspace,
      [&] { detail::check_vector(fn, "lse", lse, in.x.rows, false); },
      detail::linear_memory(fn, targets, opts).reads("lse", lse));
  a.lse = lse;
  detail::run_vp_linear<detail::vp_linear_mode::backward>(fn, exec, group, a);
}

}  // namespace xent
