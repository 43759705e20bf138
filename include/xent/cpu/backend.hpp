// backend_traits<cpu>: the CPU implementation of forward, backward and forward_backward.
//
// Work is cut one of two ways. With at least as many rows as threads, each thread takes a
// contiguous block of rows and does everything for a row while it is in cache: one read for the
// statistics and, in forward_backward, the gradient written right after (the row is in L2). With
// fewer rows than threads (32 x 32000 on 16 threads), each row's vocabulary is cut into slices; the
// slices' partial statistics merge through online_lse, then each thread writes its slice's
// gradient.
//
// Every dtype computes in its accumulator (accumulator.hpp): float for float, bfloat16 and half,
// double for double logits, which makes this backend a float64 reference as well.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "../accumulator.hpp"
#include "../backend.hpp"
#include "../error.hpp"
#include "../loss_math.hpp"
#include "../options.hpp"
#include "../parallel/shard.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "cpu.hpp"
#include "parallel.hpp"
#include "policy.hpp"
#include "row_pass.hpp"

namespace xent {
namespace cpu_detail {

/// The split of one call: `slices` pieces per row, `threads` workers.
struct plan {
  int threads = 1;
  std::int64_t slices = 1;
  std::int64_t slice_len = 0;

  std::int64_t tasks(std::int64_t rows) const { return rows * slices; }
  /// Task t is slice t % slices of row t / slices: classes [v0, v1).
  void slice(std::int64_t t, std::int64_t cols, std::int64_t& n, std::int64_t& v0,
             std::int64_t& v1) const {
    n = t / slices;
    v0 = (t % slices) * slice_len;
    v1 = v0 + slice_len < cols ? v0 + slice_len : cols;
  }
};

/// Most (row, slice) tasks a split call can have: rows < threads and slices <= ceil(threads/rows)
/// bound it by 2 * max_threads, so their partials fit a fixed array.
constexpr std::int64_t max_split_tasks = 2 * max_threads;

inline plan make_plan(const cpu& exec, std::int64_t rows, std::int64_t cols) {
  plan p;
  p.threads = std::min(std::max(exec.threads, 1), max_threads);
  if (rows * cols < policy::min_parallel_elements) p.threads = 1;
  if (rows > 0 && rows < p.threads) {
    const std::int64_t wanted = (p.threads + rows - 1) / rows;
    p.slices = std::max<std::int64_t>(1, std::min(wanted, cols / policy::min_slice));
  }
  // Slice boundaries on 64-element multiples keep two threads off one cache line of the gradient.
  p.slice_len = ((cols + p.slices - 1) / p.slices + 63) / 64 * 64;
  p.slices = p.slice_len > 0 ? (cols + p.slice_len - 1) / p.slice_len : 1;
  if (p.slices < 1) p.slices = 1;
  p.threads =
      static_cast<int>(std::min<std::int64_t>(p.threads, std::max<std::int64_t>(p.tasks(rows), 1)));
  return p;
}

/// Host-side check of class ids (each in [0, V) or ignore_index) and the mean's normalizer
/// W = sum of w[y] over rows not ignored, in double. Runs before anything is written.
template <class I>
double check_targets_and_weigh(const char* fn, vector_view<const I> targets, std::int64_t cols,
                               const options& opts) {
  double total = 0.0;
  for (std::int64_t n = 0; n < targets.size; ++n) {
    const std::int64_t y = static_cast<std::int64_t>(targets[n]);
    if (y == opts.ignore_index) continue;
    if (y < 0 || y >= cols)
      throw error(fn, "targets",
                  "row " + std::to_string(n) + " has target " + std::to_string(y) +
                      " outside [0, " + std::to_string(cols) + ") and not ignore_index (" +
                      std::to_string(opts.ignore_index) + ")");
    total += normalizer_weight(y, opts.ignore_index, cols, opts.class_weights.data);
  }
  return total;
}

template <class S>
double check_targets_and_weigh(const char*, const soft_targets<S>& targets, std::int64_t,
                               const options&) {
  return static_cast<double>(targets.probs.rows);  // soft targets: mean divides by N
}

/// The problem of `logits`, which hold classes [shard.first, shard.first + cols) of shard.vocab
/// ({0, cols} unsharded). Label smoothing's eps / V and sum_c w_c span the whole vocabulary, so a
/// shard's rows get the unsharded loss (opts.class_weights holds all V weights).
template <class T, class Tgt>
problem<T, Tgt> make_problem(const cpu& exec, matrix_view<const T> logits, const Tgt& targets,
                             const options& opts, vocab_shard shard) {
  // sum_c w_c enters only the smoothing term: without smoothing it is not formed, so a weight of
  // inf or NaN on a class no row targets stays out of every row (0 * inf would be NaN).
  double weight_sum = static_cast<double>(shard.vocab);
  const float* w = opts.class_weights.data;
  if (w && opts.label_smoothing > 0.0f) {
    weight_sum = 0.0;
    for (std::int64_t c = 0; c < opts.class_weights.size; ++c) weight_sum += w[c];
  }
  return problem<T, Tgt>{logits,
                         targets,
                         w ? w + shard.first : nullptr,
                         make_loss_constants<accumulator_t<T>>(
                             opts, shard.vocab, static_cast<accumulator_t<T>>(weight_sum)),
                         opts.ignore_index,
                         policy::chunk_for(exec.chunk),
                         shard.first};
}

/// The upstream gradient of each row: scale (x *scale_ptr) / W for mean, for sum as is, per row
/// for none. Formed in double and rounded once to the accumulator A.
template <class A>
struct row_scales {
  double base = 1.0;
  const A* rows = nullptr;

