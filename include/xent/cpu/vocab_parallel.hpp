// vocab_parallel_traits<cpu>: vocab-parallel cross-entropy on the CPU backend, each rank a caller
// thread holding a communicator (parallel/inprocess_group.hpp, or any other).
//
// A call is the unsharded one (backend.hpp) cut at the exchange: each rank sweeps its shard's
// columns for every row (task_partials), merges its slices per row into one slice_partial, and
// all-gathers those records with one header; every rank merges the R records of each row in rank
// order and finishes the rows (finish_rows: the same losses, LSEs and argmax, bit for bit, on every
// rank), then writes its own shard of the gradient (write_gradient). Class-id backward needs no
// exchange (its row mass follows from the target's weight); soft-target backward exchanges the
// shards' target mass.
//
// The exchange buffer is allocated per call (header + N records per rank): unlike the unsharded
// calls, whose bookkeeping fits fixed arrays, it grows with N. (The fused linear calls,
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

/// The bytes one all-gather moves, in memory the caller provides: per rank a header, then one
/// slice_partial per row. Records are copied in and out with memcpy: the buffer is bytes, as the
/// collective sees it.
class exchange {
 public:
  /// `send` holds block(rows) bytes, `recv` ranks * block(rows).
  exchange(int ranks, std::int64_t rows, unsigned char* send, unsigned char* recv)
      : ranks_(ranks), rows_(rows), send_(send), recv_(recv) {}

  static std::size_t block(std::int64_t rows) {
    return sizeof(shard_header) + static_cast<std::size_t>(rows) * sizeof(slice_partial);
  }
  std::size_t block() const { return block(rows_); }
  void put_header(const shard_header& h) { std::memcpy(send_, &h, sizeof h); }
  void put(std::int64_t n, const slice_partial& p) { std::memcpy(send_ + offset(n), &p, sizeof p); }
  slice_partial get(int rank, std::int64_t n) const {
    slice_partial p;
    std::memcpy(&p, recv_ + static_cast<std::size_t>(rank) * block() + offset(n), sizeof p);
    return p;
  }
  shard_header header(int rank) const {
    shard_header h;
    std::memcpy(&h, recv_ + static_cast<std::size_t>(rank) * block(), sizeof h);
    return h;
  }
  const unsigned char* send() const { return send_; }
  unsigned char* recv() const { return recv_; }
  int ranks() const { return ranks_; }

 private:
  static std::size_t offset(std::int64_t n) {
    return sizeof(shard_header) + static_cast<std::size_t>(n) * sizeof(slice_partial);
  }
  int ranks_;
  std::int64_t rows_;
  unsigned char* send_;
  unsigned char* recv_;
};

/// Every rank declared the same vocabulary and the shards tile [0, V): sorted by first class, each
/// non-empty shard starts where the previous one ended and the last ends at V.
inline void check_tiling(const char* fn, const exchange& x) {
  const std::int64_t vocab = x.header(0).vocab;
  std::vector<shard_header> shards;
  for (int r = 0; r < x.ranks(); ++r) {
    const shard_header h = x.header(r);
    detail::require(h.vocab == vocab, fn, "shard.vocab", [&] {
      return "rank " + std::to_string(r) + " has " + std::to_string(h.vocab) +
             " classes, rank 0 has " + std::to_string(vocab);
    });
    if (h.cols > 0) shards.push_back(h);
  }
  std::sort(shards.begin(), shards.end(),
            [](const shard_header& a, const shard_header& b) { return a.first < b.first; });
  std::int64_t next = 0;
  for (const shard_header& h : shards) {
    detail::require(h.first == next, fn, "shard", [&] {
      return "the ranks' shards do not tile [0, " + std::to_string(vocab) + "): " +
             (h.first < next ? "classes from " + std::to_string(h.first) + " are in two shards"
                             : "classes [" + std::to_string(next) + ", " + std::to_string(h.first) +
                                   ") are in none");
    });
    next = h.first + h.cols;
  }
  detail::require(next == vocab, fn, "shard", [&] {
    return "the ranks' shards do not tile [0, " + std::to_string(vocab) + "): classes [" +
           std::to_string(next) + ", " + std::to_string(vocab) + ") are in none";
  });
}

