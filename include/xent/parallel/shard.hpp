// Where a rank's logits sit in the vocabulary when tensor parallelism splits it across ranks.
#pragma once

#include <cstdint>
#include <string>

#include "../detail/validate.hpp"

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

/// The most rows x (ranks + 3) a vocab-parallel call may have. Per row a rank's workspace holds
/// (ranks + 1) exchanged records (sent and received, at most 32 bytes each: parallel/records.hpp)
/// and at most two more units' worth (this shard's 40-byte slice_partial on the CPU, the merged
/// LSE and mass, the reduction's entries): below 64 bytes per unit, so the exchange stays under
/// 2^61 bytes and adding it to a single-device call's buffers does not wrap a workspace size. Rows
/// alone are bounded only by the views: 2^59 rows of an empty shard (or of D = 0) wrapped the sizes
/// to a few bytes that passed the workspace check.
constexpr std::int64_t max_exchange_units = std::int64_t{1} << 55;

/// `rows` rows exchanged among `ranks` ranks (ranks >= 1, rows >= 0) fit max_exchange_units.
inline void check_exchange_rows(const char* fn, const char* arg, std::int64_t rows, int ranks) {
  const std::int64_t units = static_cast<std::int64_t>(ranks) + 3;
  require(rows <= max_exchange_units / units, fn, arg, [&] {
    return std::to_string(rows) + " rows over " + std::to_string(ranks) +
           " ranks: rows x (ranks + 3) exceeds 2^55, more exchange records than a workspace "
           "size can count";
  });
}

}  // namespace detail

}  // namespace xent
