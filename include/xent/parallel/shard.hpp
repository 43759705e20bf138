// Where a rank's logits sit in the vocabulary when tensor parallelism splits it across ranks.
#pragma once

#include <cstdint>

namespace xent {

/// A rank's logits are columns [first, first + logits.cols) of a vocabulary of `vocab` classes.
/// The shards of a group's ranks tile [0, vocab) without overlap, in any order; a shard may be
/// empty (more ranks than classes). Megatron's split, rank r holding [r V / R, (r + 1) V / R), is
/// one such tiling. An unsharded call is {0, cols}.
struct vocab_shard {
  std::int64_t first = 0;
  std::int64_t vocab = 0;
};

namespace detail {

/// What each rank sends ahead of its per-row records in a vocab-parallel exchange: its shard and
/// row count (the same bytes on the CPU and CUDA backends). Every rank checks the gathered headers
/// after the exchange, on the same bytes, so a bad tiling is found by every rank alike.
struct shard_header {
  std::int64_t first = 0;
  std::int64_t cols = 0;
  std::int64_t vocab = 0;
  std::int64_t rows = 0;
};

}  // namespace detail

}  // namespace xent
