// The chunk loop of vocab-parallel fused linear cross-entropy, written once for every backend.
//
// A rank holds weight[first : first + V_local] (and that slice of the bias), the whole hidden
// (N x D) and the global targets. Rows are taken `workspace.chunk_rows` at a time, the same on
// every rank; for a chunk of rows [r0, r0 + n) a backend's call object (backend.hpp's
// vocab_parallel_linear_traits<Exec>::call) runs
//   logits(r0, n)      L = X_c · W_shardᵀ (+ b_shard), n x V_local, in the workspace;
//   records(r0, n, k)  this shard's per-row records of L into its send block (the fields of a
//                      slice_partial the call merges, parallel/records.hpp: online-LSE state and
//                      target logit; smoothing / soft-target sums and argmax where read);
//   then this loop makes the chunk's one collective, group.all_gather of those blocks;
//   merge(r0, n, k)    every rank merges the R records of each row in rank order (the same code,
//                      slice_partial::merge, as vocab_parallel_forward: bitwise-identical loss,
//                      LSE and argmax on every rank) and writes the chunk's rows' outputs;
//   gradient(r0, n)    the logit gradient G over L, in place, from each row's LSE;
//   accumulate(r0, n)  d_weight_shard += Gᵀ X_c, d_bias_shard += column sums of G, and this
//                      rank's partial d_hidden rows G · W_shard;
// and finish() after the last chunk (accumulators rounded, the reduced loss). Forward runs the
// first four steps; backward from a saved LSE runs logits, gradient and accumulate, and with soft
// targets also the exchange, of the shards' target mass only (class ids need no collective).
// Nothing N x V_local is materialised: L is chunk_rows x V_local.
//
// The low-memory order (linear_order::low_memory, training calls) runs the same chunks and
// exchanges without gradient and accumulate, keeping every row's merged LSE and target mass, then
//   panels()           this rank's shard in panels of weight rows as the outer loop, as the
//                      single-device low-memory order does (its step 3, the same code), with
//                      class ids global and the loss constants of the whole vocabulary;
// backward with class ids runs the panels alone. The collectives of a call are the fast order's,
// chunk for chunk: ranks that chose different orders still exchange the same blocks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../backend.hpp"
#include "../linear/options.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "shard.hpp"

namespace xent {
namespace detail {

enum class vp_linear_mode { forward, fused, backward };

/// What a chunk's records carry: every statistic of a row (forward), or only its target mass
/// (soft-target backward: sum_c w_c t'_c spans every shard).
enum class vp_records { statistics, mass };

/// A chunk's exchange as the collective sees it: this rank's block, where every rank's blocks
/// land (in rank order), and the bytes per rank.
struct vp_block {
  const void* send;
  void* recv;
  std::size_t bytes;
};

/// One call's arguments, checked by the entry points (parallel/vocab_parallel_linear.hpp).
template <class T, class G, class Tgt>
struct vp_linear_args {
  matrix_view<const T> hidden, weight;
  vector_view<const T> bias;
  vocab_shard shard;
  Tgt targets;
  linear_options opts;
  const upstream* up = nullptr;  ///< the upstream gradient (training), null for forward
  vector_view<const float> lse;  ///< backward: the LSE a forward saved
  forward_outputs out;           ///< forward and fused
  linear_grads<G> grads;         ///< fused and backward
  vocab_parallel_linear_workspace ws;
  int ranks = 1;
};

/// Rows per chunk that a call's buffers are laid out for: the workspace's, no more than the call
/// has rows, at least one (the buffers of a call without rows).
inline std::int64_t planned_chunk_rows(std::int64_t chunk_rows, std::int64_t rows) {
  return std::max<std::int64_t>(1, std::min(chunk_rows, rows));
}

template <vp_linear_mode Mode, class Exec, class Group, class T, class G, class Tgt>
void run_vp_linear(const char* fn, const Exec& exec, const Group& group,
                   const vp_linear_args<T, G, Tgt>& a) {
  using call_t = typename vocab_parallel_linear_traits<Exec>::template call<T, G, Tgt>;
  call_t call(fn, exec, group, a, Mode);
  constexpr bool exchange_mass = Mode == vp_linear_mode::backward && target_traits<Tgt>::soft;
  constexpr bool exchange = Mode != vp_linear_mode::backward || exchange_mass;
  // The low-memory order: the chunks' exchanges alone, then the panels (no collective).
  const bool panels = Mode != vp_linear_mode::forward && a.opts.order == linear_order::low_memory;
  const std::int64_t rows = a.hidden.rows;
  for (std::int64_t r0 = 0; r0 < rows && (exchange || !panels); r0 += a.ws.chunk_rows) {
    const std::int64_t n = std::min(a.ws.chunk_rows, rows - r0);
    call.logits(r0, n);
    if (exchange) {
      const vp_records what = exchange_mass ? vp_records::mass : vp_records::statistics;
      const vp_block block = call.records(r0, n, what);
      group.all_gather(block.send, block.recv, block.bytes);  // the chunk's one collective
      call.merge(r0, n, what);
    }
    if (Mode != vp_linear_mode::forward && !panels) {
      call.gradient(r0, n);
      call.accumulate(r0, n);
    }
  }
  if (panels) call.panels();
  call.finish();
}

}  // namespace detail
}  // namespace xent
