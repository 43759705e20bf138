// The CPU execution object.
#pragma once

#include <cstdint>

namespace xent {

/// Runs on the host with Eigen's vectorised math. `threads` workers (the calling thread is one)
/// split the rows, or the vocabulary of each row when rows are fewer than threads. Every call is
/// synchronous: it returns when its outputs are written.
struct cpu {
  /// Below 1 the calling thread works alone; above 256 (cpu/parallel.hpp's max_threads), 256.
  int threads = 1;
  /// Vocabulary elements swept per step while in L1; 0 or less picks the tuned default, others
  /// are held within the policy's bounds (cpu/policy.hpp's chunk_for).
  std::int64_t chunk = 0;

  cpu() = default;
  explicit cpu(int threads_, std::int64_t chunk_ = 0) : threads(threads_), chunk(chunk_) {}
};

}  // namespace xent
