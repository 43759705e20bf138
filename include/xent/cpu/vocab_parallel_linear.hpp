// vocab_parallel_linear_traits<cpu>: vocab-parallel fused linear cross-entropy on the CPU, each
// rank a caller thread holding a communicator (parallel/inprocess_group.hpp, or any other).
//
// The steps of parallel/linear_chunks.hpp, made of what the single-device calls already have:
// the chunk's GEMMs, its buffers and the float d_weight / d_bias accumulators are cpu/linear.hpp's
// over this rank's weight shard; the records, their exchange, the tiling check, the rank-order
// merge and the gradient are cpu/vocab_parallel.hpp's and cpu/backend.hpp's over the chunk's float
// logits. The exchange lives in the caller's workspace, after the single-device buffers: a send
// block (the 32-byte header, then a record per row), R receive blocks, and per chunk row this
// shard's record and the row's merged LSE and target mass.
//
// Class ids are checked, and the mean's W summed over every row, before anything is written, on
// every rank alike (the targets are the same on every rank).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "../backend.hpp"
#include "../detail/validate.hpp"
#include "../linear/options.hpp"
#include "../linear/plan.hpp"
#include "../loss_math.hpp"
#include "../options.hpp"
#include "../parallel/linear_chunks.hpp"
#include "../parallel/shard.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "backend.hpp"
#include "cpu.hpp"
#include "linear.hpp"
#include "linear_panels.hpp"
#include "linear_plan.hpp"
#include "parallel.hpp"
#include "vocab_parallel.hpp"

namespace xent {
namespace cpu_detail {

/// A rank's workspace: the single-device call's buffers, then its chunk's exchange (offsets from
/// the same aligned base). In the low-memory order the single-device buffers are that order's
/// (cpu/linear_plan.hpp's low_memory_plan over this rank's shard: the statistics chunks, then the
/// panels, in one region), its statistics chunks are the exchange's, and each row's merged LSE and
/// target mass are kept for all N rows (the panels read them after the last exchange).
struct vp_linear_plan {
  linear_plan chunk;      ///< the exchange chunks' (the low-memory order's statistics chunks)
  low_memory_plan low;    ///< the low-memory order's buffers (when `panels`)
  bool panels = false;    ///< the low-memory order
  std::size_t send = 0;   ///< a block of chunk_rows records (record_layout::largest): this rank's
  std::size_t recv = 0;   ///< ranks blocks
  std::size_t parts = 0;  ///< chunk_rows records: this shard's statistics of each row
  std::size_t lse = 0;    ///< chunk_rows floats (N in the low-memory order): each row's merged LSE
  std::size_t mass = 0;   ///< as lse: each row's target mass
  std::size_t bytes = 0;
};

template <class T, class G>
vp_linear_plan make_vp_linear_plan(const cpu& exec, const linear_shape& s, int ranks,
                                   linear_pass pass, dw_accumulation accumulate, linear_order order,
                                   std::int64_t chunk_rows) {
  vp_linear_plan p;
  p.panels = pass == linear_pass::training && order == linear_order::low_memory;
  if (p.panels) {
    const std::int64_t rows =
        detail::panel_chunk_rows(chunk_rows, s.rows, s.vocab, panel_cols(exec, s.vocab));
    p.low = make_low_memory_plan<T, G>(exec, s, rows, chunk_rows);
    p.chunk = p.low.stats;
    p.lse = p.low.lse;
    p.mass = p.low.mass;
  } else {
    p.chunk = make_linear_plan<T, G>(exec, s, pass, accumulate, chunk_rows);
  }
  buffer_stack stack{p.panels ? p.low.end : p.chunk.end};
  const auto rows = static_cast<std::size_t>(chunk_rows);
  const std::size_t block = detail::exchange_block_bytes(chunk_rows, record_layout::largest());
  p.send = stack.take(block);
  p.recv = stack.take(block * static_cast<std::size_t>(ranks));
  p.parts = stack.take(sizeof(slice_partial) * rows);
  if (!p.panels) {
    p.lse = stack.take(sizeof(float) * rows);
    p.mass = stack.take(sizeof(float) * rows);
  }
  p.bytes = stack.bytes();
  return p;
}

/// The fused linear calls' names for a bad gathered header: their rows are hidden's.
constexpr header_names linear_headers{"shard.vocab", "shard", "hidden"};

/// One call on one rank: its buffers and the steps of a chunk (parallel/linear_chunks.hpp).
template <class T, class G, class Tgt>
class vp_linear_call {
  using mode = detail::vp_linear_mode;

