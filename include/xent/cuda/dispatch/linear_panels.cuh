// The low-memory order of fused linear cross-entropy on one GPU (linear_order::low_memory): the
// vocabulary outer, so that no V x D buffer exists. Every step on exec.stream:
//   1. forward_backward only: linear.cuh's forward over row chunks (the Hopper statistics GEMM
//      where it applies), its outputs written and each row's LSE into the workspace
//      (linear_backward is given the LSE);
//   2. the prologue (the mean's W, each row's upstream gradient) and, for soft targets, each row's
//      target mass over the whole vocabulary (soft_mass_kernel);
//   3. per panel of weight rows, its rows in sub-chunks: L = X_c · W_panelᵀ (+ b) by cuBLAS into
//      the workspace in T; the panel's logit gradient in place from each row's LSE and mass (the
//      row kernel's backward pass over a vocabulary shard, vocab_parallel.cuh's vp_gradient);
//      d_weight[panel] and d_bias[panel] by linear_call.cuh's chunk_grads (written by the GEMM
//      straight into d_weight when one sub-chunk holds every row, else summed in a panel-sized
//      float accumulator and rounded once); d_hidden += G · W_panel with a float C, the N x D float
//      sum (d_hidden itself when float), rounded once into d_hidden after the last panel.
// The statistics and panel buffers share one region of the workspace (one runs after the other on
// the stream); the rows' LSE, mass and d_hidden sum follow it. Step 3 (run_panels) is also the
// vocab-parallel calls' over a rank's shard (dispatch/vocab_parallel_linear.cuh), from the LSE
// and mass their exchanges merged. With a sparse threshold (one device only) the sub-chunks run
// linear_sparse.cuh's steps around the gradient pass.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../linear/options.hpp"
#include "../../linear/plan.hpp"
#include "../../loss_math.hpp"
#include "../../options.hpp"
#include "../../parallel/shard.hpp"
#include "../../targets.hpp"
#include "../../views.hpp"
#include "../cuda.cuh"
#include "../kernels/linear_kernels.cuh"
#include "../runtime.cuh"
#include "cublas.cuh"
#include "linear.cuh"
#include "linear_call.cuh"
#include "linear_plan.cuh"
#include "linear_sparse.cuh"
#include "rows.cuh"
#include "vocab_parallel.cuh"

