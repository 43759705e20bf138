// How the vocab-parallel tests cut a vocabulary of V classes over R ranks: Megatron's split, one
// with an empty shard, one with the shards out of class order. Shared by the CPU and CUDA tests
// of the vocab-parallel fused linear calls and the CUDA vocab-parallel tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace xt {

/// Rank r holds classes [bounds[r], bounds[r + 1]) ... unless `order` permutes them: rank r then
/// holds piece order[r].
struct split {
  std::vector<std::int64_t> bounds;
  std::vector<int> order;  ///< empty: rank r holds piece r
  int ranks() const { return static_cast<int>(bounds.size()) - 1; }
  std::int64_t first(int r) const { return bounds[piece(r)]; }
  std::int64_t cols(int r) const { return bounds[piece(r) + 1] - bounds[piece(r)]; }
  int piece(int r) const { return order.empty() ? r : order[r]; }
  std::string name() const {
    std::string s = "shards";
    for (int r = 0; r < ranks(); ++r)
      s += " [" + std::to_string(first(r)) + "," + std::to_string(first(r) + cols(r)) + ")";
    return s;
  }
};

/// Megatron's split, V * r / R: uneven when R does not divide V.
inline split even_split(std::int64_t vocab, int ranks) {
  split s;
  for (int r = 0; r <= ranks; ++r) s.bounds.push_back(vocab * r / ranks);
  return s;
}

/// The splits a case runs on R ranks: Megatron's; with R >= 3 one whose rank 0 is empty (rank 1
/// then holds two ranks' classes); with R >= 2 one whose ranks hold the pieces in reverse class
/// order.
inline std::vector<split> splits(std::int64_t vocab, int ranks) {
  std::vector<split> out{even_split(vocab, ranks)};
  if (ranks >= 3) {
    split s = even_split(vocab, ranks);
    s.bounds[1] = s.bounds[0];
    out.push_back(s);
  }
  if (ranks >= 2) {
    split s = even_split(vocab, ranks);
    for (int r = ranks - 1; r >= 0; --r) s.order.push_back(r);
    out.push_back(s);
  }
  return out;
}

}  // namespace xt
