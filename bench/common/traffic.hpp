// What a cross-entropy call must move at the least, and the counters every xent benchmark reports
// (ANCHORS.md's convention, so CPU and CUDA figures compare): forward reads the logits once;
// forward_backward reads them once and writes the gradient once. Targets, LSE and losses are
// O(N) and not counted. The roof_pct counter divides by a roof measured in the same run.
#pragma once

#include <benchmark/benchmark.h>

#include <cstdint>

namespace xent_bench {

enum class pass { forward, forward_backward };

/// Fewest bytes a pass over an N x V logits matrix of `elem_bytes`-byte elements moves, with a
/// gradient of `grad_bytes`-byte elements (0: same as the logits).
inline std::int64_t min_traffic_bytes(pass p, std::int64_t rows, std::int64_t cols,
                                      std::int64_t elem_bytes, std::int64_t grad_bytes = 0) {
  const std::int64_t elems = rows * cols;
  if (p == pass::forward) return elems * elem_bytes;
  return elems * (elem_bytes + (grad_bytes ? grad_bytes : elem_bytes));
}

/// Sets bytes/s (the minimum traffic), items/s (logits elements) and roof_pct = achieved bytes/s
/// over `roof_bytes_per_s` * 100. `seconds` is the timed loop's duration as the caller measured
/// it (the framework's own time is not visible inside the benchmark; a plain counter prints as a
/// percentage, where a rate counter would print "%/s").
inline void report_traffic(benchmark::State& state, std::int64_t bytes_per_iter,
                           std::int64_t elements_per_iter, double seconds,
                           double roof_bytes_per_s) {
  state.SetBytesProcessed(bytes_per_iter * state.iterations());
  state.SetItemsProcessed(elements_per_iter * state.iterations());
  if (roof_bytes_per_s > 0 && seconds > 0)
    state.counters["roof_pct"] = static_cast<double>(bytes_per_iter) *
                                 static_cast<double>(state.iterations()) / seconds * 100.0 /
                                 roof_bytes_per_s;
}

}  // namespace xent_bench
