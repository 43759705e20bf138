// The steps of fused linear cross-entropy on the CPU that both training orders (cpu/linear.hpp's
// row chunks, cpu/linear_low_memory.hpp's vocabulary panels) are made of: a call's operands and
// workspace buffers, the logits GEMM of a chunk of rows over a range of weight rows, and the
// gradient GEMMs that fold the chunk's logit gradient into d_weight, d_bias and d_hidden.
// "float" is the inputs' accumulator A (accumulator.hpp): double for double inputs.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../accumulator.hpp"
#include "../linear/options.hpp"
#include "../views.hpp"
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
/// converted into `scratch` (n x cols, dense). A matrix of no columns may have null data
/// (validation accepts it as empty) and null + offset is undefined, so no row address is formed.
template <class T, class A = accumulator_t<T>>
const_acc_rows_map<A> float_rows(const matrix_view<const T>& m, std::int64_t r0, std::int64_t n,
                                 A* scratch) {
  if constexpr (std::is_same<T, A>::value) {
    return const_acc_rows_map<A>(m.cols == 0 ? m.data : m.row(r0), n, m.cols,
                                 Eigen::OuterStride<>(m.ld));
  } else {
    if (m.cols > 0)
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

/// sums[0, n) += the column sums of `g` (rows x n, n at most linear_block_rows), each column's
/// terms added in row order. Eigen's vectorised colwise().sum() associates a column's terms by
/// where its packets start, so d_bias's bits followed the address of the caller's d_bias.
template <class A, class M>
void add_column_sums(A* sums, const M& g) {
  std::array<A, linear_block_rows> buffer;
  acc_row_vector_map<A> s(buffer.data(), g.cols());
  s.setZero();
  for (Eigen::Index i = 0; i < g.rows(); ++i) s += g.row(i);
  acc_row_vector_map<A>(sums, g.cols()) += s;
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
    if (db) add_column_sums(db + v0, g);
  });
}

/// out += G[a, b) · W over every weight block of the call, with `worker`'s block buffer.
template <class T, class G, class A>
void add_grad_times_weight(const linear_call<T, G>& c, const acc_rows_map<A>& grad, std::int64_t a,
                           std::int64_t b, acc_rows_map<A>& out, int worker) {
  for (std::int64_t v0 = 0; v0 < c.vocab(); v0 += c.plan.block) {
    const std::int64_t nb = std::min(c.plan.block, c.vocab() - v0);
    out.noalias() += grad.block(a, v0, b - a, nb) * weight_block(c, worker, v0, nb);
  }
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
    add_grad_times_weight(c, grad, a, b, out, worker);
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

}  // namespace cpu_detail
}  // namespace xent