 public:
  template <class Group>
  vp_linear_call(const char* fn, const cpu& exec, const Group&,
                 const detail::vp_linear_args<T, G, Tgt>& a, mode m)
      : fn_(fn),
        exec_(exec),
        a_(a),
        mode_(m),
        normalizer_(check_targets_and_weigh(fn, a.targets, a.shard.vocab, a.opts)),
        plan_(make_vp_linear_plan<T, G>(
            exec, {a.hidden.rows, a.hidden.cols, a.weight.rows}, a.ranks,
            m == mode::forward ? linear_pass::forward : linear_pass::training, a.opts.accumulate,
            a.opts.order, detail::planned_chunk_rows(a.ws.chunk_rows, a.hidden.rows))),
        // The low-memory order's chunks compute statistics only; its panels have calls of their
        // own.
        c_(make_linear_call(exec, a.hidden, a.weight, plan_.panels ? linear_grads<G>{} : a.grads,
                            a.opts.accumulate, plan_.chunk, a.ws.data)),
        bias_(float_bias(c_, a.bias)),
        call_(make_problem(exec, matrix_view<const float>{}, a.targets, a.opts, a.shard)),
        chunk_(call_),
        scales_(a.up ? make_row_scales(*a.up, a.opts, normalizer_) : row_scales<float>{}),
        argmax_(a.out.argmax.data || a.out.num_correct) {}
  vp_linear_call(const vp_linear_call&) = delete;
  vp_linear_call& operator=(const vp_linear_call&) = delete;

  /// L = X_c · W_shardᵀ (+ b_shard) in float; the chunk's problem for the core's sweeps.
  void logits(std::int64_t r0, std::int64_t n) {
    const const_rows_map x = float_rows(a_.hidden, r0, n, c_.buffer(plan_.chunk.x));
    x_ = x.data();
    x_ld_ = x.outerStride();
    rows_map l = logits_map(n);
    chunk_logits(c_, x, l, bias_);
    chunk_ = call_;
    chunk_.logits = matrix_view<const float>(l.data(), n, vocab(), vocab());
    chunk_.targets = detail::target_rows(a_.targets, r0, n);
  }

  /// This rank's header and one record per row of the chunk into the send block.
  detail::vp_block records(std::int64_t, std::int64_t n, detail::vp_records what) {
    exchange x = exchange_of(n, what);
    x.put_header(shard_header{a_.shard.first, vocab(), a_.shard.vocab, a_.hidden.rows});
    if (what == detail::vp_records::statistics) {
      const plan pl = make_plan(exec_, n, vocab());
      // One record per row, or per (row, slice) task when rows are fewer than threads (their
      // partials fit a fixed array, as in the unsharded calls).
      std::array<slice_partial, max_split_tasks> split;
      slice_partial* parts = pl.slices == 1 ? buffer<slice_partial>(plan_.parts) : split.data();
      std::uninitialized_fill_n(parts, pl.tasks(n), slice_partial{});  // ignored rows: empty
      if (argmax_)
        task_partials<true>(pl, chunk_, parts);
      else
        task_partials<false>(pl, chunk_, parts);
      auto local = [&](std::int64_t row, std::int64_t s) { return parts[row * pl.slices + s]; };
      for (std::int64_t row = 0; row < n; ++row) x.put(row, merge_pieces(local, row, pl.slices));
    } else if constexpr (problem<float, Tgt>::soft) {
      for (std::int64_t row = 0; row < n; ++row) {
        slice_partial p;
        p.stats.mass = soft_mass(chunk_, row);
        x.put(row, p);
      }
    }
    return {buffer<unsigned char>(plan_.send), buffer<unsigned char>(plan_.recv), x.block()};
  }

  /// Every rank's records of each row merged in rank order: the chunk's rows' outputs, and
  /// each row's LSE and target mass for its gradient (or, `mass`, the target mass alone).
  void merge(std::int64_t r0, std::int64_t n, detail::vp_records what) {
    const exchange x = exchange_of(n, what);
    check_tiling(fn_, x, linear_headers);
    check_rows(fn_, x, a_.hidden.rows, linear_headers);
    auto piece = [&](std::int64_t row, std::int64_t r) { return x.get(static_cast<int>(r), row); };
    // The low-memory order keeps every row's (its panels come after the last chunk).
    const std::int64_t at = plan_.panels ? r0 : 0;
    float* mass = buffer<float>(plan_.mass) + at;
    if (what == detail::vp_records::statistics) {
      forward_outputs o;
      o.row_loss = detail::rows_slice(a_.out.row_loss, r0, n);
      o.lse = detail::rows_slice(a_.out.lse, r0, n);
      o.argmax = detail::rows_slice(a_.out.argmax, r0, n);
      finish_rows(chunk_, a_.ranks, piece, o, sums_, buffer<float>(plan_.lse) + at, mass);
    } else {
      for (std::int64_t row = 0; row < n; ++row) mass[row] = merged_mass(x, row);
    }
  }

  /// The logit gradient over the chunk's logits, in place.
  void gradient(std::int64_t r0, std::int64_t n) {
    const plan pl = make_plan(exec_, n, vocab());
    const matrix_view<float> grad(logits_map(n).data(), n, vocab(), vocab());
    row_scales<float> scale = scales_;
    if (scale.rows) scale.rows += r0;
    const float* merged_lse = buffer<float>(plan_.lse);
    const float* mass = buffer<float>(plan_.mass);
    auto exchanged_mass = [&](std::int64_t row) { return mass[row]; };
    if (mode_ != mode::backward) {
      write_gradient(
          pl, chunk_, [&](std::int64_t row) { return merged_lse[row]; }, exchanged_mass, scale,
          grad);
      return;
    }
    auto saved_lse = [&](std::int64_t row) { return a_.lse[r0 + row]; };
    if constexpr (problem<float, Tgt>::soft)
      write_gradient(pl, chunk_, saved_lse, exchanged_mass, scale, grad);
    else
      write_gradient(
          pl, chunk_, saved_lse, [&](std::int64_t row) { return row_mass(chunk_, row); }, scale,
          grad);
  }