  A operator()(std::int64_t n) const {
    return static_cast<A>(rows ? base * static_cast<double>(rows[n]) : base);
  }
};

template <class A>
row_scales<A> make_row_scales(const basic_upstream<A>& up, const options& opts, double normalizer) {
  row_scales<A> s;
  // With reduction none the upstream is per row: scale * rows[n] (scale_ptr is refused there).
  s.base = opts.reduce == reduction::none
               ? static_cast<double>(up.scale)
               : scalar_upstream(up.scale, up.scale_ptr, opts.reduce, normalizer);
  s.rows = up.rows.data;
  return s;
}

/// Per-thread sums of one call, combined in thread order.
struct totals {
  std::array<double, max_threads> loss{};
  std::array<std::int64_t, max_threads> correct{};
};

/// Finishes row n from its merged statistics: loss, LSE, argmax, and the per-thread sums.
template <class T, class Tgt, class A>
A finish_row(const problem<T, Tgt>& pb, std::int64_t n, const basic_row_partial<A>& p,
             const basic_argmax_state<A>& am, const basic_forward_outputs<A>& out, totals& sums,
             int worker) {
  A loss;
  if constexpr (problem<T, Tgt>::soft) {
    loss = soft_row_loss(p, pb.k);
  } else {
    loss = class_row_loss(p, pb.weight(pb.target(n)), pb.k);
    if (am.index >= 0 && am.index == pb.class_id(n)) ++sums.correct[worker];
  }
  sums.loss[worker] += static_cast<double>(loss);
  if (out.row_loss.data) out.row_loss[n] = loss;
  if (out.lse.data) out.lse[n] = p.lse.lse();
  if (out.argmax.data) out.argmax[n] = am.index;
  return loss;
}

template <class A>
void finish_ignored_row(std::int64_t n, const basic_forward_outputs<A>& out) {
  if (out.row_loss.data) out.row_loss[n] = A(0);
  if (out.lse.data) out.lse[n] = A(0);
  if (out.argmax.data) out.argmax[n] = -1;
}

template <class A>
void write_totals(const totals& sums, int threads, const options& opts, double normalizer,
                  const basic_forward_outputs<A>& out) {
  double loss = 0.0;
  std::int64_t correct = 0;
  for (int w = 0; w < threads; ++w) {
    loss += sums.loss[w];
    correct += sums.correct[w];
  }
  if (out.loss && opts.reduce != reduction::none)
    *out.loss =
        static_cast<A>(opts.reduce == reduction::mean ? over_normalizer(loss, normalizer) : loss);
  if (out.num_correct) *out.num_correct = correct;
}

/// The mass sum_c w_c t'_c of row n: from its merged statistics when a forward pass has them,
/// else recomputed from the soft targets (backward); a class id's follows from its weight.
template <class T, class Tgt, class A = accumulator_t<T>>
A row_mass(const problem<T, Tgt>& pb, std::int64_t n,
           const basic_row_partial<A>* merged = nullptr) {
  if constexpr (problem<T, Tgt>::soft) {
    return merged ? merged->mass : soft_mass(pb, n);
  } else {
    return class_target_mass(pb.weight(pb.target(n)), pb.k);
  }
}

/// Calls f(n, v0, v1, t) for task t of every (row, slice) task of the plan, classes [v0, v1) of row
/// n, on the plan's threads.
template <class F>
void for_each_task(const plan& pl, std::int64_t rows, std::int64_t cols, const F& f) {
  parallel_for(pl.threads, pl.tasks(rows), [&](std::int64_t begin, std::int64_t end, int) {
    for (std::int64_t t = begin; t < end; ++t) {
      std::int64_t n, v0, v1;
      pl.slice(t, cols, n, v0, v1);
      f(n, v0, v1, t);
    }
  });
}

/// Statistics of every (row, slice) task of the plan into parts[t]; ignored rows keep the empty
/// partial.
template <bool Argmax, class T, class Tgt, class A>
void task_partials(const plan& pl, const problem<T, Tgt>& pb, basic_slice_partial<A>* parts) {
  for_each_task(pl, pb.logits.rows, pb.logits.cols,
                [&](std::int64_t n, std::int64_t v0, std::int64_t v1, std::int64_t t) {
                  if (!pb.ignored(n))
                    parts[t].stats = slice_stats<Argmax>(pb, n, v0, v1, &parts[t].argmax);
                });
}

/// Pieces 0, 1, ..., pieces - 1 of row n (piece(n, s)) merged in that order: a fixed order, so
/// the result does not depend on which thread or rank finished first.
template <class Piece>
auto merge_pieces(const Piece& piece, std::int64_t n, std::int64_t pieces) {
  auto p = piece(n, 0);
  for (std::int64_t s = 1; s < pieces; ++s) p.merge(piece(n, s));
  return p;
}

/// Merges each row's pieces (merge_pieces) and finishes it (finish_row); lse[n] and mass[n]
/// receive what its gradient needs. One thread, rows in order: cheap next to the sweeps, and the
/// totals do not depend on the thread count.
template <class T, class Tgt, class Piece, class A>
void finish_rows(const problem<T, Tgt>& pb, std::int64_t pieces, const Piece& piece,
                 const basic_forward_outputs<A>& out, totals& sums, A* lse, A* mass) {
  for (std::int64_t n = 0; n < pb.logits.rows; ++n) {
    if (pb.ignored(n)) {
      finish_ignored_row(n, out);
      continue;
    }
    const basic_slice_partial<A> p = merge_pieces(piece, n, pieces);
    finish_row(pb, n, p.stats, p.argmax, out, sums, 0);
    lse[n] = p.stats.lse.lse();
    mass[n] = row_mass(pb, n, &p.stats);
  }
}

/// The gradient of every (row, slice) task of the plan: zero on ignored rows, else slice_gradient
/// from the row's LSE and mass (lse_of(n), mass_of(n)) and upstream scale.
template <std::int64_t Cols = dynamic, class T, class Tgt, class G, class Lse, class Mass, class A>
void write_gradient(const plan& pl, const problem<T, Tgt>& pb, const Lse& lse_of,
                    const Mass& mass_of, const row_scales<A>& scale, matrix_view<G> grad) {
  for_each_task(pl, pb.logits.rows, pb.logits.cols,
                [&](std::int64_t n, std::int64_t v0, std::int64_t v1, std::int64_t) {
                  if (pb.ignored(n))
                    zero_slice(grad.row(n), v0, v1);
                  else
                    slice_gradient<Cols>(pb, n, v0, v1, lse_of(n), mass_of(n), scale(n),
                                         grad.row(n));
                });
}

/// forward, and forward_backward when `grad` is non-null. Cols: the logits' static column count
/// (views.hpp), or dynamic.
template <bool Argmax, std::int64_t StaticCols, class T, class Tgt, class A, class G>
void run(const char* fn, const cpu& exec, matrix_view<const T> logits, const Tgt& targets,
         const options& opts, const basic_upstream<A>* up, const basic_forward_outputs<A>& out,
         matrix_view<G> grad) {
  // Only where nothing is converted on the way in or out: GCC's loop analysis of the inlined
  // conversions with constant lengths warns of overflow that cannot happen (bf16, half).
  constexpr std::int64_t Cols =
      std::is_same<T, A>::value && std::is_same<G, A>::value ? StaticCols : dynamic;
  const problem<T, Tgt> pb = make_problem(exec, logits, targets, opts, {0, logits.cols});
  const double normalizer = check_targets_and_weigh(fn, targets, logits.cols, opts);
  const row_scales<A> scale = up ? make_row_scales(*up, opts, normalizer) : row_scales<A>{};
  const std::int64_t rows = logits.rows, cols = logits.cols;
  const plan pl = make_plan(exec, rows, cols);
  totals sums;

  // A gradient row of the accumulator type can hold exp(z - m_c) between the two sweeps
  // (exp_cache); softcap needs the logits again in the gradient sweep, so it keeps the
  // two-exponential path.
  const bool cacheable = grad.data && opts.softcap == 0.0f && exp_cache<A>::fits(cols, pb.chunk);
  if (pl.slices == 1) {
    parallel_for(pl.threads, rows, [&](std::int64_t begin, std::int64_t end, int worker) {
      for (std::int64_t n = begin; n < end; ++n) {
        if (pb.ignored(n)) {
          finish_ignored_row(n, out);
          if (grad.data) zero_slice(grad.row(n), 0, cols);
          continue;
        }
        basic_argmax_state<A> am;
        if constexpr (std::is_same<G, A>::value) {
          if (cacheable) {
            exp_cache<A> cache;
            cache.values = grad.row(n);
            const basic_row_partial<A> p = slice_stats<Argmax, Cols>(pb, n, 0, cols, &am, &cache);
            finish_row(pb, n, p, am, out, sums, worker);
            cached_row_gradient<Cols>(pb, n, p.target_logit, p.lse.lse(), row_mass(pb, n, &p),
                                      scale(n), cache, grad.row(n));
            continue;
          }
        }
        const basic_row_partial<A> p = slice_stats<Argmax, Cols>(pb, n, 0, cols, &am);
        finish_row(pb, n, p, am, out, sums, worker);
        if (grad.data)
          slice_gradient<Cols>(pb, n, 0, cols, p.lse.lse(), row_mass(pb, n, &p), scale(n),
                               grad.row(n));
      }
    });
  } else {
    std::array<basic_slice_partial<A>, max_split_tasks> parts;
    task_partials<Argmax>(pl, pb, parts.data());
    std::array<A, max_threads> lse{}, mass{};
    finish_rows(
        pb, pl.slices, [&](std::int64_t n, std::int64_t s) { return parts[n * pl.slices + s]; },
        out, sums, lse.data(), mass.data());
    if (grad.data)
      write_gradient(
          pl, pb, [&](std::int64_t n) { return lse[n]; }, [&](std::int64_t n) { return mass[n]; },
          scale, grad);
  }
  write_totals(sums, pl.threads, opts, normalizer, out);
}

template <std::int64_t Cols, class T, class Tgt, class A, class G>
void run_forward(const char* fn, const cpu& exec, matrix_view<const T> logits, const Tgt& targets,
                 const options& opts, const basic_upstream<A>* up,
                 const basic_forward_outputs<A>& out, matrix_view<G> grad) {
  if (out.argmax.data || out.num_correct)
    run<true, Cols>(fn, exec, logits, targets, opts, up, out, grad);
  else
    run<false, Cols>(fn, exec, logits, targets, opts, up, out, grad);
}

template <std::int64_t StaticCols, class T, class Tgt, class A, class G>
void run_backward(const cpu& exec, matrix_view<const T> logits, const Tgt& targets,
                  const options& opts, vector_view<const A> lse, const basic_upstream<A>& up,
                  matrix_view<G> grad) {
  constexpr std::int64_t Cols =
      std::is_same<T, A>::value && std::is_same<G, A>::value ? StaticCols : dynamic;  // as run's
  const problem<T, Tgt> pb = make_problem(exec, logits, targets, opts, {0, logits.cols});
  const double normalizer = check_targets_and_weigh("xent::backward", targets, logits.cols, opts);
  write_gradient<Cols>(
      make_plan(exec, logits.rows, logits.cols), pb, [&](std::int64_t n) { return lse[n]; },
      [&](std::int64_t n) { return row_mass(pb, n); }, make_row_scales(up, opts, normalizer), grad);
}

template <class T>
struct is_cpu_dtype
    : std::bool_constant<std::is_same<T, float>::value || std::is_same<T, double>::value ||
                         std::is_same<T, Eigen::bfloat16>::value ||
                         std::is_same<T, Eigen::half>::value> {};

}  // namespace cpu_detail

template <>
struct backend_traits<cpu> {
  template <class T>
  static constexpr bool supports_dtype = cpu_detail::is_cpu_dtype<T>::value;
  /// Any gradient dtype for any logits: each element is converted on its way out.
  template <class T, class G>
  static constexpr bool supports_gradient = cpu_detail::is_cpu_dtype<G>::value;
  /// The logits come with their static column count (views.hpp), which the whole-row sweeps
  /// specialise on (row_pass.hpp's for_each_chunk).
  static constexpr bool static_columns = true;

