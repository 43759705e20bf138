// vocab_parallel_traits<cpu>: vocab-parallel cross-entropy on the CPU backend, each rank a caller
// thread holding a communicator (parallel/inprocess_group.hpp, or any other).
//
// A call is the unsharded one (backend.hpp) cut at the exchange, in two phases around it:
//   records  each rank sweeps its shard's columns for every row (task_partials), merges its slices
//            per row into one slice_partial and writes a header and the row's record
//            (parallel/records.hpp: only the fields the call reads) into its send block;
//   finish   from every rank's block, gathered in rank order, every rank merges the R records of
//            each row in rank order and finishes the rows (finish_rows: the same losses, LSEs and
//            argmax, bit for bit, on every rank), then writes its own shard of the gradient.
// The group calls are these phases around group.all_gather (vp_exchange); the split-phase entry
// points (parallel/vocab_parallel_phases.hpp) are the phases alone, for a caller whose collective
// lives elsewhere. Class-id backward needs no exchange (its row mass follows from the target's
// weight); soft-target backward exchanges the shards' target mass, or takes the rows' mass that a
// finish phase wrote.
//
// The group calls allocate their exchange per call (header + N records per rank): unlike the
// unsharded calls, whose bookkeeping fits fixed arrays, it grows with N. (The fused linear calls,
// cpu/vocab_parallel_linear.hpp, keep a chunk's exchange in the caller's workspace instead.)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../backend.hpp"
#include "../detail/validate.hpp"
#include "../loss_math.hpp"
#include "../options.hpp"
#include "../parallel/records.hpp"
#include "../parallel/shard.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "backend.hpp"
#include "cpu.hpp"

namespace xent {
namespace cpu_detail {

/// The header of a rank's block (parallel/shard.hpp). check_tiling makes every rank throw the
/// same error on a bad tiling, so none is left waiting in a later collective.
using detail::shard_header;

/// The bytes one all-gather moves, as the collective sees them: per rank a header, then one record
/// of `layout` per row (parallel/records.hpp), in memory the caller provides. A phase that only
/// sends (records) has no recv, one that only receives (finish) no send.
class exchange {
 public:
  /// `send` holds block() bytes, `recv` ranks * block().
  exchange(int ranks, std::int64_t rows, record_layout layout, unsigned char* send,
           const unsigned char* recv)
      : ranks_(ranks), rows_(rows), layout_(layout), send_(send), recv_(recv) {}

  std::size_t block() const { return detail::exchange_block_bytes(rows_, layout_); }
  void put_header(const shard_header& h) { std::memcpy(send_, &h, sizeof h); }
  void put(std::int64_t n, const slice_partial& p) {
    layout_.put(send_ + detail::record_offset(n, layout_), p);
  }
  slice_partial get(int rank, std::int64_t n) const {
    return layout_.get(block_of(rank) + detail::record_offset(n, layout_));
  }
  shard_header header(int rank) const {
    shard_header h;
    std::memcpy(&h, block_of(rank), sizeof h);
    return h;
  }
  int ranks() const { return ranks_; }

