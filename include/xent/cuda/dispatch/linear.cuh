// The dispatch of fused linear cross-entropy on one GPU (linear_traits<cuda>), with the caller's
// cuBLAS handle.
//
// Rows are taken a chunk at a time (as many as the workspace holds, linear_plan.cuh). Before the
// chunks one small kernel sums the mean's normaliser W over the whole call and writes each row's
// upstream gradient (scale / W for mean, scale for sum) on the device, so nothing waits on the
// host. For a chunk X_c of hidden rows, every step on exec.stream:
//   1. L = X_c · Wᵀ (+ b) by cublasGemmEx into the workspace, in the inputs' dtype T with float
//      accumulation (tensor cores for bf16 / fp16). Logits in T, as PyTorch eager keeps them:
//      half the bytes of float logits for the core to read and write and for chunk room, and the
//      gradient GEMMs take their tensor-core inputs in T anyway. The cost is one rounding of each
//      logit to T; the core then works in float on those values. The bias, when given, is
//      broadcast into L first and the GEMM adds to it (beta = 1): one rounding of the sum;
//   2. the cross-entropy core (dispatch/rows.cuh's run, as backend_traits<cuda> calls it) on L as
//      reduction none with the rows' upstream gradients, writing the logit gradient G over L in
//      place (rounded once to T); the loss math lives there only;
//   3. d_weight += Gᵀ · X_c with a float C (the caller's float d_weight, or the float accumulator
//      of dw_accumulation::fp32), or in d_weight's own dtype (dw_accumulation::output: rounded once
//      per chunk); d_bias += column sums of G in float; d_hidden rows = G · W with a float C,
//      rounded once into d_hidden when it is not float.
// Chunks have as many rows as the workspace holds; in training with the float d_weight accumulator
// and a 16-bit d_weight without row padding, the logits go in d_weight instead when it holds more
// rows (d_weight is written only after the last chunk; linear_logits_room says why it matters).
// The first chunk's GEMMs write (beta = 0) and later ones add (beta = 1), so nothing is zeroed
// first. After the chunks: the float accumulators are rounded into d_weight / d_bias, and one CTA
// sums the row losses (a fixed order: deterministic) into the reduced loss and counts num_correct.
//
// The forward on Hopper (sm_90a builds): bf16 calls without bias, label smoothing, softcap or
// argmax / num_correct take stats_gemm.cuh instead of steps 1-2, a GEMM whose epilogue keeps
// each row's max and sum of exponentials per 256 columns, so the logits are never written (its
// statistics are of the logits rounded to T, as this path's: the same losses up to the order of
// the sums).
//
// Training on Hopper (sm_90a builds, policy::scaled_probs): bf16 fused calls with the same
// options and no d_bias take scaled_probs.cuh instead of steps 1-2: the GEMM's epilogue stores
// each chunk's exp(z - ref) and row statistics, and steps 3 take each row's scale aside (the
// scaled hidden rows for d_weight, the scale in d_hidden's rounding), so no pass over the chunk's
// logits runs between the GEMMs.
//
// One chunk of every row: training with the float accumulator needs none when all the rows fit
// one chunk (linear_plan.cuh, plan_linear): its d_weight GEMM writes d_weight directly.
//
// Each chunk's steps run back to back on exec.stream. Running a chunk's cross-entropy pass on a
// caller-lent second stream beside the next chunk's GEMMs (two logits buffers of half the rows,
// events between the streams) was built and measured slower on every line, also at equal chunk size
// (H200: 8192 x 4096 x 128256 forward 13.19 -> 13.73 ms), likely because a GEMM leaves no room on
// an SM for a kernel beside it (not profiled).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../linear/options.hpp"
#include "../../linear/plan.hpp"
#include "../../online_lse.hpp"
#include "../../options.hpp"
#include "../../targets.hpp"
#include "../../views.hpp"
#include "../cuda.cuh"
#include "../kernels/linear_kernels.cuh"
#include "../runtime.cuh"
#include "../tuning/policy.cuh"
#include "cublas.cuh"
#include "launch.cuh"
#include "linear_call.cuh"
#include "linear_plan.cuh"
#include "rows.cuh"
#include "scaled_probs.cuh"
#include "stats_gemm.cuh"

