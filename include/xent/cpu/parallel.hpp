// Static partition of a range over threads started for the call; the calling thread works too.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <thread>

namespace xent {
namespace cpu_detail {

/// The most threads one call uses; per-thread partial sums live in fixed arrays of this size, so a
/// call allocates nothing on the heap for its bookkeeping.
constexpr int max_threads = 256;

/// Calls f(begin, end, worker) on `threads` contiguous pieces of [0, count). Contiguous pieces keep
/// each thread on neighbouring rows (sequential DRAM pages) and make the split deterministic.
///
/// A thread that cannot be started (the process's thread limit, say) leaves its piece, and every
/// later one, to the calling thread, with the same worker index: the same partition and the same
/// results, only slower. An exception thrown by f on any thread reaches the caller (the lowest
/// piece's first) once every started thread has been joined; none escapes a thread, which would
/// end the process.
template <class F>
void parallel_for(int threads, std::int64_t count, F&& f) {
  const int n = static_cast<int>(
      std::min<std::int64_t>(std::max(threads, 1), std::max<std::int64_t>(count, 1)));
  auto begin = [&](int w) { return count * w / n; };
  if (n == 1) {
    f(std::int64_t{0}, count, 0);
    return;
  }
  std::array<std::exception_ptr, max_threads> failures;
  auto piece = [&](int w) {
    try {
      f(begin(w), begin(w + 1), w);
    } catch (...) {
      failures[static_cast<std::size_t>(w)] = std::current_exception();
    }
  };
  std::array<std::thread, max_threads> workers;
  int started = 1;
  try {
    for (; started < n; ++started) workers[started] = std::thread(piece, started);
  } catch (...) {  // no more threads: the calling thread takes the pieces left
  }
  piece(0);
  for (int w = started; w < n; ++w) piece(w);
  for (int w = 1; w < started; ++w) workers[w].join();
  for (int w = 0; w < n; ++w)
    if (failures[static_cast<std::size_t>(w)])
      std::rethrow_exception(failures[static_cast<std::size_t>(w)]);
}

}  // namespace cpu_detail
}  // namespace xent
