// What every backend of fused linear cross-entropy shares about row chunks: the search for the
// largest chunk whose buffers fit a byte budget, and the slices of per-row arguments a chunk
// passes to the cross-entropy core.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../targets.hpp"
#include "../views.hpp"

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

}  // namespace detail
}  // namespace xent