  /// d_weight and d_bias of this shard, and this rank's partial d_hidden rows.
  void accumulate(std::int64_t r0, std::int64_t n) {
    start();
    const const_rows_map x(x_, n, a_.hidden.cols, Eigen::OuterStride<>(x_ld_));
    const rows_map g = logits_map(n);
    chunk_weight_grads(c_, x, g);
    chunk_hidden_grads(c_, g, r0);
  }

  /// The low-memory order's panels over this rank's shard (cpu/linear_panels.hpp's run_panels)
  /// from every row's LSE and target mass: merged by the chunks' exchanges, or the saved LSE and,
  /// for class ids, each row's mass from its target's weight (soft targets exchanged it).
  void panels() {
    float* mass = buffer<float>(plan_.mass);
    const float* lse = buffer<float>(plan_.lse);
    if (mode_ == mode::backward) {
      lse = a_.lse.data;
      if constexpr (!problem<float, Tgt>::soft)
        target_masses(
            exec_,
            make_problem(exec_, matrix_view<const float>(nullptr, a_.hidden.rows, vocab(), vocab()),
                         a_.targets, a_.opts, a_.shard),
            mass);
    }
    run_panels(exec_, plan_.low, a_.ws.data, a_.hidden, a_.weight, a_.bias, a_.targets, a_.opts,
               a_.shard, lse, mass, scales_, a_.grads);
  }

  void finish() {
    if (mode_ != mode::forward && !plan_.panels) {
      start();  // no rows: zero gradients
      finish_grads(c_);
    }
    if (mode_ != mode::backward) write_totals(sums_, 1, a_.opts, normalizer_, a_.out);
  }

 private:
  /// Zeroes what the chunks add to, once, when the first chunk's gradient is ready: after the
  /// first exchange, whose checks (the tiling, the ranks' rows) come before anything is written.
  void start() {
    if (started_) return;
    start_grads(c_);
    started_ = true;
  }
  std::int64_t vocab() const { return a_.weight.rows; }
  template <class U>
  U* buffer(std::size_t offset) const {
    return reinterpret_cast<U*>(c_.base + offset);
  }
  rows_map logits_map(std::int64_t n) const {
    return rows_map(c_.buffer(plan_.chunk.logits), n, vocab(), Eigen::OuterStride<>(vocab()));
  }
  /// A chunk of n rows: its records carry what `what` needs (parallel/records.hpp).
  exchange exchange_of(std::int64_t n, detail::vp_records what) const {
    const record_layout layout =
        what == detail::vp_records::mass
            ? record_layout::mass_only()
            : record_layout::statistics(problem<float, Tgt>::soft, a_.opts, argmax_);
    return exchange(a_.ranks, n, layout, buffer<unsigned char>(plan_.send),
                    buffer<unsigned char>(plan_.recv));
  }

  const char* fn_;
  const cpu& exec_;
  detail::vp_linear_args<T, G, Tgt> a_;
  mode mode_;
  double normalizer_;  // first: the class ids are checked before anything is written
  vp_linear_plan plan_;
  linear_call<T, G> c_;
  const float* bias_;
  problem<float, Tgt> call_;   ///< the call's constants (no logits yet)
  problem<float, Tgt> chunk_;  ///< the chunk's: its logits and targets
  row_scales<float> scales_;
  bool argmax_;
  bool started_ = false;
  totals sums_;
  const float* x_ = nullptr;  ///< the chunk's hidden rows in float, x_ld_ apart
  std::int64_t x_ld_ = 0;
};

}  // namespace cpu_detail

template <>
struct vocab_parallel_linear_traits<cpu> {
  /// The single-device call's bytes (cpu/linear_plan.hpp) for this rank's shard, plus the
  /// chunk's exchange: (R + 1) blocks of a 32-byte header and at most 32 bytes per row
  /// (record_layout::largest), and 48 bytes per row of this shard's slice_partials, LSE and
  /// target mass.
  template <class T, class G>
  static std::size_t workspace_bytes(const cpu& exec, const linear_shape& shape, int ranks,
                                     linear_pass pass, dw_accumulation accumulate,
                                     linear_order order, std::int64_t chunk_rows) {
    return cpu_detail::make_vp_linear_plan<T, G>(exec, shape, ranks, pass, accumulate, order,
                                                 chunk_rows)
        .bytes;
  }

  template <class T, class G, class Tgt>
  using call = cpu_detail::vp_linear_call<T, G, Tgt>;
};

}  // namespace xent
