// The low-memory order of fused linear cross-entropy on the CPU (linear_order::low_memory): the
// vocabulary outer, so that no V x D buffer exists.
//   1. forward_backward only: the fast order's forward over row chunks (linear_rows.hpp), writing
//      the outputs and each row's LSE into the workspace (linear_backward is given the LSE);
//   2. each row's target mass: from the target's class weight, or summed over the soft targets;
//   3. per panel of weight rows, its rows in sub-chunks: L = X_c · W_panelᵀ (+ b), the logit
//      gradient of the panel from each row's LSE and mass (the vocab-parallel gradient of a shard,
//      cpu/backend.hpp's write_gradient), d_weight[panel] += Gᵀ · X_c and d_bias[panel] += column
//      sums in a panel-sized float sum (d_weight itself when float), d_hidden rows += G · W_panel
//      into an N x D float sum (d_hidden itself when float); after the panel's last sub-chunk its
//      d_weight and d_bias rows are rounded, once.
// Every sum is in float (double for double inputs) and each output is rounded once, as in the
// fast order. With linear_options::sparse_threshold, step 3 skips cold tiles (linear_sparse.hpp),
// in forward_backward their logits too (step 1 marks each row's cold weight blocks). Step 3
// (run_panels) is also the vocab-parallel calls' over a rank's shard
// (cpu/vocab_parallel_linear.hpp), from the LSE and mass their exchanges merged.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../linear/options.hpp"
#include "../loss_math.hpp"
#include "../options.hpp"
#include "../parallel/shard.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "backend.hpp"
#include "cpu.hpp"
#include "linear_plan.hpp"
#include "linear_rows.hpp"
#include "linear_sparse.hpp"
#include "linear_steps.hpp"
#include "parallel.hpp"

