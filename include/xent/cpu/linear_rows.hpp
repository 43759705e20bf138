// The fast order of fused linear cross-entropy on the CPU: rows a chunk at a time (as many as the
// workspace holds, linear_plan.hpp). For a chunk X_c of hidden rows:
//   1. L = X_c · Wᵀ (+ b), in float in the workspace, by Eigen GEMMs over blocks of weight rows,
//      the blocks shared out among threads (a bf16 / fp16 block is converted to float first);
//   2. the cross-entropy core (backend_traits<cpu>) runs on L as its logits and writes the logit
//      gradient G over L, in place; the loss math lives there only;
//   3. d_weight += Gᵀ · X_c and d_bias += column sums of G, by weight block (disjoint per thread),
//      then d_hidden rows = G · W, the chunk's rows shared out among threads.
// The mean's normaliser W (and the class-id check) covers the whole call and is computed before
// anything is written; each chunk goes to the core as reduction none with its rows' upstream
// gradient (the scalar / W for mean and sum), so per-row scales are applied before any sum.
// "float" above is the inputs' accumulator A (accumulator.hpp): double for double inputs, whose
// logits, GEMMs and d_weight / d_bias sums are then all in double.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../backend.hpp"
#include "../linear/options.hpp"
#include "../linear/plan.hpp"
#include "../loss_math.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "backend.hpp"
#include "cpu.hpp"
#include "linear_plan.hpp"
#include "linear_steps.hpp"

namespace xent {
namespace cpu_detail {

enum class linear_mode { forward, fused, backward };

/// What run_row_chunks calls after a forward chunk's core, for nobody.
struct no_chunk_hook {
  template <class A>
  void operator()(std::int64_t, const matrix_view<A>&) const {}
};

/// The row chunks of call `c` (planned in its workspace): per chunk its logits over every weight
/// row, the core on them in place, and (training) their gradient folded into the gradients.
/// `normalizer` is the mean's W over every row of the call (check_targets_and_weigh). A forward
/// calls after_chunk(r0, logits) once each chunk's outputs are written (the sparse backward reads
/// the logits there).
template <linear_mode Mode, class T, class G, class Tgt, class A, class Hook = no_chunk_hook>
void run_row_chunks(const linear_call<T, G>& c, vector_view<const T> bias, const Tgt& targets,
                    const linear_options& opts, const basic_upstream<A>* up,
                    vector_view<const A> lse, const basic_forward_outputs<A>& out,
                    double normalizer, const Hook& after_chunk = {}) {
  const cpu& exec = c.exec;
  const matrix_view<const T> hidden = c.hidden;
  const std::int64_t N = c.rows(), V = c.vocab();
  const A* bias_f = float_bias(c, bias);
  if constexpr (Mode != linear_mode::forward) start_grads(c);

  // Each chunk is a problem of its own for the core, with reduction none: its row losses are
  // summed here over the whole call, and every row gets its upstream gradient, the scalar / W of
  // the whole call for mean and sum (formed in double and rounded once, as the core does).
  options core = opts;
  core.reduce = reduction::none;
  basic_upstream<A> row_up;
  if (up) {
    row_up.scale =
        opts.reduce == reduction::none
            ? up->scale
            : static_cast<A>(scalar_upstream(up->scale, up->scale_ptr, opts.reduce, normalizer));
  }
  double loss = 0.0;
  std::int64_t correct = 0;
  for (std::int64_t r0 = 0; r0 < N; r0 += c.plan.chunk_rows) {
    const std::int64_t n = std::min(c.plan.chunk_rows, N - r0);
    const const_acc_rows_map<A> x = float_rows(hidden, r0, n, c.buffer(c.plan.x));
    const matrix_view<A> chunk(c.buffer(c.plan.logits), n, V, V);
    acc_rows_map<A> logits(chunk.data, n, V, Eigen::OuterStride<>(V));
    chunk_logits(c, x, logits, bias_f);

    const auto chunk_targets = detail::target_rows(targets, r0, n);
    basic_upstream<A> chunk_up = row_up;
    if (up) chunk_up.rows = detail::rows_slice(up->rows, r0, n);
    if constexpr (Mode == linear_mode::backward) {
      backend_traits<cpu>::backward(exec, matrix_view<const A>(chunk), chunk_targets, core,
                                    detail::rows_slice(lse, r0, n), chunk_up, chunk);
    } else {
      basic_forward_outputs<A> o;
      o.row_loss = out.row_loss.data ? detail::rows_slice(out.row_loss, r0, n)
                                     : vector_view<A>(c.buffer(c.plan.row_loss), n);
      o.lse = detail::rows_slice(out.lse, r0, n);
      o.argmax = detail::rows_slice(out.argmax, r0, n);
      std::int64_t chunk_correct = 0;
      if (out.num_correct) o.num_correct = &chunk_correct;
      if constexpr (Mode == linear_mode::fused)
        backend_traits<cpu>::forward_backward(exec, matrix_view<const A>(chunk), chunk_targets,
                                              core, chunk_up, o, chunk);
      else
        backend_traits<cpu>::forward(exec, matrix_view<const A>(chunk), chunk_targets, core, o);
      if constexpr (Mode == linear_mode::forward) after_chunk(r0, chunk);
      for (std::int64_t i = 0; i < n; ++i) loss += static_cast<double>(o.row_loss[i]);
      correct += chunk_correct;
    }
    if constexpr (Mode != linear_mode::forward) {
      chunk_weight_grads(c, x, logits);
      chunk_hidden_grads(c, logits, r0);
    }
  }
  if constexpr (Mode != linear_mode::forward) finish_grads(c);
  if (out.loss && opts.reduce != reduction::none)
    *out.loss =
        static_cast<A>(opts.reduce == reduction::mean ? over_normalizer(loss, normalizer) : loss);
  if (out.num_correct) *out.num_correct = correct;
}

/// A call in the fast order: rows chunked as the workspace `ws` holds.
template <linear_mode Mode, class T, class G, class Tgt, class A>
void run_linear(const char* fn, const cpu& exec, matrix_view<const T> hidden,
                matrix_view<const T> weight, vector_view<const T> bias, const Tgt& targets,
                const linear_options& opts, const basic_upstream<A>* up, vector_view<const A> lse,
                const basic_forward_outputs<A>& out, const linear_grads<G>& grads,
                const linear_workspace& ws) {
  const std::int64_t N = hidden.rows, D = hidden.cols, V = weight.rows;
  // Class ids are checked, and the mean's W summed over every row, before anything is written.
  const double normalizer = check_targets_and_weigh(fn, targets, V, opts);
  const linear_pass pass =
      Mode == linear_mode::forward ? linear_pass::forward : linear_pass::training;
  const linear_call<T, G> c = make_linear_call(
      exec, hidden, weight, grads, opts.accumulate,
      plan_linear<T, G>(exec, {N, D, V}, pass, opts.accumulate, ws.bytes), ws.data);
  run_row_chunks<Mode>(c, bias, targets, opts, up, lse, out, normalizer);
}
}  // namespace cpu_detail
}  // namespace xent