 private:
  const unsigned char* block_of(int rank) const {
    return recv_ + static_cast<std::size_t>(rank) * block();
  }
  int ranks_;
  std::int64_t rows_;
  record_layout layout_;
  unsigned char* send_;
  const unsigned char* recv_;
};

/// The arguments a bad gathered header is reported under: the group calls' own (the fused linear
/// calls' rows are "hidden"), or a finish phase's `recv`, whose caller gathered the headers.
struct header_names {
  const char* vocab;
  const char* tiling;
  const char* rows;
};
constexpr header_names group_headers{"shard.vocab", "shard", "logits"};
constexpr header_names recv_headers{"recv", "recv", "recv"};

/// Every rank declared the same vocabulary and the shards tile [0, V): sorted by first class, each
/// non-empty shard starts where the previous one ended and the last ends at V.
inline void check_tiling(const char* fn, const exchange& x, const header_names& names) {
  const std::int64_t vocab = x.header(0).vocab;
  std::vector<shard_header> shards;
  for (int r = 0; r < x.ranks(); ++r) {
    const shard_header h = x.header(r);
    detail::require(h.vocab == vocab, fn, names.vocab, [&] {
      return "rank " + std::to_string(r) + " has " + std::to_string(h.vocab) +
             " classes, rank 0 has " + std::to_string(vocab);
    });
    if (h.cols > 0) shards.push_back(h);
  }
  std::sort(shards.begin(), shards.end(),
            [](const shard_header& a, const shard_header& b) { return a.first < b.first; });
  std::int64_t next = 0;
  for (const shard_header& h : shards) {
    detail::require(h.first == next, fn, names.tiling, [&] {
      return "the ranks' shards do not tile [0, " + std::to_string(vocab) + "): " +
             (h.first < next ? "classes from " + std::to_string(h.first) + " are in two shards"
                             : "classes [" + std::to_string(next) + ", " + std::to_string(h.first) +
                                   ") are in none");
    });
    next = h.first + h.cols;
  }
  detail::require(next == vocab, fn, names.tiling, [&] {
    return "the ranks' shards do not tile [0, " + std::to_string(vocab) + "): classes [" +
           std::to_string(next) + ", " + std::to_string(vocab) + ") are in none";
  });
}

/// Every rank has the call's rows (each header says how many): the blocks hold the same rows.
inline void check_rows(const char* fn, const exchange& x, std::int64_t rows,
                       const header_names& names) {
  for (int r = 0; r < x.ranks(); ++r)
    detail::require(x.header(r).rows == rows, fn, names.rows, [&] {
      return "rank " + std::to_string(r) + " has " + std::to_string(x.header(r).rows) +
             " rows, this rank " + std::to_string(rows) + "; every rank passes the same rows";
    });
}

/// The records phase: this rank's header and, per row, its shard's record of `layout` into
/// `send` (exchange_block_bytes(rows, layout) bytes): the statistics of a forward exchange, or
/// the soft targets' mass alone (record_layout::mass_only). Class ids are checked first.
template <class T, class Tgt>
void vp_records(const char* fn, const cpu& exec, matrix_view<const T> logits, vocab_shard shard,
                const Tgt& targets, const options& opts, record_layout layout,
                unsigned char* send) {
  const problem<T, Tgt> pb = make_problem(exec, logits, targets, opts, shard);
  check_targets_and_weigh(fn, targets, shard.vocab, opts);  // global ids, before anything is sent
  const std::int64_t rows = logits.rows;
  exchange x(1, rows, layout, send, nullptr);
  x.put_header(shard_header{shard.first, logits.cols, shard.vocab, rows});
  if (!layout.has(record_layout::lse)) {
    if constexpr (problem<T, Tgt>::soft) {
      for (std::int64_t n = 0; n < rows; ++n) {
        slice_partial p;
        p.stats.mass = soft_mass(pb, n);
        x.put(n, p);
      }
    }
    return;
  }
  const plan pl = make_plan(exec, rows, logits.cols);
  std::vector<slice_partial> parts(static_cast<std::size_t>(pl.tasks(rows)));
  if (layout.has(record_layout::argmax))
    task_partials<true>(pl, pb, parts.data());
  else
    task_partials<false>(pl, pb, parts.data());
  auto local = [&](std::int64_t n, std::int64_t s) { return parts[n * pl.slices + s]; };
  for (std::int64_t n = 0; n < rows; ++n) x.put(n, merge_pieces(local, n, pl.slices));
}

/// The gathered blocks of a call's `ranks` ranks at `recv`, their headers checked: the tiling,
/// and that every rank exchanged the call's rows.
inline exchange gathered(const char* fn, int ranks, std::int64_t rows, record_layout layout,
                         const unsigned char* recv, const header_names& names) {
  const exchange x(ranks, rows, layout, nullptr, recv);
  check_tiling(fn, x, names);
  check_rows(fn, x, rows, names);
  return x;
}

/// Each row's target mass, merged in rank order from a mass-only exchange.
inline float merged_mass(const exchange& x, std::int64_t n) {
  auto piece = [&](std::int64_t row, std::int64_t r) { return x.get(static_cast<int>(r), row); };
  return merge_pieces(piece, n, x.ranks()).stats.mass;
}

/// The finish phase of a forward exchange in `recv` (ranks blocks, their headers' errors named
/// as `names` says): the outputs, each row's
/// target mass into `row_mass` when given (0 on ignored rows), and with `grad` (non-null) this
/// rank's gradient shard from the upstream `up`.
template <class T, class Tgt, class G>
void vp_finish(const char* fn, const cpu& exec, int ranks, matrix_view<const T> logits,
               vocab_shard shard, const Tgt& targets, const options& opts, record_layout layout,
               const unsigned char* recv, const header_names& names, const forward_outputs& out,
               vector_view<float> row_mass, const upstream* up, matrix_view<G> grad) {
  const problem<T, Tgt> pb = make_problem(exec, logits, targets, opts, shard);
  const double normalizer = check_targets_and_weigh(fn, targets, shard.vocab, opts);
  const std::int64_t rows = logits.rows;
  const exchange x = gathered(fn, ranks, rows, layout, recv, names);
  totals sums;
  std::vector<float> lse(static_cast<std::size_t>(rows)), mass(static_cast<std::size_t>(rows));
  finish_rows(
      pb, ranks, [&](std::int64_t n, std::int64_t r) { return x.get(static_cast<int>(r), n); }, out,
      sums, lse.data(), mass.data());
  if (row_mass.data) std::copy(mass.begin(), mass.end(), row_mass.data);
  if (grad.data)
    write_gradient(
        make_plan(exec, rows, logits.cols), pb, [&](std::int64_t n) { return lse[n]; },
        [&](std::int64_t n) { return mass[n]; }, make_row_scales(*up, opts, normalizer), grad);
  write_totals(sums, 1, opts, normalizer, out);
}

/// Backward from each row's LSE and, for soft targets, its target mass (mass_of(n)); class ids
/// take their mass from the target's weight.
template <class T, class Tgt, class G, class Mass>
void vp_gradient(const char* fn, const cpu& exec, matrix_view<const T> logits, vocab_shard shard,
                 const Tgt& targets, const options& opts, vector_view<const float> lse,
                 const Mass& mass_of, const upstream& up, matrix_view<G> grad) {
  const problem<T, Tgt> pb = make_problem(exec, logits, targets, opts, shard);
  const double normalizer = check_targets_and_weigh(fn, targets, shard.vocab, opts);
  auto lse_of = [&](std::int64_t n) { return lse[n]; };
  const plan pl = make_plan(exec, logits.rows, logits.cols);
  const row_scales<float> scale = make_row_scales(up, opts, normalizer);
  if constexpr (problem<T, Tgt>::soft)
    write_gradient(pl, pb, lse_of, mass_of, scale, grad);
  else
    write_gradient(
        pl, pb, lse_of, [&](std::int64_t n) { return row_mass(pb, n); }, scale, grad);
}

/// A group call's exchange: the records phase into `storage`, then the all-gather. Returns where
/// the gathered blocks are (unchecked: the finish phase, or `gathered`, checks their headers).
template <class Group, class T, class Tgt>
const unsigned char* vp_exchange(const char* fn, const cpu& exec, const Group& group,
                                 matrix_view<const T> logits, vocab_shard shard, const Tgt& targets,
                                 const options& opts, record_layout layout,
                                 std::vector<unsigned char>& storage) {
  const std::size_t block = detail::exchange_block_bytes(logits.rows, layout);
  storage.assign(block * static_cast<std::size_t>(group.size() + 1), 0);
  vp_records(fn, exec, logits, shard, targets, opts, layout, storage.data());
  group.all_gather(storage.data(), storage.data() + block, block);
  return storage.data() + block;
}

/// vocab-parallel forward, and forward_backward when `grad` is non-null: the two phases around
/// group.all_gather.
template <class Group, class T, class Tgt, class G>
void vp_forward(const char* fn, const cpu& exec, const Group& group, matrix_view<const T> logits,
                vocab_shard shard, const Tgt& targets, const options& opts, const upstream* up,
                const forward_outputs& out, matrix_view<G> grad) {
  const record_layout layout =
      record_layout::statistics(problem<T, Tgt>::soft, opts, out.argmax.data || out.num_correct);
  std::vector<unsigned char> bytes;
  const unsigned char* recv =
      vp_exchange(fn, exec, group, logits, shard, targets, opts, layout, bytes);
  vp_finish(fn, exec, group.size(), logits, shard, targets, opts, layout, recv, group_headers, out,
            vector_view<float>{}, up, grad);
}

template <class Group, class T, class Tgt, class G>
void vp_backward(const cpu& exec, const Group& group, matrix_view<const T> logits,
                 vocab_shard shard, const Tgt& targets, const options& opts,
                 vector_view<const float> lse, const upstream& up, matrix_view<G> grad) {
  constexpr const char* fn = "xent::vocab_parallel_backward";
  if constexpr (problem<T, Tgt>::soft) {
    // sum_c w_c t'_c spans every shard: exchange each shard's part of it.
    std::vector<unsigned char> bytes;
    const record_layout layout = record_layout::mass_only();
    const exchange x = gathered(
        fn, group.size(), logits.rows, layout,
        vp_exchange(fn, exec, group, logits, shard, targets, opts, layout, bytes), group_headers);
    vp_gradient(
        fn, exec, logits, shard, targets, opts, lse,
        [&](std::int64_t n) { return merged_mass(x, n); }, up, grad);
  } else {
    vp_gradient(
        fn, exec, logits, shard, targets, opts, lse, [](std::int64_t) { return 0.0f; }, up, grad);
  }
}

}  // namespace cpu_detail

template <>
struct vocab_parallel_traits<cpu> {
  template <class Group, class T, class Tgt>
  static void forward(const cpu& exec, const Group& group, matrix_view<const T> logits,
                      vocab_shard shard, const Tgt& targets, const options& opts,
                      const forward_outputs& out) {
    cpu_detail::vp_forward("xent::vocab_parallel_forward", exec, group, logits, shard, targets,
                           opts, nullptr, out, matrix_view<float>{});
  }

