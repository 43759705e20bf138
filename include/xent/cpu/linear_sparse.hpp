// The sparse backward of the low-memory order on the CPU (linear_options::sparse_threshold tau):
// a panel sub-chunk's logits are cut into tiles of sparse_tile_rows rows x one weight block. A
// tile is cold when, on each of its rows not ignored, the largest (soft-capped) logit z satisfies
// z - lse < log tau (so every p_nj < tau), the row's class-id target is not among its classes and
// (soft targets) its target probabilities are all 0. A cold tile's gradient is never written, and
// the d_weight, d_bias and d_hidden GEMMs run over the hot tiles alone (consecutive hot row tiles
// of a block as one GEMM). What a cold tile drops is g_n alpha_n p_nj s_nj on each of its elements
// (linear/options.hpp states the bound).
//
// Which tiles are cold: linear_forward_backward marks each row's cold weight blocks while its
// statistics pass has the logits (mark_cold_rows), so a panel computes only its hot tiles' logits
// (sparse_logits); linear_backward has no such pass and tests the panel's logits
// (mark_tiles_from_logits).
//
// Label smoothing's term of the logit gradient, -g_n w_j eps / V on every row not ignored and
// every class, is rank 1 (softcap, whose slope would make it full rank, is refused with a
// threshold): the tiles are written without it and it is added once, exactly:
//   d_weight[j] -= (eps / V) w_j S,  d_bias[j] -= (eps / V) w_j sum_n g_n,
//   d_hidden[n] -= (eps / V) g_n U,  S = sum_n g_n hidden_n,  U = sum_j w_j weight_j.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../accumulator.hpp"
#include "../loss_math.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "backend.hpp"
#include "linear_plan.hpp"
#include "linear_steps.hpp"
#include "parallel.hpp"
#include "row_pass.hpp"

namespace xent {
namespace cpu_detail {

/// The tiles of a sub-chunk of `rows` rows of a panel call: `hot` holds a byte per tile, row
/// tiles major.
struct sparse_tiles {
  unsigned char* hot;
  std::int64_t rows, row_tiles, blocks;

