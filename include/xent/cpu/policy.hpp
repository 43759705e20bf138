// Tunables of the CPU backend, as data.
#pragma once

#include <algorithm>
#include <cstdint>

namespace xent {
namespace cpu_detail {

struct policy {
  /// Elements per L1 sweep. A chunk is read from memory once into registers/L1 and swept up to
  /// three times there (max, exp-sum, side sums); 2048 floats (8 KiB) plus a soft-target or weight
  /// chunk stay inside a 32-48 KiB L1d.
  static constexpr std::int64_t chunk = 2048;
  static constexpr std::int64_t max_chunk = 8192;
  /// Smallest vocabulary slice given to one thread when rows are fewer than threads: below this the
  /// merge and thread start-up outweigh the sweep.
  static constexpr std::int64_t min_slice = 4096;
  /// Below this many logits one thread does the call: starting a thread costs tens of microseconds.
  static constexpr std::int64_t min_parallel_elements = std::int64_t{1} << 16;

  static std::int64_t chunk_for(std::int64_t requested) {
    return requested <= 0 ? chunk : std::min(std::max<std::int64_t>(requested, 16), max_chunk);
  }
};

}  // namespace cpu_detail
}  // namespace xent