/// Gathers every rank's records (record(n) for each local row) and checks the tiling. The
/// exchange's bytes are allocated in `storage`.
template <class Group, class Record>
exchange gather_rows(const char* fn, const Group& group, vocab_shard shard, std::int64_t rows,
                     std::int64_t cols, const Record& record, std::vector<unsigned char>& storage) {
  const std::size_t block = exchange::block(rows);
  storage.resize(block * static_cast<std::size_t>(group.size() + 1));
  exchange x(group.size(), rows, storage.data(), storage.data() + block);
  x.put_header(shard_header{shard.first, cols, shard.vocab, rows});
  for (std::int64_t n = 0; n < rows; ++n) x.put(n, record(n));
  group.all_gather(x.send(), x.recv(), block);
  check_tiling(fn, x);
  return x;
}

/// vocab-parallel forward, and forward_backward when `grad` is non-null.
template <bool Argmax, class Group, class T, class Tgt, class G>
void vp_run(const char* fn, const cpu& exec, const Group& group, matrix_view<const T> logits,
            vocab_shard shard, const Tgt& targets, const options& opts, const upstream* up,
            const forward_outputs& out, matrix_view<G> grad) {
  const problem<T, Tgt> pb = make_problem(exec, logits, targets, opts, shard);
  // Class ids are global and checked against V on every rank before the exchange; W likewise.
  const double normalizer = check_targets_and_weigh(fn, targets, shard.vocab, opts);
  const std::int64_t rows = logits.rows;
  const plan pl = make_plan(exec, rows, logits.cols);
  std::vector<slice_partial> parts(static_cast<std::size_t>(pl.tasks(rows)));
  task_partials<Argmax>(pl, pb, parts.data());
  auto local = [&](std::int64_t n, std::int64_t s) { return parts[n * pl.slices + s]; };
  std::vector<unsigned char> bytes;
  const exchange x = gather_rows(
      fn, group, shard, rows, logits.cols,
      [&](std::int64_t n) { return merge_pieces(local, n, pl.slices); }, bytes);

  totals sums;
  std::vector<float> lse(static_cast<std::size_t>(rows)), mass(static_cast<std::size_t>(rows));
  finish_rows(
      pb, group.size(),
      [&](std::int64_t n, std::int64_t r) { return x.get(static_cast<int>(r), n); }, out, sums,
      lse.data(), mass.data());
  if (grad.data)
    write_gradient(
        pl, pb, [&](std::int64_t n) { return lse[n]; }, [&](std::int64_t n) { return mass[n]; },
        make_row_scales(*up, opts, normalizer), grad);
  write_totals(sums, 1, opts, normalizer, out);
}

template <class Group, class T, class Tgt, class G>
void vp_backward(const cpu& exec, const Group& group, matrix_view<const T> logits,
                 vocab_shard shard, const Tgt& targets, const options& opts,
                 vector_view<const float> lse, const upstream& up, matrix_view<G> grad) {
  constexpr const char* fn = "xent::vocab_parallel_backward";
  const problem<T, Tgt> pb = make_problem(exec, logits, targets, opts, shard);
  const double normalizer = check_targets_and_weigh(fn, targets, shard.vocab, opts);
  const plan pl = make_plan(exec, logits.rows, logits.cols);
  const row_scales scale = make_row_scales(up, opts, normalizer);
  auto lse_of = [&](std::int64_t n) { return lse[n]; };
  if constexpr (problem<T, Tgt>::soft) {
    // sum_c w_c t'_c spans every shard: exchange each shard's part of it.
    std::vector<unsigned char> bytes;
    const exchange x = gather_rows(
        fn, group, shard, logits.rows, logits.cols,
        [&](std::int64_t n) {
          slice_partial p;
          p.stats.mass = soft_mass(pb, n);
          return p;
        },
        bytes);
    auto piece = [&](std::int64_t n, std::int64_t r) { return x.get(static_cast<int>(r), n); };
    write_gradient(
        pl, pb, lse_of,
        [&](std::int64_t n) { return merge_pieces(piece, n, group.size()).stats.mass; }, scale,
        grad);
  } else {
    write_gradient(
        pl, pb, lse_of, [&](std::int64_t n) { return row_mass(pb, n); }, scale, grad);
  }
}

/// vp_run with argmax tracked only when an output asks for it (as run_forward).
template <class Group, class T, class Tgt, class G>
void vp_forward(const char* fn, const cpu& exec, const Group& group, matrix_view<const T> logits,
                vocab_shard shard, const Tgt& targets, const options& opts, const upstream* up,
                const forward_outputs& out, matrix_view<G> grad) {
  if (out.argmax.data || out.num_correct)
    vp_run<true>(fn, exec, group, logits, shard, targets, opts, up, out, grad);
  else
    vp_run<false>(fn, exec, group, logits, shard, targets, opts, up, out, grad);
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
};

}  // namespace xent
