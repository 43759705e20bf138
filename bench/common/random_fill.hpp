// Deterministic random inputs for benchmarks, filled in parallel: normal-ish logits (never zeros,
// METHOD.md) and valid class ids.
#pragma once

#include <cmath>
#include <cstdint>
#include <thread>

#include "host_roof.hpp"

namespace xent_bench {

inline std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// Fills n elements with mean 0, standard deviation `stddev` (Irwin-Hall: the sum of four 16-bit
/// uniforms, bounded by +-2*sqrt(3)*stddev), converted to T. The same seed gives the same values
/// whatever the thread count (each 64 Ki-element block has its own stream).
template <class T>
void fill_normalish(T* out, std::int64_t n, std::uint64_t seed, float stddev = 1.0f) {
  constexpr std::int64_t block = 1 << 16;
  const std::int64_t blocks = (n + block - 1) / block;
  const float scale = stddev * std::sqrt(3.0f) / 65536.0f;
  parallel_pieces(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())),
                  static_cast<std::size_t>(blocks), [&](std::size_t b0, std::size_t b1) {
                    for (std::size_t b = b0; b < b1; ++b) {
                      std::uint64_t s = seed * 0x100000001b3ull + b;
                      const std::int64_t e = std::min<std::int64_t>(n, (b + 1) * block);
                      for (std::int64_t i = static_cast<std::int64_t>(b) * block; i < e; ++i) {
                        const std::uint64_t r = splitmix64(s);
                        const float u = static_cast<float>((r & 0xffff) + ((r >> 16) & 0xffff) +
                                                           ((r >> 32) & 0xffff) + (r >> 48));
                        out[i] = T(u * scale - 2.0f * std::sqrt(3.0f) * stddev);
                      }
                    }
                  });
}

/// n class ids uniform in [0, classes).
template <class I>
void fill_class_ids(I* out, std::int64_t n, std::int64_t classes, std::uint64_t seed) {
  std::uint64_t s = seed;
  for (std::int64_t i = 0; i < n; ++i)
    out[i] = static_cast<I>(splitmix64(s) % static_cast<std::uint64_t>(classes));
}

}  // namespace xent_bench
