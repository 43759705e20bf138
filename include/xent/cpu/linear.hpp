// linear_traits<cpu>: fused linear cross-entropy on the CPU.
//
// Rows are taken a chunk at a time (as many as the workspace holds, linear_plan.hpp). For a chunk
// X_c of hidden rows:
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

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../accumulator.hpp"
#include "../backend.hpp"
#include "../linear/options.hpp"
#include "../linear/plan.hpp"
#include "../loss_math.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "backend.hpp"
#include "convert.hpp"
#include "cpu.hpp"
#include "linear_plan.hpp"
#include "parallel.hpp"

namespace xent {
namespace cpu_detail {

template <class A>
using acc_row_matrix = Eigen::Matrix<A, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class A>
using acc_rows_map = Eigen::Map<acc_row_matrix<A>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class A>
using const_acc_rows_map =
    Eigen::Map<const acc_row_matrix<A>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class A>
using acc_row_vector_map = Eigen::Map<Eigen::Matrix<A, 1, Eigen::Dynamic>>;
template <class A>
using const_acc_row_vector_map = Eigen::Map<const Eigen::Matrix<A, 1, Eigen::Dynamic>>;
using rows_map = acc_rows_map<float>;
using const_rows_map = const_acc_rows_map<float>;

/// Below this many multiply-adds per GEMM phase one thread does it: starting threads costs tens
/// of microseconds.
constexpr std::int64_t linear_min_parallel_flops = std::int64_t{1} << 20;

/// One call: its operands, its plan and the workspace's buffers.
template <class T, class G>
struct linear_call {
  using acc = accumulator_t<T>;  ///< logits, GEMMs and gradient sums

  const cpu& exec;
  matrix_view<const T> hidden, weight;
  linear_grads<G> grads;
  dw_accumulation accumulate;
  linear_plan plan;
  char* base;  ///< the workspace's first 64-byte-aligned address