namespace xent {
namespace cpu_detail {

/// Each row's target mass, sum_c w_c t'_c over the whole vocabulary, where every class of it is
/// at hand: from the target's class weight (class ids, global: `whole` may be a shard's problem),
/// or summed over the soft targets (`whole` the whole vocabulary's). 0 on ignored rows.
template <class A, class Tgt>
void target_masses(const cpu& exec, const problem<A, Tgt>& whole, A* mass) {
  const std::int64_t N = whole.logits.rows, V = whole.logits.cols;
  const int threads = std::min(std::max(exec.threads, 1), max_threads);
  parallel_for(N * V < policy::min_parallel_elements ? 1 : threads, N,
               [&](std::int64_t a, std::int64_t b, int) {
                 for (std::int64_t n = a; n < b; ++n)
                   mass[n] = whole.ignored(n) ? A(0) : row_mass(whole, n);
               });
}

/// Step 3 over the weight rows of `weight`, classes [shard.first, shard.first + weight.rows) of
/// shard.vocab ({0, V} on one device; a rank's shard in the vocab-parallel calls, whose d_hidden
/// is then its partial): each panel's logits for every row from each row's LSE and mass (N of
/// each, over the whole vocabulary), its d_weight and d_bias rows written once, d_hidden summed
/// in `plan.panel`'s N x D float buffer (d_hidden itself when float) and rounded once at the end.
/// `ws` is the call's workspace, laid out by `plan`; class ids were checked by the caller. With a
/// sparse threshold (one device only), `cold_rows` holds the rows' cold weight blocks that the
/// statistics pass marked (null: tiles are marked from the panels' logits).
template <class T, class G, class Tgt, class A>
void run_panels(const cpu& exec, const low_memory_plan& plan, void* ws, matrix_view<const T> hidden,
                matrix_view<const T> weight, vector_view<const T> bias, const Tgt& targets,
                const linear_options& opts, vocab_shard shard, const A* lse, const A* mass,
                const row_scales<A>& scales, const linear_grads<G>& grads,
                const unsigned char* cold_rows = nullptr) {
  const std::int64_t N = hidden.rows, D = hidden.cols, V = weight.rows;
  const bool sparse = opts.sparse_threshold > 0.0f;
  const linear_call<T, G> region =
      make_linear_call(exec, hidden, weight, grads, dw_accumulation::fp32, plan.panel, ws);
  // The problem of the shard (its loss constants span the whole vocabulary); each panel's is it
  // shifted to the panel's first class, as a vocab-parallel shard's.
  const problem<A, Tgt> whole =
      make_problem(exec, matrix_view<const A>(nullptr, N, V, V), targets, opts, shard);
  const A log_tau = std::log(static_cast<A>(opts.sparse_threshold));
  const std::int64_t all_blocks = (V + linear_block_rows - 1) / linear_block_rows;
  // Tiles' gradients are written without smoothing's rank-1 term, which is added whole.
  const smoothing_term<A> smoothing =
      sparse ? make_smoothing_term(hidden, weight, whole, scales, region.buffer(plan.smooth))
             : smoothing_term<A>{};
  linear_sparse_counts counts;

  // d_hidden's sum over the panels: d_hidden itself when it is the accumulator type.
  A* dx = nullptr;
  std::int64_t ldx = D;
  if (grads.d_hidden.data) {
    if constexpr (std::is_same<G, A>::value) {
      dx = grads.d_hidden.data;
      ldx = grads.d_hidden.ld;
    } else {
      dx = region.buffer(plan.panel.dx);
    }
    for (std::int64_t n = 0; n < N; ++n) std::fill_n(dx + n * ldx, D, A(0));
  }

  for (std::int64_t v0 = 0; v0 < V; v0 += plan.cols) {
    const std::int64_t nb = std::min(plan.cols, V - v0);
    const linear_call<T, G> c =
        make_linear_call(exec, hidden, detail::panel_rows(weight, v0, nb),
                         detail::panel_grads(grads, v0, nb), dw_accumulation::fp32, plan.panel, ws);
    const A* bias_f = float_bias(c, detail::panel_slice(bias, v0, nb));
    start_grads(c);
    problem<A, Tgt> pb = whole;
    pb.weights = whole.weights ? whole.weights + v0 : nullptr;
    pb.first_class = whole.first_class + v0;
    if (smoothing.s) pb.k.smooth = A(0);
    for (std::int64_t r0 = 0; r0 < N; r0 += plan.panel.chunk_rows) {
      const std::int64_t n = std::min(plan.panel.chunk_rows, N - r0);
      const const_acc_rows_map<A> x = float_rows(hidden, r0, n, c.buffer(plan.panel.x));
      A* tile = c.buffer(plan.panel.logits);
      acc_rows_map<A> logits(tile, n, nb, Eigen::OuterStride<>(nb));
      pb.logits = matrix_view<const A>(tile, n, nb, nb);
      pb.targets = detail::panel_targets(targets, r0, n, v0, nb);
      row_scales<A> scale = scales;
      if (scale.rows) scale.rows += r0;
      const auto lse_of = [&](std::int64_t row) { return lse[r0 + row]; };
      const auto mass_of = [&](std::int64_t row) { return mass[r0 + row]; };
      if (sparse) {
        const sparse_tiles t{reinterpret_cast<unsigned char*>(c.base + plan.hot), n,
                             (n + sparse_tile_rows - 1) / sparse_tile_rows, c.blocks()};
        if (cold_rows) {
          mark_tiles_from_rows(t, cold_rows + r0 * all_blocks, all_blocks, v0 / linear_block_rows);
          sparse_logits(c, x, logits, bias_f, t);
        } else {
          chunk_logits(c, x, logits, bias_f);
          mark_tiles_from_logits(c, pb, lse_of, log_tau, t);
        }
        counts.tiles += t.row_tiles * t.blocks;
        counts.skipped += t.cold();
        write_hot_gradients(c, pb, lse_of, mass_of, scale, t, matrix_view<A>(tile, n, nb, nb));
        sparse_weight_grads(c, x, logits, t);
        if (dx) sparse_hidden_grads(c, logits, t, dx, ldx, r0);
        continue;
      }
      chunk_logits(c, x, logits, bias_f);
      write_gradient(make_plan(exec, n, nb), pb, lse_of, mass_of, scale,
                     matrix_view<A>(tile, n, nb, nb));

      chunk_weight_grads(c, x, logits);
      if (dx)
        parallel_for(c.threads(n), n, [&](std::int64_t a, std::int64_t b, int worker) {
          acc_rows_map<A> rows(dx + (r0 + a) * ldx, b - a, D, Eigen::OuterStride<>(ldx));
          add_grad_times_weight(c, logits, a, b, rows, worker);
        });
    }
    add_smoothing_to_panel(c, smoothing, whole, v0);
    finish_grads(c);
  }
  add_smoothing_to_hidden(smoothing, whole, scales, dx, ldx);
  if (sparse && opts.sparse_counts) *opts.sparse_counts = counts;
  if constexpr (!std::is_same<G, A>::value)
    if (dx)
      for (std::int64_t n = 0; n < N; ++n) convert(dx + n * D, D, grads.d_hidden.row(n));
}

/// A training call in the low-memory order. `saved_lse` is linear_backward's (null:
/// forward_backward, which computes each row's LSE and writes `out`).
template <class T, class G, class Tgt, class A>
void run_low_memory(const char* fn, const cpu& exec, matrix_view<const T> hidden,
                    matrix_view<const T> weight, vector_view<const T> bias, const Tgt& targets,
                    const linear_options& opts, const basic_upstream<A>& up,
                    const vector_view<const A>* saved_lse, const basic_forward_outputs<A>& out,
                    const linear_grads<G>& grads, const linear_workspace& ws) {
  const std::int64_t N = hidden.rows, D = hidden.cols, V = weight.rows;
  // Class ids are checked, and the mean's W summed over every row, before anything is written.
  const double normalizer = check_targets_and_weigh(fn, targets, V, opts);
  const bool sparse = opts.sparse_threshold > 0.0f;
  const low_memory_plan plan = plan_low_memory<T, G>(exec, {N, D, V}, ws.bytes, sparse);
  // The panel plan's call lays out the region from the aligned base; its base locates the rest.
  const linear_call<T, G> region =
      make_linear_call(exec, hidden, weight, grads, dw_accumulation::fp32, plan.panel, ws.data);
  A* mass = region.buffer(plan.mass);
  const A* lse = saved_lse ? saved_lse->data : region.buffer(plan.lse);
  const problem<A, Tgt> whole =
      make_problem(exec, matrix_view<const A>(nullptr, N, V, V), targets, opts, {0, V});
  // The sparse backward (linear_sparse.hpp). forward_backward marks each row's cold weight blocks
  // from the statistics pass's logits, so a panel computes only its hot tiles' logits;
  // linear_backward marks tiles from the panel's logits.
  const A log_tau = std::log(static_cast<A>(opts.sparse_threshold));
  const std::int64_t all_blocks = (V + linear_block_rows - 1) / linear_block_rows;
  unsigned char* const cold_rows =
      sparse && !saved_lse ? reinterpret_cast<unsigned char*>(region.base + plan.cold) : nullptr;
  if (!saved_lse) {
    basic_forward_outputs<A> o = out;
    o.lse = vector_view<A>(region.buffer(plan.lse), N);
    const linear_call<T, G> stats = make_linear_call(exec, hidden, weight, linear_grads<G>{},
                                                     dw_accumulation::fp32, plan.stats, ws.data);
    const auto mark = [&](std::int64_t r0, const matrix_view<A>& chunk) {
      if (!cold_rows) return;
      problem<A, Tgt> pb = whole;
      pb.logits = matrix_view<const A>(chunk);
      pb.targets = detail::target_rows(targets, r0, chunk.rows);
      mark_cold_rows(
          stats, pb, [&](std::int64_t row) { return lse[r0 + row]; }, log_tau,
          cold_rows + r0 * all_blocks);
    };
    run_row_chunks<linear_mode::forward>(stats, bias, targets, opts,
                                         static_cast<const basic_upstream<A>*>(nullptr),
                                         vector_view<const A>{}, o, normalizer, mark);
    if (out.lse.data) std::copy_n(lse, N, out.lse.data);
  }
  target_masses(exec, whole, mass);
  run_panels(exec, plan, ws.data, hidden, weight, bias, targets, opts, vocab_shard{0, V}, lse, mass,
             make_row_scales(up, opts, normalizer), grads, cold_rows);
}

}  // namespace cpu_detail
}  // namespace xent
