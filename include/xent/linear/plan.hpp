// What every backend of fused linear cross-entropy shares about row chunks and vocabulary panels:
// the search for the largest chunk whose buffers fit a byte budget, and the slices of per-row and
// per-class arguments a chunk or panel passes to the cross-entropy core and the GEMMs.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../targets.hpp"
#include "../views.hpp"
#include "options.hpp"

namespace xent {
namespace detail {

/// The plan with the most rows per chunk (at most max(rows, 1)) whose `bytes` fit `budget`, or
/// the one-row plan when none does. `plan_of(chunk_rows)` returns a plan with a `bytes` member
/// that grows with the chunk, so a binary search finds it.
template <class PlanOf>
auto largest_chunk_plan(std::int64_t rows, std::size_t budget, PlanOf&& plan_of) {
  std::int64_t lo = 1, hi = std::max<std::int64_t>(rows, 1);
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo + 1) / 2;
    if (plan_of(mid).bytes <= budget)
      lo = mid;
    else
      hi = mid - 1;
  }
  return plan_of(lo);
}

/// The bytes a size query plans within: the budget is for the buffers that grow with the row
/// chunk, on top of the `fixed` ones (float accumulators of d_weight and d_bias, per-row outputs),
/// which a call needs whatever its chunk. A V x D float accumulator alone is 2 GiB for an LM head
/// of 128256 x 4096: counted against a 256 MiB budget it would leave one-row chunks.
inline std::size_t chunk_budget(std::size_t fixed, std::size_t budget) {
  return budget > SIZE_MAX - fixed ? SIZE_MAX : fixed + budget;
}

/// Rows per panel sub-chunk of a vocab-parallel call in the low-memory order, whose exchange
/// chunks have `chunk_rows` rows (the same on every rank) over a shard of `vocab` classes taken in
/// panels of `cols`: a panel sub-chunk's logits take what a chunk's over the shard take
/// (chunk_rows x vocab / cols rows, whole multiples of chunk_rows), at most the call's `rows`, at
/// least one; none for chunk_rows 0 (a size query's fixed buffers). Derived from chunk_rows
/// alone, so a rank's bytes follow from its shard and chunk_rows as in the fast order.
inline std::int64_t panel_chunk_rows(std::int64_t chunk_rows, std::int64_t rows, std::int64_t vocab,
                                     std::int64_t cols) {
  if (chunk_rows < 1) return 0;
  const std::int64_t per = std::max<std::int64_t>(1, vocab / std::max<std::int64_t>(cols, 1));
  const std::int64_t r = chunk_rows > rows / per ? rows : chunk_rows * per;
  return std::max<std::int64_t>(1, std::min(r, rows));
}

/// Entries [r0, r0 + n) of an optional per-row vector (absent stays absent).
template <class U>
vector_view<U> rows_slice(const vector_view<U>& v, std::int64_t r0, std::int64_t n) {
  return v.data ? vector_view<U>(v.data + r0, n) : vector_view<U>{};
}

/// The targets of rows [r0, r0 + n).
template <class I>
vector_view<const I> target_rows(const vector_view<const I>& targets, std::int64_t r0,
                                 std::int64_t n) {
  return {targets.data + r0, n};
}

template <class S>
soft_targets<S> target_rows(const soft_targets<S>& targets, std::int64_t r0, std::int64_t n) {
  return {matrix_view<const S>(targets.probs.row(r0), n, targets.probs.cols, targets.probs.ld)};
}

/// Rows [v0, v0 + n) of an optional matrix (absent, null and 0 x 0, stays absent; a matrix of no
/// columns may have null data, so no row address is formed for it).
template <class U>
matrix_view<U> panel_rows(const matrix_view<U>& m, std::int64_t v0, std::int64_t n) {
  if (!m.data && m.rows == 0 && m.cols == 0) return m;
  return matrix_view<U>(m.cols == 0 ? m.data : m.row(v0), n, m.cols, m.ld);
}

template <class U>
vector_view<U> panel_slice(const vector_view<U>& v, std::int64_t v0, std::int64_t n) {
  return v.data ? vector_view<U>(v.data + v0, n) : v;
}

/// The gradients of weight rows [v0, v0 + n): their rows of d_weight and d_bias (each absent when
/// absent), no d_hidden (the low-memory order sums it over the panels itself).
template <class G>
linear_grads<G> panel_grads(const linear_grads<G>& grads, std::int64_t v0, std::int64_t n) {
  linear_grads<G> g;
  g.d_weight = panel_rows(grads.d_weight, v0, n);
  g.d_bias = panel_slice(grads.d_bias, v0, n);
  return g;
}

/// The targets of rows [r0, r0 + n) for a panel's columns [v0, v0 + nb): class ids are global,
/// soft targets are the panel's columns (as a vocab-parallel shard's).
template <class I>
vector_view<const I> panel_targets(const vector_view<const I>& targets, std::int64_t r0,
                                   std::int64_t n, std::int64_t, std::int64_t) {
  return detail::target_rows(targets, r0, n);
}

template <class S>
soft_targets<S> panel_targets(const soft_targets<S>& targets, std::int64_t r0, std::int64_t n,
                              std::int64_t v0, std::int64_t nb) {
  return {matrix_view<const S>(targets.probs.row(r0) + v0, n, nb, targets.probs.ld)};
}

}  // namespace detail
}  // namespace xent