namespace xent {
namespace cuda_detail {

/// Panel widths are whole multiples of 256 weight rows (unless the panel is the whole
/// vocabulary): the panel's columns are the M of its logits GEMM and the N of its d_weight GEMM,
/// which cuBLAS's sm_90 tensor-core kernels tile by 128 or 256, and its weight rows then start at
/// 512-byte multiples of D.
constexpr std::int64_t linear_panel_tile = 256;

/// The narrowest panel a plan takes: each panel's GEMMs reduce over (or span) its P columns, and
/// each panel reads and writes d_hidden's N x D float sum once (2 x 4 N D bytes, 256 MiB at
/// N = 8192, D = 4096: 63 us at the H200's ~4.25 TB/s copy roof), so narrower panels trade
/// workspace for that traffic; below 1024 columns it passes a tenth of the GEMMs' time at the
/// shapes of docs/design.md. Not tuned by measurement yet.
constexpr std::int64_t linear_panel_min_cols = 1024;

/// The narrowest panel of a vocabulary of `vocab` classes (at least one weight row).
inline std::int64_t narrowest_panel(std::int64_t vocab) {
  return std::max<std::int64_t>(1, std::min(vocab, linear_panel_min_cols));
}

/// The most rows a panel sub-chunk takes: cuBLAS's int dimensions, in whole 128-row tiles.
constexpr std::int64_t panel_most_rows = std::int64_t{INT_MAX} / 128 * 128;

/// The low-memory order's workspace: the statistics' plan and a panel's plan from the same aligned
/// base, then each row's LSE and target mass and d_hidden's float sum.
struct low_memory_plan {
  linear_plan stats;  ///< the forward over row chunks of the whole vocabulary
  linear_plan panel;  ///< a panel of `cols` weight rows, panel.chunk_rows rows at a time
  std::int64_t cols = 1;
  std::size_t lse = linear_absent;
  std::size_t mass = linear_absent;
  std::size_t dx = linear_absent;     ///< N x D floats (G not float)
  std::size_t flags = linear_absent;  ///< the sparse backward's tile flags (linear_sparse.cuh)
  std::size_t hot = linear_absent;    ///< and a panel sub-chunk's list of hot tiles
  std::size_t end = 0;                ///< the end of the last buffer, from the aligned base
  std::size_t bytes = 0;
};

/// Panels of `cols` weight rows (clamped to [1, V]) in sub-chunks of `rows` rows. One sub-chunk of
/// every row writes d_weight[panel] from its GEMM's float sum (dw_accumulation::output's buffers:
/// none for G = T); fewer rows sum the panel in float (dw_accumulation::fp32's, P x D floats). The
/// panel keeps no d_hidden rows (run_panels sums d_hidden in `dx`). The statistics take
/// `stats_rows` rows (the vocab-parallel calls' exchange chunks), or by default as many as the
/// same logits bytes hold over the whole vocabulary. `sparse` adds the sparse backward's flags.
template <class T, class G>
low_memory_plan make_low_memory_plan(const linear_shape& s, std::int64_t rows, std::int64_t cols,
                                     std::int64_t stats_rows = -1, bool sparse = false) {
  constexpr bool narrow_grads = !std::is_same<device_t<G>, float>::value;
  low_memory_plan p;
  p.cols = std::max<std::int64_t>(1, std::min(cols, s.vocab));
  const bool every_row = rows >= s.rows;
  p.panel = make_linear_plan<T, G>({s.rows, s.hidden, p.cols}, linear_pass::training,
                                   every_row ? dw_accumulation::output : dw_accumulation::fp32,
                                   rows, false, false, false);
  if (stats_rows < 0)
    stats_rows = std::max<std::int64_t>(
        1, std::min(s.rows, rows * p.cols / std::max<std::int64_t>(s.vocab, 1)));
  p.stats = make_linear_plan<T, G>(s, linear_pass::forward, dw_accumulation::fp32, stats_rows,
                                   false, false);
  aligned_layout at{std::max(p.panel.end, p.stats.end)};
  const auto N = static_cast<std::size_t>(s.rows), D = static_cast<std::size_t>(s.hidden);
  p.lse = at.take(sizeof(float) * N);
  p.mass = at.take(sizeof(float) * N);
  p.dx = at.take(sizeof(float) * N * D, narrow_grads);
  p.flags =
      at.take(static_cast<std::size_t>(sparse_row_tiles(s.rows) * sparse_blocks(s.vocab)), sparse);
  p.hot = at.take(sizeof(int) * static_cast<std::size_t>(
                                    sparse_list_ints(std::min(p.panel.chunk_rows, s.rows), p.cols)),
                  sparse);
  p.end = at.end;
  p.bytes = at.end + linear_alignment;
  return p;
}

/// The plan of the widest panel of at most `most_cols` weight rows (whole linear_panel_tile
/// multiples from the narrowest, or the whole vocabulary) whose one sub-chunk of every row fits
/// `budget` bytes; where none does, the narrowest panel's plan with the largest sub-chunks that
/// fit (within cuBLAS's int rows, whole 128-row tiles where that stays within them), or its
/// one-row plan. Wider panels need more bytes (N x P logits) and fewer passes over d_hidden's
/// float sum, so the widest that fits is the fastest; splitting rows instead costs a P x D float
/// d_weight panel and smaller GEMMs, so it is the last resort.
template <class T, class G>
low_memory_plan plan_low_memory(const linear_shape& s, std::size_t budget,
                                std::int64_t most_cols = INT64_MAX, bool sparse = false) {
  const std::int64_t narrowest = narrowest_panel(s.vocab);
  if (s.rows > 0 && s.rows <= panel_most_rows) {
    // Widths narrowest + (i - 1) tiles, the last one the whole vocabulary (i = 1, 2, ...).
    const std::int64_t widest = std::max(narrowest, std::min(s.vocab, most_cols));
    const std::int64_t widths =
        1 + (widest - narrowest + linear_panel_tile - 1) / linear_panel_tile;
    const low_memory_plan whole = detail::largest_chunk_plan(widths, budget, [&](std::int64_t i) {
      return make_low_memory_plan<T, G>(
          s, s.rows, std::min(widest, narrowest + (i - 1) * linear_panel_tile), -1, sparse);
    });
    if (whole.bytes <= budget) return whole;
  }
  // One sub-chunk of every row needs no float panel of d_weight, so it can take fewer bytes than
  // a split just below it: the search over rows is monotonic only below every row, which did not
  // fit.
  const low_memory_plan p =
      detail::largest_chunk_plan(std::min(s.rows, panel_most_rows), budget, [&](std::int64_t rows) {
        return make_low_memory_plan<T, G>(s, rows, narrowest, -1, sparse);
      });
  const std::int64_t rows = gemm_friendly_rows(s.rows, p.panel.chunk_rows);
  return rows == p.panel.chunk_rows ? p
                                    : make_low_memory_plan<T, G>(s, rows, narrowest, -1, sparse);
}

/// The fewest bytes a low-memory call accepts: the narrowest panel's one-row plan, or its plan of
/// every row where that is smaller (no float panel of d_weight and no cuBLASLt workspace, which
/// at small N and D outweigh N rows of logits). plan_low_memory takes either.
template <class T, class G>
std::size_t least_low_memory_bytes(const linear_shape& s, bool sparse = false) {
  const std::int64_t narrowest = narrowest_panel(s.vocab);
  const std::size_t one = make_low_memory_plan<T, G>(s, 1, narrowest, -1, sparse).bytes;
  if (s.rows < 1 || s.rows > panel_most_rows) return one;
  return std::min(one, make_low_memory_plan<T, G>(s, s.rows, narrowest, -1, sparse).bytes);
}

/// The plan a size query answers for `budget` bytes: the widest panel of every row whose whole
/// workspace fits the budget, when one does. The order promises a bound on its memory beyond the
/// gradients, so the budget (256 MiB by default) holds the N x D float sum too. Where even the
/// narrowest such panel passes it (the float sum alone can: 4 N D grows with N), the narrowest
/// panel's plan within the budget on top of the buffers every sub-chunk needs, as the fast
/// order's query plans (detail::chunk_budget). A call given the bytes answered plans the same.
template <class T, class G>
low_memory_plan query_low_memory(const linear_shape& s, std::size_t budget, bool sparse = false) {
  const low_memory_plan p = plan_low_memory<T, G>(s, budget, INT64_MAX, sparse);
  if (p.bytes <= budget && p.panel.chunk_rows >= s.rows) return p;
  const std::int64_t narrowest = narrowest_panel(s.vocab);
  const low_memory_plan fixed = make_low_memory_plan<T, G>(s, 0, narrowest, -1, sparse);
  return plan_low_memory<T, G>(s, detail::chunk_budget(fixed.bytes, budget), narrowest, sparse);
}

/// The device targets of rows [r0, r0 + n) for the panel's columns from v0 (soft targets: the
/// panel's columns, as a vocab-parallel shard's).
template <class Tgt>
auto panel_device_targets(const Tgt& targets, std::int64_t r0, std::int64_t n, std::int64_t v0,
                          std::int64_t nb) {
  return device_targets(detail::panel_targets(targets, r0, n, v0, nb));
}

/// Step 3 over the weight rows of `weight`, classes [shard.first, shard.first + weight.rows) of
/// shard.vocab ({0, V} on one device; a rank's shard in the vocab-parallel calls, whose d_hidden
/// is then its partial), in the workspace `ws` laid out by `plan`: the call's prologue (the mean's
/// W over the whole vocabulary's targets, each row's upstream gradient), then each panel from
/// every row's LSE and, for soft targets, mass (device arrays of N floats). `error_count` counts
/// rows of out-of-range class ids in the first panel (null: counted before). `sp`: the sparse
/// backward's state (empty: exact).
template <class T, class G, class Tgt>
void run_panels(const char* fn, const cuda& exec, const cublas_scope& blas,
                const low_memory_plan& plan, void* ws, matrix_view<const T> hidden,
                matrix_view<const T> weight, vector_view<const T> bias, const Tgt& targets,
                const linear_options& opts, vocab_shard shard, const float* lse, const float* mass,
                const upstream* up, const linear_grads<G>& grads, int* error_count,
                const sparse_state& sp = {}) {
  using DT = device_t<T>;
  using DG = device_t<G>;
  const std::int64_t N = hidden.rows, D = hidden.cols, V = weight.rows;
  const cudaStream_t s = exec.stream;
  // Every panel's call sees d_weight and d_bias rows of its own and no d_hidden (summed here).
  linear_grads<G> weight_grads = grads;
  weight_grads.d_hidden = {};
  const linear_call<T, G> whole =
      make_linear_call(exec, blas, hidden, weight, bias, weight_grads, plan.panel, ws);
  const linear_totals totals =
      start_totals(fn, whole, device_targets(targets), N, shard.vocab, opts, up, nullptr);

  // d_hidden's float sum over the panels: d_hidden itself when it is float.
  float* dx = nullptr;
  std::int64_t ldx = D;
  if (grads.d_hidden.data) {
    if constexpr (std::is_same<DG, float>::value) {
      dx = reinterpret_cast<float*>(grads.d_hidden.data);
      ldx = grads.d_hidden.ld;
    } else {
      dx = whole.template buffer<float>(plan.dx);
    }
    if (V == 0) zero_matrix(fn, grads.d_hidden.data, N, D, grads.d_hidden.ld, s);
  }

  options core = opts;
  core.reduce = reduction::none;  // each sub-chunk's rows; W and the reduction are the call's
  for (std::int64_t v0 = 0; v0 < V; v0 += plan.cols) {
    const std::int64_t nb = std::min(plan.cols, V - v0);
    const linear_call<T, G> c = make_linear_call(
        exec, blas, hidden, detail::panel_rows(weight, v0, nb), detail::panel_slice(bias, v0, nb),
        detail::panel_grads(grads, v0, nb), plan.panel, ws);
    for (std::int64_t r0 = 0; r0 < N; r0 += plan.panel.chunk_rows) {
      const std::int64_t n = std::min(plan.panel.chunk_rows, N - r0);
      const matrix_view<T> tile(reinterpret_cast<T*>(c.logits()), n, nb, plan.panel.ld);
      const vocab_shard panel{shard.first + v0, shard.vocab};
      const auto panel_targets = panel_device_targets(targets, r0, n, v0, nb);
      const upstream panel_up = chunk_upstream(up, opts, totals, r0, n);
      int* const errors = v0 == 0 ? error_count : nullptr;
      if constexpr (!detail::target_traits<Tgt>::soft) {
        if (sp && sp.marked) {  // the hot tiles' GEMM forms their gradient: no logits stored
          sparse_gradient(c, sp, v0, r0, n,
                          gradient_args(exec, matrix_view<const T>(tile), panel, panel_targets,
                                        core, lse + r0, nullptr, panel_up, tile, errors));
          count_tiles(fn, sp, r0, n, v0, nb, s);
          sparse_grads(c, sp, v0, r0, n, r0 == 0, dx, ldx, v0 == 0);
          continue;
        }
      }
      chunk_logits(c, r0, n);
      if constexpr (!detail::target_traits<Tgt>::soft) {
        if (sp) {
          clear_flags(fn, sp, r0, n, s);
          mark_tiles(fn, sp, static_cast<const DT*>(c.logits()), plan.panel.ld, n, nb, lse + r0,
                     panel_targets.ids, opts.ignore_index, r0, v0, s);
        }
      }
      if (sp) count_tiles(fn, sp, r0, n, v0, nb, s);
      vp_gradient(fn, exec, matrix_view<const T>(tile), panel, panel_targets, core, lse + r0,
                  mass ? mass + r0 : nullptr, panel_up, tile, errors);
      if (sp) {
        sparse_grads(c, sp, v0, r0, n, r0 == 0, dx, ldx, v0 == 0);
        continue;
      }
      chunk_grads(c, r0, n, r0 == 0, c.hidden_row(r0), c.hidden.ld);
      if (dx)
        gemm(blas, s, CUBLAS_OP_N, CUBLAS_OP_N, D, n, nb, c.weight.data, c.weight.ld, c.logits(),
             plan.panel.ld, v0 == 0 ? 0.0f : 1.0f, dx + r0 * ldx, CUDA_R_32F, sizeof(float), ldx);
    }
    finish_grads(c);
  }
  if constexpr (!std::is_same<DG, float>::value)
    if (dx && V > 0)
      launch_round(
          round_op<DG>{dx, D, reinterpret_cast<DG*>(grads.d_hidden.data), grads.d_hidden.ld}, N, D,
          s);
  check_cuda(fn, cudaGetLastError());
}

/// A training call in the low-memory order. `saved_lse` is linear_backward's (null:
/// forward_backward, which computes each row's LSE and writes `out`).
template <class T, class G, class Tgt>
void run_low_memory(const char* fn, const cuda& exec, matrix_view<const T> hidden,
                    matrix_view<const T> weight, vector_view<const T> bias, const Tgt& targets,
                    const linear_options& opts, const upstream& up,
                    const vector_view<const float>* saved_lse, const forward_outputs& out,
                    const linear_grads<G>& grads, const linear_workspace& ws) {
  constexpr bool soft = detail::target_traits<Tgt>::soft;
  const std::int64_t N = hidden.rows, D = hidden.cols, V = weight.rows;
  const bool sparse = opts.sparse_threshold > 0.0f;
  const low_memory_plan plan = plan_low_memory<T, G>({N, D, V}, ws.bytes, INT64_MAX, sparse);
  check_linear_call(fn, exec, hidden, weight, grads, plan.panel);
  const device_facts dev =
      sparse ? check_sparse<T, G, Tgt>(fn, hidden, weight, opts, plan.panel.dw_block != 0,
                                       plan.panel.chunk_rows, plan.cols)
             : device_facts{};
  const cudaStream_t s = exec.stream;

  // Buffers at plan offsets from the workspace's first 256-byte-aligned address, as every call's.
  const std::uintptr_t address = reinterpret_cast<std::uintptr_t>(ws.data);
  char* const base =
      static_cast<char*>(ws.data) +
      ((address + linear_alignment - 1) / linear_alignment * linear_alignment - address);
  float* const row_lse = reinterpret_cast<float*>(base + plan.lse);
  float* const mass = reinterpret_cast<float*>(base + plan.mass);
  // The sparse backward's flags: marked by the statistics pass (forward_backward) or by each panel
  // sub-chunk from its logits (linear_backward).
  sparse_state sp;
  if (sparse) {
    sp.flags = reinterpret_cast<unsigned char*>(base + plan.flags);
    sp.list = reinterpret_cast<int*>(base + plan.hot);
    sp.sms = dev.sms;
    sp.ld = sparse_blocks(V);
    sp.log_tau = std::log(opts.sparse_threshold);
    sp.counts = reinterpret_cast<unsigned long long*>(opts.sparse_counts);
    sp.marked = !saved_lse;
    if (sp.counts) check_cuda(fn, cudaMemsetAsync(sp.counts, 0, sizeof(linear_sparse_counts), s));
    if (sp.marked && N > 0 && V > 0)
      check_cuda(fn, cudaMemsetAsync(sp.flags, 0,
                                     static_cast<std::size_t>(sparse_row_tiles(N) * sp.ld), s));
  }
  if (!saved_lse) {
    // The forward lays out the statistics' region itself, from the same aligned base.
    forward_outputs o = out;
    o.lse = {row_lse, N};
    const auto forward = [&](const auto& hook) {
      run_linear<linear_mode::forward>(fn, exec, hidden, weight, bias, targets, opts, nullptr, {},
                                       o, linear_grads<T>{},
                                       linear_workspace{ws.data, plan.stats.bytes}, hook);
    };
    if constexpr (!detail::target_traits<Tgt>::soft) {
      const auto ids = device_targets(targets).ids;
      using I = std::remove_cv_t<std::remove_pointer_t<decltype(ids)>>;
      if (sp)
        forward(mark_hook<device_t<T>, I>{fn, &sp, row_lse, ids, opts.ignore_index, s});
      else
        forward(no_chunk_hook{});
    } else {
      forward(no_chunk_hook{});
    }
    if (out.lse.data && N > 0)
      check_cuda(fn, cudaMemcpyAsync(out.lse.data, row_lse, sizeof(float) * N,
                                     cudaMemcpyDeviceToDevice, s));
  }

  const auto dt = device_targets(targets);
  if constexpr (soft) {
    if (N > 0) {
      const auto k = make_loss_constants(opts, V, static_cast<float>(V));
      const auto blocks = static_cast<unsigned>((N * 32 + linear_threads - 1) / linear_threads);
      soft_mass_kernel<<<blocks, linear_threads, 0, s>>>(dt, N, V, opts.class_weights.data, k.keep,
                                                         k.smooth, mass);
      check_cuda(fn, cudaGetLastError());
    }
  }
  // Out-of-range class ids are counted once: by the forward, or by backward's first panel.
  const cublas_scope blas(fn, exec);
  run_panels(fn, exec, blas, plan, ws.data, hidden, weight, bias, targets, opts, vocab_shard{0, V},
             saved_lse ? saved_lse->data : row_lse, soft ? mass : nullptr, &up, grads,
             saved_lse && !soft ? exec.error_count : nullptr, sp);
}

}  // namespace cuda_detail
}  // namespace xent