namespace xent {
namespace cuda_detail {

enum class linear_mode { forward, fused, backward };

/// run_linear's hook after each forward chunk's row pass, given the chunk's logits, and
/// stats_forward's after each launch's merge, given the row partials: none by default. The sparse
/// backward's statistics pass marks its tiles there (linear_sparse.cuh's mark_hook).
struct no_chunk_hook {
  template <class DT>
  void operator()(std::int64_t, std::int64_t, const DT*, std::int64_t, std::int64_t) const {}
  void partials(std::int64_t, std::int64_t, const online_lse*, std::int64_t) const {}
};

/// Whether a call's options are those the Hopper GEMM's row statistics cover (stats_forward and
/// the scaled-probabilities training): no label smoothing or softcap (class ids are the caller's
/// check), and no argmax asked for (num_correct).
inline bool plain_class_options(const linear_options& opts, const linear_totals& t) {
  return opts.label_smoothing == 0.0f && opts.softcap == 0.0f && !t.argmax;
}

/// The merge kernels' view of a call over V classes: the core's row arguments as reduction none,
/// with the call's class weights, loss constants, ignore index and error count; the caller sets
/// the rows, targets, outputs and upstream gradient of each launch.
template <class DT, class I, class T, class G>
row_args<DT, DT, class_ids<I>> merge_args(const linear_call<T, G>& c, const linear_options& opts) {
  const std::int64_t V = c.vocab();
  row_args<DT, DT, class_ids<I>> m{};
  m.cols = m.vocab = V;
  m.weights = opts.class_weights.data;
  m.k = make_loss_constants(opts, V, static_cast<float>(V));
  m.ignore_index = opts.ignore_index;
  m.reduce = reduction::none;
  m.error_count = c.exec.error_count;
  return m;
}

/// The forward by the Hopper GEMM whose epilogue keeps each row's statistics (stats_gemm.cuh),
/// where it applies: bf16 operands, class-id targets without label smoothing, softcap, bias or an
/// argmax asked for (num_correct), D a multiple of 8 and 16-byte aligned operands, on an sm_90
/// device running the kernel's sm_90a build (policy::stats_gemm). The row partials and target
/// logits go where the chunk logits would (the workspace's logits buffer), as many rows per
/// launch as they fit; the merge writes each row's loss and LSE as the core does, so the
/// reduced loss is formed after as on the cuBLAS path. The statistics are of the logits rounded
/// to bf16, as the cuBLAS path stores them and PyTorch eager has them. False, enqueuing nothing,
/// where the path does not apply. `hook.partials` sees each launch's partials after its merge.
template <class T, class G, class I, class Hook>
bool stats_forward(const char* fn, const linear_call<T, G>& c, class_ids<I> targets,
                   const linear_options& opts, const linear_totals& t, const forward_outputs& out,
                   const Hook& hook) {
  namespace sg = stats_gemm;
  using DT = typename linear_call<T, G>::DT;
  if constexpr (!std::is_same<DT, __nv_bfloat16>::value || !policy::stats_gemm) {
    return false;
  } else {
    const std::int64_t N = c.rows(), D = c.dim(), V = c.vocab();
    if (!plain_class_options(opts, t) || N == 0) return false;
    const device_facts dev = query_device(fn);
    if (!hopper_gemm_fits<sg::form::stats, I>(c, dev)) return false;
    const int col_tiles = static_cast<int>((V + sg::tile_n - 1) / sg::tile_n);
    const std::size_t room = sizeof(DT) * static_cast<std::size_t>(c.plan.chunk_rows) *
                             static_cast<std::size_t>(c.plan.ld);
    const std::size_t per_row = sizeof(sg::partial) * static_cast<std::size_t>(col_tiles) + 4;
    // Rows per launch: as many as the buffer holds, with the launch's rows and tile count in int.
    const std::int64_t most = std::min<std::int64_t>(
        {static_cast<std::int64_t>(room / per_row), INT_MAX / sg::tile_m * sg::tile_m,
         std::int64_t{INT_MAX} / col_tiles * sg::tile_m});
    if (most < 1) return false;
    // The merge's view of the call: outputs only (no reduction here).
    auto m = merge_args<DT, I>(c, opts);
    for (std::int64_t r0 = 0; r0 < N; r0 += most) {
      const std::int64_t n = std::min(most, N - r0);
      auto a = sg::shape_args<I>(n, V, D);
      a.targets = targets.ids + r0;
      a.partials = reinterpret_cast<sg::partial*>(c.logits());
      a.target_logit = reinterpret_cast<float*>(a.partials + n * col_tiles);
      sg::launch<sg::form::stats>(fn, c.hidden.data + r0 * c.hidden.ld, c.hidden.ld, c.weight.data,
                                  c.weight.ld, a, dev, policy::stats_gemm_cluster, c.exec.stream);
      m.rows = n;
      m.targets.ids = a.targets;
      m.row_loss = t.row_loss ? t.row_loss + r0 : nullptr;
      m.lse_out = out.lse.data ? out.lse.data + r0 : nullptr;
      const auto blocks = static_cast<unsigned>((n * 32 + linear_threads - 1) / linear_threads);
      sg::merge_kernel<<<blocks, linear_threads, 0, c.exec.stream>>>(m, a.partials, a.target_logit,
                                                                     col_tiles);
      check_cuda(fn, cudaGetLastError());
      hook.partials(r0, n, a.partials, col_tiles);
    }
    return true;
  }
}

/// Whether fused training takes the scaled-probabilities path (scaled_probs.cuh) on this call:
/// policy::scaled_probs, bf16 operands, class-id targets without label smoothing or softcap, no
/// bias or d_bias, no argmax asked for (num_correct), the plan's room for its buffers, chunks
/// and tile counts within int, D a multiple of 8 and 16-byte aligned operands and logits rows, on
/// an sm_90 device running the kernel's sm_90a build.
template <class T, class G, class I>
bool scaled_probs_fit(const char* fn, const linear_call<T, G>& c, class_ids<I>,
                      const linear_options& opts, const linear_totals& t) {
  namespace sg = stats_gemm;
  using DT = typename linear_call<T, G>::DT;
  if constexpr (!std::is_same<DT, __nv_bfloat16>::value || !policy::stats_gemm ||
                !policy::scaled_probs) {
    return false;
  } else {
    const std::int64_t R = c.plan.chunk_rows, V = c.vocab();
    if (!plain_class_options(opts, t) || c.d_bias || c.plan.probs == linear_absent ||
        c.rows() == 0 || R > INT_MAX / 2)
      return false;
    const std::int64_t col_tiles = (V + sg::tile_n - 1) / sg::tile_n;
    if ((R + sg::tile_m - 1) / sg::tile_m > INT_MAX / std::max<std::int64_t>(col_tiles, 1))
      return false;
    if (!aligned16(c.logits(), c.plan.ld * 2)) return false;
    const device_facts dev = query_device(fn);
    return hopper_gemm_fits<sg::form::probs, I>(c, dev) &&
           hopper_gemm_fits<sg::form::stats, I>(c, dev);
  }
}

/// One chunk of fused training by the scaled-probabilities path (scaled_probs.cuh has the steps):
/// rows [r0, r0 + n) into the chunk's buffer as P', their outputs written, then the gradients.
template <class T, class G, class I>
void scaled_probs_chunk(const char* fn, const linear_call<T, G>& c, class_ids<I> targets,
                        const linear_options& opts, const upstream& up, const forward_outputs& out,
                        std::int64_t r0, std::int64_t n) {
  namespace sg = stats_gemm;
  namespace sp = scaled_probs;
  using DT = typename linear_call<T, G>::DT;
  if constexpr (std::is_same<DT, __nv_bfloat16>::value) {
    const cudaStream_t s = c.exec.stream;
    const std::int64_t D = c.dim(), V = c.vocab();
    const int rows = static_cast<int>(n);
    const probs_layout layout = make_probs_layout(c.plan.chunk_rows, V, D);
    const sp::buffers b = sp::make_buffers(c.base + c.plan.probs, layout);
    const DT* x = c.hidden_row(r0);
    const I* y = targets.ids + r0;
    const auto warps = static_cast<unsigned>((n * 32 + linear_threads - 1) / linear_threads);
    sp::reference_kernel<<<warps, linear_threads, 0, s>>>(x, c.hidden.ld, c.weight.data,
                                                          c.weight.ld, static_cast<int>(D), y, rows,
                                                          V, opts.ignore_index, b.ref);
    check_cuda(fn, cudaGetLastError());
    const device_facts dev = query_device(fn);
    auto a = sg::shape_args<I>(n, V, D);
    a.targets = y;
    a.partials = b.partials;
    a.target_logit = b.target_logit;
    a.ref = b.ref;
    sg::launch<sg::form::probs>(fn, x, c.hidden.ld, c.weight.data, c.weight.ld, a, dev,
                                policy::stats_gemm_cluster, s, c.logits(), c.plan.ld);
    check_cuda(fn, cudaMemsetAsync(b.tile_flags, 0, sizeof(int) * (layout.row_tiles + 1), s));
    // The merge's view of the chunk: its rows, outputs and upstream gradient.
    auto m = merge_args<DT, I>(c, opts);
    m.rows = n;
    m.targets.ids = y;
    m.scale = up.scale;
    m.up_rows = up.rows.data;
    m.row_loss = out.row_loss.data;
    m.lse_out = out.lse.data;
    sp::merge_kernel<<<warps, linear_threads, 0, s>>>(m, b, a.col_tiles, x, c.hidden.ld,
                                                      static_cast<int>(D));
    check_cuda(fn, cudaGetLastError());
    // The rows the first pass could not scale (none: each launch below leaves at once): their
    // statistics again from bf16 logits (the forward's form over their row tiles), their outputs,
    // then P' over the same logits by their LSE.
    auto st = sg::shape_args<I>(n, V, D);
    st.targets = y;
    st.partials = b.partials;
    st.target_logit = b.target_logit;
    st.tile_flags = b.tile_flags;
    st.flagged = b.flagged();
    sg::launch<sg::form::stats>(fn, x, c.hidden.ld, c.weight.data, c.weight.ld, st, dev,
                                policy::stats_gemm_cluster, s);
    sp::second_merge_kernel<<<warps, linear_threads, 0, s>>>(m, b, a.col_tiles);
    check_cuda(fn, cudaGetLastError());
    a.partials = nullptr;
    a.target_logit = nullptr;
    a.mult = b.mult;
    a.tile_flags = b.tile_flags;
    a.flagged = b.flagged();
    a.logit_rows = b.second;
    sg::launch<sg::form::probs>(fn, x, c.hidden.ld, c.weight.data, c.weight.ld, a, dev,
                                policy::stats_gemm_cluster, s, c.logits(), c.plan.ld);
    sp::patch_kernel<<<static_cast<unsigned>((n + linear_threads - 1) / linear_threads),
                       linear_threads, 0, s>>>(c.logits(), c.plan.ld, y, rows, V, opts.ignore_index,
                                               b.patch);
    check_cuda(fn, cudaGetLastError());
    chunk_grads(c, r0, n, r0 == 0, b.hidden, D, b.beta);
  }
}

template <linear_mode Mode, class T, class G, class Tgt, class Hook = no_chunk_hook>
void run_linear(const char* fn, const cuda& exec, matrix_view<const T> hidden,
                matrix_view<const T> weight, vector_view<const T> bias, const Tgt& targets,
                const linear_options& opts, const upstream* up, vector_view<const float> lse,
                const forward_outputs& out, const linear_grads<G>& grads,
                const linear_workspace& ws, const Hook& hook = {}) {
  const std::int64_t N = hidden.rows, D = hidden.cols, V = weight.rows;
  const linear_pass pass =
      Mode == linear_mode::forward ? linear_pass::forward : linear_pass::training;
  const std::size_t room =
      linear_logits_room<T>(pass, opts.accumulate, grads.d_weight.data, V, D, grads.d_weight.ld);
  const linear_plan plan = plan_linear<T, G>({N, D, V}, pass, opts.accumulate, ws.bytes, room);
  check_linear_call(fn, exec, hidden, weight, grads, plan);
  const cublas_scope blas(fn, exec);
  const linear_call<T, G> c =
      make_linear_call(exec, blas, hidden, weight, bias, grads, plan, ws.data);
  const auto dt = device_targets(targets);
  // The whole call's W, and each row's upstream gradient for mean and sum, before any chunk.
  const linear_totals totals =
      start_totals(fn, c, dt, N, V, opts, up, Mode == linear_mode::backward ? nullptr : &out);

  if constexpr (Mode == linear_mode::forward && !decltype(dt)::soft) {
    if (stats_forward(fn, c, dt, opts, totals, out, hook)) {
      finish_totals(fn, exec.stream, totals, dt, N, V, opts, out);
      return;
    }
  }
  // The core sees each chunk as a problem of its own with reduction none; the reduced loss and
  // num_correct are formed after the chunks from every row's loss and argmax.
  options core = opts;
  core.reduce = reduction::none;
  const cuda core_exec{exec.stream, nullptr, 0, exec.error_count, nullptr};
  bool scaled = false;
  if constexpr (Mode == linear_mode::fused && !decltype(dt)::soft)
    scaled = scaled_probs_fit(fn, c, dt, opts, totals);
  for (std::int64_t r0 = 0; r0 < N; r0 += plan.chunk_rows) {
    const std::int64_t n = std::min(plan.chunk_rows, N - r0);
    if constexpr (Mode == linear_mode::fused && !decltype(dt)::soft) {
      if (scaled) {
        scaled_probs_chunk(fn, c, dt, opts, chunk_upstream(up, opts, totals, r0, n),
                           chunk_outputs(out, totals, r0, n), r0, n);
        continue;
      }
    }
    chunk_logits(c, r0, n);
    const matrix_view<T> chunk(reinterpret_cast<T*>(c.logits()), n, V, plan.ld);
    const auto chunk_targets = detail::target_rows(targets, r0, n);
    const upstream chunk_up = chunk_upstream(up, opts, totals, r0, n);
    // The core's errors name the cross-entropy entry point its pass serves.
    if constexpr (Mode == linear_mode::backward) {
      run<pass::backward>("xent::backward", core_exec, matrix_view<const T>(chunk), chunk_targets,
                          core, &chunk_up, nullptr, detail::rows_slice(lse, r0, n), chunk);
    } else {
      const forward_outputs chunk_out = chunk_outputs(out, totals, r0, n);
      if constexpr (Mode == linear_mode::fused)
        run<pass::fused>("xent::forward_backward", core_exec, matrix_view<const T>(chunk),
                         chunk_targets, core, &chunk_up, &chunk_out, {}, chunk);
      else
        run<pass::forward>("xent::forward", core_exec, matrix_view<const T>(chunk), chunk_targets,
                           core, nullptr, &chunk_out, {}, matrix_view<float>{});
      if constexpr (Mode == linear_mode::forward)
        hook(r0, n, static_cast<const typename linear_call<T, G>::DT*>(c.logits()), plan.ld, V);
    }
    if constexpr (Mode != linear_mode::forward)
      chunk_grads(c, r0, n, r0 == 0, c.hidden_row(r0), c.hidden.ld);
  }
  if constexpr (Mode != linear_mode::forward) finish_grads(c);
  if constexpr (Mode != linear_mode::backward)
    finish_totals(fn, exec.stream, totals, dt, N, V, opts, out);
}

}  // namespace cuda_detail
}  // namespace xent