  std::int64_t rows() const { return hidden.rows; }
  std::int64_t dim() const { return hidden.cols; }
  std::int64_t vocab() const { return weight.rows; }
  std::int64_t blocks() const { return (vocab() + plan.block - 1) / plan.block; }
  acc* buffer(std::size_t offset) const {
    return offset == linear_absent ? nullptr : reinterpret_cast<acc*>(base + offset);
  }
  /// Workers for a GEMM phase over `rows` chunk rows.
  int threads(std::int64_t rows) const {
    return rows * vocab() * dim() < linear_min_parallel_flops ? 1 : plan.threads;
  }
  /// d_weight's accumulator (the caller's d_weight when G is acc), or null when there is none:
  /// no d_weight, or dw_accumulation::output with G not acc.
  acc* dw_sum() const {
    if (!grads.d_weight.data) return nullptr;
    if constexpr (std::is_same<G, acc>::value) {
      return grads.d_weight.data;
    } else {
      return accumulate == dw_accumulation::fp32 ? buffer(plan.dw) : nullptr;
    }
  }
  std::int64_t dw_sum_ld() const { return std::is_same<G, acc>::value ? grads.d_weight.ld : dim(); }
  /// d_bias's accumulator (the caller's d_bias when G is acc), null without d_bias.
  acc* db_sum() const {
    if (!grads.d_bias.data) return nullptr;
    if constexpr (std::is_same<G, acc>::value) {
      return grads.d_bias.data;
    } else {
      return buffer(plan.db);
    }
  }
};

/// The rows [r0, r0 + n) of `m` in its accumulator A: the caller's memory when T is A, else
/// converted into `scratch` (n x cols, dense).
template <class T, class A = accumulator_t<T>>
const_acc_rows_map<A> float_rows(const matrix_view<const T>& m, std::int64_t r0, std::int64_t n,
                                 A* scratch) {
  if constexpr (std::is_same<T, A>::value) {
    return const_acc_rows_map<A>(m.row(r0), n, m.cols, Eigen::OuterStride<>(m.ld));
  } else {
    for (std::int64_t i = 0; i < n; ++i) convert(m.row(r0 + i), m.cols, scratch + i * m.cols);
    return const_acc_rows_map<A>(scratch, n, m.cols, Eigen::OuterStride<>(m.cols));
  }
}

/// Weight rows [v0, v0 + nb) in the accumulator, converted into `worker`'s block buffer when
/// needed.
template <class T, class G, class A = accumulator_t<T>>
const_acc_rows_map<A> weight_block(const linear_call<T, G>& c, int worker, std::int64_t v0,
                                   std::int64_t nb) {
  A* scratch = c.buffer(c.plan.wblock);
  if (scratch) scratch += static_cast<std::int64_t>(worker) * c.plan.block * c.dim();
  return float_rows(c.weight, v0, nb, scratch);
}

/// Calls f(v0, nb, worker) for every weight block, the blocks shared out among the workers.
template <class T, class G, class F>
void for_each_block(const linear_call<T, G>& c, std::int64_t rows, F&& f) {
  parallel_for(c.threads(rows), c.blocks(), [&](std::int64_t b0, std::int64_t b1, int worker) {
    for (std::int64_t b = b0; b < b1; ++b) {
      const std::int64_t v0 = b * c.plan.block;
      f(v0, std::min(c.plan.block, c.vocab() - v0), worker);
    }
  });
}

/// L = X · Wᵀ (+ b).
template <class T, class G, class A>
void chunk_logits(const linear_call<T, G>& c, const const_acc_rows_map<A>& x,
                  acc_rows_map<A>& logits, const A* bias) {
  for_each_block(c, x.rows(), [&](std::int64_t v0, std::int64_t nb, int worker) {
    auto block = logits.middleCols(v0, nb);
    block.noalias() = x * weight_block(c, worker, v0, nb).transpose();
    if (bias) block.rowwise() += const_acc_row_vector_map<A>(bias + v0, nb);
  });
}

/// d_weight += Gᵀ · X and d_bias += column sums of G, by weight block: each block's rows of
/// d_weight belong to one worker.
template <class T, class G, class A>
void chunk_weight_grads(const linear_call<T, G>& c, const const_acc_rows_map<A>& x,
                        const acc_rows_map<A>& grad) {
  A* dw = c.dw_sum();
  A* db = c.db_sum();
  const bool fold = c.grads.d_weight.data && !dw;  // dw_accumulation::output, G not A
  if (!dw && !db && !fold) return;
  const std::int64_t D = c.dim();
  for_each_block(c, x.rows(), [&](std::int64_t v0, std::int64_t nb, int worker) {
    const auto g = grad.middleCols(v0, nb);
    if (dw) {
      acc_rows_map<A>(dw + v0 * c.dw_sum_ld(), nb, D, Eigen::OuterStride<>(c.dw_sum_ld()))
          .noalias() += g.transpose() * x;
    } else if (fold) {
      // The chunk's contribution in A, added to d_weight and rounded: once per chunk.
      A* part = c.buffer(c.plan.dw) + static_cast<std::int64_t>(worker) * c.plan.block * D;
      acc_rows_map<A>(part, nb, D, Eigen::OuterStride<>(D)).noalias() = g.transpose() * x;
      for (std::int64_t i = 0; i < nb; ++i) {
        G* out = c.grads.d_weight.row(v0 + i);
        for (std::int64_t j = 0; j < D; ++j)
          out[j] = static_cast<G>(static_cast<A>(out[j]) + part[i * D + j]);
      }
    }
    if (db) acc_row_vector_map<A>(db + v0, nb) += g.colwise().sum();
  });
}

/// d_hidden rows [r0, r0 + n) = G · W, the rows shared out among the workers (each sums its rows
/// over every weight block, so no partial sums need merging).
template <class T, class G, class A>
void chunk_hidden_grads(const linear_call<T, G>& c, const acc_rows_map<A>& grad, std::int64_t r0) {
  if (!c.grads.d_hidden.data) return;
  const std::int64_t n = grad.rows(), D = c.dim();
  parallel_for(c.threads(n), n, [&](std::int64_t a, std::int64_t b, int worker) {
    A* dx;
    std::int64_t ld;
    if constexpr (std::is_same<G, A>::value) {
      dx = c.grads.d_hidden.row(r0 + a);
      ld = c.grads.d_hidden.ld;
    } else {
      dx = c.buffer(c.plan.dx) + a * D;
      ld = D;
    }
    acc_rows_map<A> out(dx, b - a, D, Eigen::OuterStride<>(ld));
    out.setZero();
    for (std::int64_t v0 = 0; v0 < c.vocab(); v0 += c.plan.block) {
      const std::int64_t nb = std::min(c.plan.block, c.vocab() - v0);
      out.noalias() += grad.block(a, v0, b - a, nb) * weight_block(c, worker, v0, nb);
    }
    if constexpr (!std::is_same<G, A>::value)
      for (std::int64_t i = a; i < b; ++i)
        convert(dx + (i - a) * D, D, c.grads.d_hidden.row(r0 + i));
  });
}

/// Zeroes what the chunks add to.
template <class T, class G>
void start_grads(const linear_call<T, G>& c) {
  const std::int64_t V = c.vocab(), D = c.dim();
  using A = typename linear_call<T, G>::acc;
  if (A* dw = c.dw_sum())
    for (std::int64_t v = 0; v < V; ++v) std::fill_n(dw + v * c.dw_sum_ld(), D, A(0));
  else if (c.grads.d_weight.data)
    for (std::int64_t v = 0; v < V; ++v) std::fill_n(c.grads.d_weight.row(v), D, G(0.0f));
  if (A* db = c.db_sum()) std::fill_n(db, V, A(0));
}

/// Rounds the accumulators into the caller's d_weight and d_bias (G not the accumulator).
template <class T, class G>
void finish_grads(const linear_call<T, G>& c) {
  using A = typename linear_call<T, G>::acc;
  if constexpr (!std::is_same<G, A>::value) {
    const std::int64_t V = c.vocab(), D = c.dim();
    if (const A* dw = c.dw_sum())
      for (std::int64_t v = 0; v < V; ++v) convert(dw + v * D, D, c.grads.d_weight.row(v));
    if (const A* db = c.db_sum()) convert(db, V, c.grads.d_bias.data);
  }
}

/// A call over the caller's workspace `ws`, laid out by `plan` from its first 64-byte-aligned
/// address (any alignment of ws is accepted: the plan's bytes include the slack).
template <class T, class G>
linear_call<T, G> make_linear_call(const cpu& exec, matrix_view<const T> hidden,
                                   matrix_view<const T> weight, const linear_grads<G>& grads,
                                   dw_accumulation accumulate, const linear_plan& plan, void* ws) {
  const std::uintptr_t address = reinterpret_cast<std::uintptr_t>(ws);
  const std::uintptr_t aligned =
      (address + linear_alignment - 1) / linear_alignment * linear_alignment;
  return {
      exec, hidden, weight, grads, accumulate, plan, static_cast<char*>(ws) + (aligned - address)};
}

/// The bias in the accumulator (null without one): the caller's when T is the accumulator, else
/// converted into the plan's bias buffer.
template <class T, class G>
const accumulator_t<T>* float_bias(const linear_call<T, G>& c, vector_view<const T> bias) {
  if (!bias.data) return nullptr;
  if constexpr (std::is_same<T, accumulator_t<T>>::value) {
    return bias.data;
  } else {
    convert(bias.data, c.vocab(), c.buffer(c.plan.bias));
    return c.buffer(c.plan.bias);
  }
}

enum class linear_mode { forward, fused, backward };

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

}  // namespace cpu_detail

template <>
struct linear_traits<cpu> {
  template <class T, class G>
  static linear_workspace_sizes workspace_size(const cpu& exec, const linear_shape& shape,
                                               linear_pass pass, dw_accumulation accumulate,
                                               std::size_t budget) {
    const auto least = cpu_detail::make_linear_plan<T, G>(exec, shape, pass, accumulate, 1);
    const auto fixed = cpu_detail::make_linear_plan<T, G>(exec, shape, pass, accumulate, 0);
    const auto plan = cpu_detail::plan_linear<T, G>(exec, shape, pass, accumulate,
                                                    detail::chunk_budget(fixed.bytes, budget));
    return {least.bytes, plan.bytes, std::min(plan.chunk_rows, shape.rows)};
  }

