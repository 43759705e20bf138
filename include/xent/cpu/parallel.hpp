// Static partition of a range over threads started for the call; the calling thread works too.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <thread>

namespace xent {
namespace cpu_detail {

/// The most threads one call uses; per-thread partial sums live in fixed arrays of this size, so a
/// call allocates nothing on the heap for its bookkeeping.
constexpr int max_threads = 256;

/// Calls f(begin, end, worker) on `threads` contiguous pieces of [0, count). Contiguous pieces keep
/// each thread on neighbouring rows (sequential DRAM pages) and make the split deterministic.
template <class F>
void parallel_for(int threads, std::int64_t count, F&& f) {
  const int n = static_cast<int>(
      std::min<std::int64_t>(std::max(threads, 1), std::max<std::int64_t>(count, 1)));
  auto begin = [&](int w) { return count * w / n; };
  if (n == 1) {
    f(std::int64_t{0}, count, 0);
    return;
  }
  std::array<std::thread, max_threads> workers;
  for (int w = 1; w < n; ++w) workers[w] = std::thread([&, w] { f(begin(w), begin(w + 1), w); });
  f(begin(0), begin(1), 0);
  for (int w = 1; w < n; ++w) workers[w].join();
}

}  // namespace cpu_detail
}  // namespace xent
