// What a vocab-parallel exchange carries per row: only the fields of a slice_partial that the
// call's merge reads, packed in 32-bit words, in this order, each present or not:
//
//   max sum | target | dot | mass | argmax value, index low word, index high word
//
//   lse (max, sum)  the shard's online-LSE state: every forward exchange
//   target          the target logit (0 on shards without the target): class ids
//   dot             sum_c w_c t'_c z_c: soft targets, and class ids with label smoothing
//   mass            sum_c w_c t'_c: soft targets (forward; backward sends it alone)
//   argmax          the shard's largest logit and its global class id: argmax or num_correct asked
//
// Class ids: 12 bytes per row (what a plain training step needs); with label smoothing 16; soft
// targets 16; argmax adds 12; soft-target backward sends the mass alone, 4. A field left out is
// read back as what a shard that does not hold it contributes (0, or an empty argmax), which the
// merge never reads for such a call: the merged values, hence the outputs, are those of whole
// slice_partial records, and every rank merges the same bytes in rank order as before.
//
// A rank's block is a 32-byte shard_header, then one record per row, padded to a multiple of 8
// bytes so that every rank's header in the gathered blocks stays aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../config.hpp"
#include "../loss_math.hpp"
#include "../options.hpp"
#include "shard.hpp"

namespace xent {

/// Which fields a call's records carry: fixed by the kind of targets, the options and the outputs
/// asked for, so every rank of a call derives the same layout.
struct record_layout {
  enum field : unsigned { lse = 1, target = 2, dot = 4, mass = 8, argmax = 16 };
  unsigned fields = 0;

  /// A forward exchange's records: `soft` for soft targets, `with_argmax` when argmax or
  /// num_correct is asked for.
  static record_layout statistics(bool soft, const options& opts, bool with_argmax) {
    record_layout l;
    l.fields = lse | (soft ? dot | mass : target) |
               (!soft && opts.label_smoothing != 0.0f ? dot : 0u) | (with_argmax ? argmax : 0u);
    return l;
  }
  /// Soft-target backward: the shards' target mass alone.
  static constexpr record_layout mass_only() { return record_layout{mass}; }
  /// The widest records a call exchanges (soft targets with argmax, 32 bytes; class ids carry at
  /// most 28): what a workspace sized before the call's options and outputs are known holds.
  static constexpr record_layout largest() { return record_layout{lse | dot | mass | argmax}; }

  XENT_HOST_DEVICE constexpr bool has(field f) const { return (fields & f) != 0; }
  XENT_HOST_DEVICE constexpr int words() const {
    return (has(lse) ? 2 : 0) + (has(target) ? 1 : 0) + (has(dot) ? 1 : 0) + (has(mass) ? 1 : 0) +
           (has(argmax) ? 3 : 0);
  }
  /// Bytes per row per rank on the wire.
  XENT_HOST_DEVICE constexpr std::size_t bytes() const {
    return static_cast<std::size_t>(words()) * 4;
  }

  /// Writes p's fields of this layout at `record` (4-byte aligned).
  XENT_HOST_DEVICE void put(unsigned char* record, const slice_partial& p) const {
    word_cursor<unsigned char> w{record};
    if (has(lse)) {
      w.put(bits(p.stats.lse.max));
      w.put(bits(p.stats.lse.sum));
    }
    if (has(target)) w.put(bits(p.stats.target_logit));
    if (has(dot)) w.put(bits(p.stats.dot));
    if (has(mass)) w.put(bits(p.stats.mass));
    if (has(argmax)) {
      const auto index = static_cast<std::uint64_t>(p.argmax.index);
      w.put(bits(p.argmax.value));
      w.put(static_cast<std::uint32_t>(index));
      w.put(static_cast<std::uint32_t>(index >> 32));
    }
  }

  /// The slice_partial at `record`, fields this layout leaves out as an empty one's.
  XENT_HOST_DEVICE slice_partial get(const unsigned char* record) const {
    word_cursor<const unsigned char> w{record};
    slice_partial p;
    if (has(lse)) {
      p.stats.lse.max = real(w.get());
      p.stats.lse.sum = real(w.get());
    }
    if (has(target)) p.stats.target_logit = real(w.get());
    if (has(dot)) p.stats.dot = real(w.get());
    if (has(mass)) p.stats.mass = real(w.get());
    if (has(argmax)) {
      p.argmax.value = real(w.get());
      const std::uint64_t low = w.get(), high = w.get();
      p.argmax.index = static_cast<std::int64_t>(low | high << 32);
    }
    return p;
  }

 private:
  /// Sequential 32-bit words. Device code loads and stores whole words (records are 4-byte
  /// aligned); host code copies bytes, as the collective's buffers are bytes.
  template <class Byte>
  struct word_cursor {
    Byte* at;
    XENT_HOST_DEVICE void put(std::uint32_t v) {
#ifdef __CUDA_ARCH__
      *reinterpret_cast<std::uint32_t*>(at) = v;
#else
      std::memcpy(at, &v, 4);
#endif
      at += 4;
    }
    XENT_HOST_DEVICE std::uint32_t get() {
      std::uint32_t v;
#ifdef __CUDA_ARCH__
      v = *reinterpret_cast<const std::uint32_t*>(at);
#else
      std::memcpy(&v, at, 4);
#endif
      at += 4;
      return v;
    }
  };
  XENT_HOST_DEVICE static std::uint32_t bits(float f) {
    std::uint32_t v;
    std::memcpy(&v, &f, 4);
    return v;
  }
  XENT_HOST_DEVICE static float real(std::uint32_t v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
  }
};

namespace detail {

/// Bytes of one rank's block for `rows` rows of `layout` records: what all_gather moves per rank.
XENT_HOST_DEVICE constexpr std::size_t exchange_block_bytes(std::int64_t rows,
                                                            record_layout layout) {
  return (sizeof(shard_header) + static_cast<std::size_t>(rows < 0 ? 0 : rows) * layout.bytes() +
          7) /
         8 * 8;
}

/// Record n of a block (its header first).
XENT_HOST_DEVICE constexpr std::size_t record_offset(std::int64_t n, record_layout layout) {
  return sizeof(shard_header) + static_cast<std::size_t>(n) * layout.bytes();
}

}  // namespace detail

/// Where a records phase writes each row's record: a rank's send block (null: nowhere), written
/// behind its header.
struct record_sink {
  unsigned char* block = nullptr;
  record_layout layout{};

  XENT_HOST_DEVICE void put(std::int64_t n, const slice_partial& p) const {
    layout.put(block + detail::record_offset(n, layout), p);
  }
};

}  // namespace xent