  template <class T, class Tgt, class A>
  static void forward(const cpu& exec, matrix_view<const T> hidden, matrix_view<const T> weight,
                      vector_view<const T> bias, const Tgt& targets, const linear_options& opts,
                      const basic_forward_outputs<A>& out, const linear_workspace& ws) {
    cpu_detail::run_linear<cpu_detail::linear_mode::forward>(
        "xent::linear_forward", exec, hidden, weight, bias, targets, opts,
        static_cast<const basic_upstream<A>*>(nullptr), vector_view<const A>{}, out,
        linear_grads<A>{}, ws);
  }

  template <class T, class Tgt, class A, class G>
  static void forward_backward(const cpu& exec, matrix_view<const T> hidden,
                               matrix_view<const T> weight, vector_view<const T> bias,
                               const Tgt& targets, const linear_options& opts,
                               const basic_upstream<A>& up, const basic_forward_outputs<A>& out,
                               const linear_grads<G>& grads, const linear_workspace& ws) {
    cpu_detail::run_linear<cpu_detail::linear_mode::fused>("xent::linear_forward_backward", exec,
                                                           hidden, weight, bias, targets, opts, &up,
                                                           vector_view<const A>{}, out, grads, ws);
  }

  template <class T, class Tgt, class A, class G>
  static void backward(const cpu& exec, matrix_view<const T> hidden, matrix_view<const T> weight,
                       vector_view<const T> bias, const Tgt& targets, const linear_options& opts,
                       vector_view<const A> lse, const basic_upstream<A>& up,
                       const linear_grads<G>& grads, const linear_workspace& ws) {
    cpu_detail::run_linear<cpu_detail::linear_mode::backward>(
        "xent::linear_backward", exec, hidden, weight, bias, targets, opts, &up, lse,
        basic_forward_outputs<A>{}, grads, ws);
  }
};

}  // namespace xent