  bool is_hot(std::int64_t rt, std::int64_t b) const { return hot[rt * blocks + b] != 0; }
  std::int64_t first_row(std::int64_t rt) const { return rt * sparse_tile_rows; }
  std::int64_t end_row(std::int64_t rt) const {
    return std::min(rows, (rt + 1) * sparse_tile_rows);
  }
  std::int64_t cold() const {
    std::int64_t n = 0;
    for (std::int64_t i = 0; i < row_tiles * blocks; ++i) n += !hot[i];
    return n;
  }
};

/// Calls f(r, n) for each run of consecutive hot row tiles of block `b` among row tiles [t0, t1):
/// rows [r, r + n) of the sub-chunk.
template <class F>
void for_each_hot_run(const sparse_tiles& t, std::int64_t b, std::int64_t t0, std::int64_t t1,
                      F&& f) {
  for (std::int64_t rt = t0; rt < t1;) {
    if (!t.is_hot(rt, b)) {
      ++rt;
      continue;
    }
    std::int64_t end = rt + 1;
    while (end < t1 && t.is_hot(end, b)) ++end;
    f(t.first_row(rt), t.end_row(end - 1) - t.first_row(rt));
    rt = end;
  }
}

/// Whether tile rows [r0, r1) x columns [v0, v1) of the panel problem `pb` (its logits the
/// sub-chunk's) must be kept: some row not ignored has a logit with z - lse >= log tau (or NaN),
/// or its target among the columns.
template <class T, class Tgt, class Lse, class A = accumulator_t<T>>
bool tile_is_hot(const problem<T, Tgt>& pb, std::int64_t r0, std::int64_t r1, std::int64_t v0,
                 std::int64_t v1, const Lse& lse_of, A log_tau) {
  for (std::int64_t n = r0; n < r1; ++n) {
    if (pb.ignored(n)) continue;
    if constexpr (problem<T, Tgt>::soft) {
      const auto* t = pb.targets.probs.row(n);
      for (std::int64_t j = v0; j < v1; ++j)
        if (static_cast<float>(t[j]) != 0.0f) return true;
    } else {
      const std::int64_t y = pb.target(n);
      if (y >= v0 && y < v1) return true;
    }
    const A m = const_tmap<T>(pb.logits.row(n) + v0, v1 - v0)
                    .template cast<A>()
                    .template maxCoeff<Eigen::PropagateNaN>();
    if (!(apply_softcap(m, pb.k) - lse_of(n) < log_tau)) return true;  // NaN is kept
  }
  return false;
}

/// Row i's cold weight blocks of a statistics chunk (`pb`: its logits over the whole vocabulary
/// and its rows' targets): cold[i * blocks + b] = 1 when the row alone would make block b's tile
/// cold (an ignored row always does).
template <class T, class G, class Tgt, class Lse, class A>
void mark_cold_rows(const linear_call<T, G>& c, const problem<A, Tgt>& pb, const Lse& lse_of,
                    A log_tau, unsigned char* cold) {
  const std::int64_t rows = pb.logits.rows, cols = pb.logits.cols, block = linear_block_rows;
  const std::int64_t blocks = (cols + block - 1) / block;
  parallel_for(c.threads(rows), rows, [&](std::int64_t a, std::int64_t e, int) {
    for (std::int64_t i = a; i < e; ++i)
      for (std::int64_t b = 0; b < blocks; ++b)
        cold[i * blocks + b] =
            !tile_is_hot(pb, i, i + 1, b * block, std::min(cols, (b + 1) * block), lse_of, log_tau);
  });
}

/// A sub-chunk's tile flags from its rows' cold blocks (`cold`: the sub-chunk's first row's, rows
/// `blocks` apart; the panel's first block is b0): a tile is hot when one of its rows is.
inline void mark_tiles_from_rows(const sparse_tiles& t, const unsigned char* cold,
                                 std::int64_t blocks, std::int64_t b0) {
  for (std::int64_t rt = 0; rt < t.row_tiles; ++rt)
    for (std::int64_t b = 0; b < t.blocks; ++b) {
      bool hot = false;
      for (std::int64_t n = t.first_row(rt); n < t.end_row(rt) && !hot; ++n)
        hot = !cold[n * blocks + b0 + b];
      t.hot[rt * t.blocks + b] = hot;
    }
}

/// A sub-chunk's tile flags from its logits (`pb`, the panel's problem; tile_is_hot).
template <class T, class G, class Tgt, class Lse, class A>
void mark_tiles_from_logits(const linear_call<T, G>& c, const problem<A, Tgt>& pb,
                            const Lse& lse_of, A log_tau, const sparse_tiles& t) {
  const std::int64_t cols = pb.logits.cols, block = c.plan.block;
  parallel_for(c.threads(t.rows), t.row_tiles * t.blocks,
               [&](std::int64_t begin, std::int64_t end, int) {
                 for (std::int64_t i = begin; i < end; ++i) {
                   const std::int64_t rt = i / t.blocks, v0 = i % t.blocks * block;
                   t.hot[i] = tile_is_hot(pb, t.first_row(rt), t.end_row(rt), v0,
                                          std::min(cols, v0 + block), lse_of, log_tau);
                 }
               });
}

/// The logits of the hot tiles, L = X · Wᵀ (+ b), as chunk_logits computes all of them: by weight
/// block, a GEMM per run of consecutive hot row tiles.
template <class T, class G, class A>
void sparse_logits(const linear_call<T, G>& c, const const_acc_rows_map<A>& x,
                   acc_rows_map<A>& logits, const A* bias, const sparse_tiles& t) {
  for_each_block(c, x.rows(), [&](std::int64_t v0, std::int64_t nb, int worker) {
    const std::int64_t b = v0 / c.plan.block;
    bool any = false;
    for (std::int64_t rt = 0; rt < t.row_tiles && !any; ++rt) any = t.is_hot(rt, b);
    if (!any) return;  // the block is converted only when a tile uses it
    const auto w = weight_block(c, worker, v0, nb);
    for_each_hot_run(t, b, 0, t.row_tiles, [&](std::int64_t r, std::int64_t n) {
      auto tile = logits.block(r, v0, n, nb);
      tile.noalias() = x.middleRows(r, n) * w.transpose();
      if (bias) tile.rowwise() += const_acc_row_vector_map<A>(bias + v0, nb);
    });
  });
}

/// The gradient of the hot tiles of a sub-chunk into `grad` (its logits' memory: written in place,
/// by slice_gradient as write_gradient does; ignored rows zero).
template <class T, class G, class Tgt, class Lse, class Mass, class A>
void write_hot_gradients(const linear_call<T, G>& c, const problem<A, Tgt>& pb, const Lse& lse_of,
                         const Mass& mass_of, const row_scales<A>& scale, const sparse_tiles& t,
                         matrix_view<A> grad) {
  const std::int64_t cols = pb.logits.cols, block = c.plan.block;
  parallel_for(c.threads(t.rows), t.row_tiles * t.blocks,
               [&](std::int64_t begin, std::int64_t end, int) {
                 for (std::int64_t i = begin; i < end; ++i) {
                   if (!t.hot[i]) continue;
                   const std::int64_t rt = i / t.blocks, v0 = i % t.blocks * block;
                   const std::int64_t v1 = std::min(cols, v0 + block);
                   for (std::int64_t n = t.first_row(rt); n < t.end_row(rt); ++n) {
                     if (pb.ignored(n))
                       zero_slice(grad.row(n), v0, v1);
                     else
                       slice_gradient(pb, n, v0, v1, lse_of(n), mass_of(n), scale(n), grad.row(n));
                   }
                 }
               });
}

/// d_weight += Gᵀ · X and d_bias += column sums of G over the hot tiles, by weight block (as
/// chunk_weight_grads; the low-memory order sums in float, so there is no per-chunk fold).
template <class T, class G, class A>
void sparse_weight_grads(const linear_call<T, G>& c, const const_acc_rows_map<A>& x,
                         const acc_rows_map<A>& grad, const sparse_tiles& t) {
  A* dw = c.dw_sum();
  A* db = c.db_sum();
  if (!dw && !db) return;
  const std::int64_t D = c.dim();
  for_each_block(c, x.rows(), [&](std::int64_t v0, std::int64_t nb, int) {
    for_each_hot_run(t, v0 / c.plan.block, 0, t.row_tiles, [&](std::int64_t r, std::int64_t n) {
      const auto g = grad.block(r, v0, n, nb);
      if (dw)
        acc_rows_map<A>(dw + v0 * c.dw_sum_ld(), nb, D, Eigen::OuterStride<>(c.dw_sum_ld()))
            .noalias() += g.transpose() * x.middleRows(r, n);
      if (db) add_column_sums(db + v0, g);
    });
  });
}

/// Rows [r0, r0 + rows) of d_hidden's sum `dx` (leading dimension ldx) += G · W over the hot
/// tiles: each worker takes whole row tiles and sums its rows over the blocks in order, as
/// chunk_hidden_grads does.
template <class T, class G, class A>
void sparse_hidden_grads(const linear_call<T, G>& c, const acc_rows_map<A>& grad,
                         const sparse_tiles& t, A* dx, std::int64_t ldx, std::int64_t r0) {
  const std::int64_t D = c.dim();
  parallel_for(c.threads(t.rows), t.row_tiles, [&](std::int64_t t0, std::int64_t t1, int worker) {
    for (std::int64_t v0 = 0, b = 0; v0 < c.vocab(); v0 += c.plan.block, ++b) {
      bool any = false;
      for (std::int64_t rt = t0; rt < t1 && !any; ++rt) any = t.is_hot(rt, b);
      if (!any) continue;  // the block is converted only when a tile uses it
      const std::int64_t nb = std::min(c.plan.block, c.vocab() - v0);
      const auto w = weight_block(c, worker, v0, nb);
      for_each_hot_run(t, b, t0, t1, [&](std::int64_t r, std::int64_t n) {
        acc_rows_map<A> out(dx + (r0 + r) * ldx, n, D, Eigen::OuterStride<>(ldx));
        out.noalias() += grad.block(r, v0, n, nb) * w;
      });
    }
  });
}

/// Label smoothing's rank-1 term (header): S and U in `sums` (2 x D), sum_n g_n, and eps / V.
template <class A>
struct smoothing_term {
  A* s = nullptr;  ///< S = sum_n g_n hidden_n over rows not ignored; null: no smoothing
  A* u = nullptr;  ///< U = sum_j w_j weight_j over the whole vocabulary
  A g_sum = A(0);
  A smooth = A(0);
  std::int64_t dim = 0;
};

template <class T, class Tgt, class A>
smoothing_term<A> make_smoothing_term(matrix_view<const T> hidden, matrix_view<const T> weight,
                                      const problem<A, Tgt>& whole, const row_scales<A>& scale,
                                      A* sums) {
  smoothing_term<A> st;
  if (!whole.k.smoothing()) return st;
  const std::int64_t D = hidden.cols;
  st.s = sums;
  st.u = sums + D;
  st.smooth = whole.k.smooth;
  st.dim = D;
  acc_row_vector_map<A> s(st.s, D), u(st.u, D);
  s.setZero();
  u.setZero();
  for (std::int64_t n = 0; n < hidden.rows; ++n) {
    if (whole.ignored(n)) continue;
    const A g = scale(n);
    st.g_sum += g;
    if (D > 0)  // a matrix of no columns may have null data: no row address is formed
      s += g * const_tmap<T>(hidden.row(n), D).template cast<A>().matrix().transpose();
  }
  if (D > 0)
    for (std::int64_t j = 0; j < weight.rows; ++j)
      u +=
          whole.weight(j) * const_tmap<T>(weight.row(j), D).template cast<A>().matrix().transpose();
  return st;
}

/// The term's d_weight and d_bias rows of panel call `c` (weight rows [v0, v0 + vocab)), into
/// its float sums before they are rounded.
template <class T, class G, class Tgt, class A>
void add_smoothing_to_panel(const linear_call<T, G>& c, const smoothing_term<A>& st,
                            const problem<A, Tgt>& whole, std::int64_t v0) {
  if (!st.s) return;
  A* dw = c.dw_sum();
  A* db = c.db_sum();
  const const_acc_row_vector_map<A> s(st.s, st.dim);
  for (std::int64_t j = 0; j < c.vocab(); ++j) {
    const A f = st.smooth * whole.weight(v0 + j);
    if (dw) acc_row_vector_map<A>(dw + j * c.dw_sum_ld(), st.dim) -= f * s;
    if (db) db[j] -= f * st.g_sum;
  }
}

/// The term's d_hidden rows into d_hidden's float sum `dx` (leading dimension ldx).
template <class Tgt, class A>
void add_smoothing_to_hidden(const smoothing_term<A>& st, const problem<A, Tgt>& whole,
                             const row_scales<A>& scale, A* dx, std::int64_t ldx) {
  if (!st.s || !dx) return;
  const const_acc_row_vector_map<A> u(st.u, st.dim);
  for (std::int64_t n = 0; n < whole.logits.rows; ++n)
    if (!whole.ignored(n)) acc_row_vector_map<A>(dx + n * ldx, st.dim) -= st.smooth * scale(n) * u;
}

}  // namespace cpu_detail
}  // namespace xent