  template <class T, class E, class Tgt, class A>
  static void forward(const cpu& exec, matrix_view<const T, E> logits, const Tgt& targets,
                      const options& opts, const basic_forward_outputs<A>& out) {
    cpu_detail::run_forward<E::cols>("xent::forward", exec, matrix_view<const T>(logits), targets,
                                     opts, static_cast<const basic_upstream<A>*>(nullptr), out,
                                     matrix_view<A>{});
  }

  template <class T, class E, class Tgt, class A, class G>
  static void backward(const cpu& exec, matrix_view<const T, E> logits, const Tgt& targets,
                       const options& opts, vector_view<const A> lse, const basic_upstream<A>& up,
                       matrix_view<G> grad) {
    cpu_detail::run_backward<E::cols>(exec, matrix_view<const T>(logits), targets, opts, lse, up,
                                      grad);
  }

  template <class T, class E, class Tgt, class A, class G>
  static void forward_backward(const cpu& exec, matrix_view<const T, E> logits, const Tgt& targets,
                               const options& opts, const basic_upstream<A>& up,
                               const basic_forward_outputs<A>& out, matrix_view<G> grad) {
    cpu_detail::run_forward<E::cols>("xent::forward_backward", exec, matrix_view<const T>(logits),
                                     targets, opts, &up, out, grad);
  }
};

}  // namespace xent