  template <class Group, class T, class Tgt, class G>
  static void backward(const cpu& exec, const Group& group, matrix_view<const T> logits,
                       vocab_shard shard, const Tgt& targets, const options& opts,
                       vector_view<const float> lse, const upstream& up, matrix_view<G> grad) {
    cpu_detail::vp_backward(exec, group, logits, shard, targets, opts, lse, up, grad);
  }

  template <class Group, class T, class Tgt, class G>
  static void forward_backward(const cpu& exec, const Group& group, matrix_view<const T> logits,
                               vocab_shard shard, const Tgt& targets, const options& opts,
                               const upstream& up, const forward_outputs& out,
                               matrix_view<G> grad) {
    cpu_detail::vp_forward("xent::vocab_parallel_forward_backward", exec, group, logits, shard,
                           targets, opts, &up, out, grad);
  }

  // The split phases (parallel/vocab_parallel_phases.hpp).
  template <class T, class Tgt>
  static void records(const cpu& exec, matrix_view<const T> logits, vocab_shard shard,
                      const Tgt& targets, const options& opts, record_layout layout,
                      unsigned char* send) {
    cpu_detail::vp_records("xent::vocab_parallel_records", exec, logits, shard, targets, opts,
                           layout, send);
  }

  template <class T, class Tgt, class G>
  static void finish(const cpu& exec, int ranks, matrix_view<const T> logits, vocab_shard shard,
                     const Tgt& targets, const options& opts, record_layout layout,
                     const unsigned char* recv, const forward_outputs& out, float* row_mass,
                     const upstream* up, matrix_view<G> grad) {
    cpu_detail::vp_finish("xent::vocab_parallel_finish", exec, ranks, logits, shard, targets, opts,
                          layout, recv, cpu_detail::recv_headers, out,
                          vector_view<float>(row_mass, row_mass ? logits.rows : 0), up, grad);
  }

  template <class T, class Tgt, class G>
  static void backward_from_mass(const cpu& exec, matrix_view<const T> logits, vocab_shard shard,
                                 const Tgt& targets, const options& opts,
                                 vector_view<const float> lse, const float* row_mass,
                                 const upstream& up, matrix_view<G> grad) {
    cpu_detail::vp_gradient(
        "xent::vocab_parallel_backward", exec, logits, shard, targets, opts, lse,
        [&](std::int64_t n) { return row_mass[n]; }, up, grad);
  }
};

}  // namespace xent
