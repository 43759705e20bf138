// What the vocab-parallel fused linear tests of every backend share
// (tests/cpu/vocab_parallel_linear_test.cpp, tests/cuda/cuda_vocab_parallel_linear_test.cu): each
// rank's shard of a linear case (linear_harness.hpp), the workspace a rank's calls get, what one
// rank's calls wrote, and the checks of the ranks' results put together. Host memory only.
//
// A case runs, on every rank, forward, forward_backward, and backward from forward's LSE. The
// checks: every rank's forward outputs are bitwise equal; rank 0's outputs, the d_weight and d_bias
// shards side by side, and the SUM of the ranks' partial d_hidden are held to the float64 linear
// oracle with the linear tests' bounds (linear_harness.hpp), and to the unsharded linear calls in
// the fast order with twice those bounds (both err): a case in the low-memory order is so held to
// the fast order. A bf16 / fp16 partial d_hidden is rounded once per rank
// before the sum: each adds its rounding to the bound.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/linear_harness.hpp"
#include "cpu/vocab_split.hpp"

namespace xvl {

using xtl::budget;
using xtl::ldata;

/// A rank's view of a case: the case with its weight rows, bias entries and soft-target columns cut
/// to classes [first, first + cols) (copied, padding holding the sentinel, so that a read outside
/// the shard is a read outside the buffer; spec.ce.cols = cols). Hidden, class ids, class weights
/// (all V of them) and upstream stay the case's: its options() and targets are the rank's
/// arguments as they are.
template <class T>
ldata<T> shard_of(const ldata<T>& L, std::int64_t first, std::int64_t cols) {
  ldata<T> r = L;
  const std::int64_t ld = L.s.ld();
  r.s.ce.cols = r.d.s.cols = cols;
  r.w.assign(L.w.begin() + first * ld, L.w.begin() + (first + cols) * ld);
  r.b.assign(L.b.begin() + first, L.b.begin() + first + cols);
  if (L.s.ce.kind == xt::target_kind::soft) {
    const std::int64_t pld = r.s.ce.ld();
    r.d.probs.assign(L.N() * pld, xt::sentinel<T>());
    for (std::int64_t n = 0; n < L.N(); ++n)
      for (std::int64_t c = 0; c < cols; ++c)
        r.d.probs[n * pld + c] = L.d.probs[n * L.s.ce.ld() + first + c];
  }
  return r;
}

template <class T>
std::vector<ldata<T>> shards_of(const ldata<T>& L, const xt::split& sp) {
  std::vector<ldata<T>> out;
  for (int r = 0; r < sp.ranks(); ++r) out.push_back(shard_of(L, sp.first(r), sp.cols(r)));
  return out;
}

/// The case in the fast order: what the unsharded reference calls run (in_fast_order(L)).
template <class T>
ldata<T> in_fast_order(ldata<T> L) {
  L.s.order = xent::linear_order::fast;
  return L;
}

/// What one rank's calls (or the unsharded calls) wrote: forward's outputs, forward_backward's
/// outputs and gradients, and the gradients of backward from forward's LSE. A rank's gradients
/// (xtl::gradients of its shard's spec) are its partial d_hidden and its d_weight / d_bias rows.
template <class G>
struct rank_result {
  xtl::outputs fwd, fb;
  xtl::gradients<G> gfb, gb;
  explicit rank_result(const xtl::lspec& s) : fwd(s.ce.rows), fb(s.ce.rows), gfb(s), gb(s) {}
};

/// The workspace a rank's calls get on `exec` (its bytes and the chunk_rows every rank gets):
/// one-row chunks in the least bytes, a few rows per chunk, or the default budget.
template <class T, class G, class Exec>
xent::linear_workspace_sizes workspace_for(const Exec& exec, const ldata<T>& L, std::int64_t cols,
                                           int ranks, xent::linear_pass pass) {
  auto query = [&](std::size_t b) {
    return xent::vocab_parallel_linear_workspace_size<T, G>(exec, {L.N(), L.D(), cols}, L.V(),
                                                            ranks, pass, L.options(), b);
  };
  if (L.s.space == budget::all_rows) return query(xent::linear_default_budget);
  xent::linear_workspace_sizes q = query(0);
  if (L.s.space == budget::minimal) return {q.minimal, q.minimal, q.chunk_rows};
  std::size_t b = 0;
  while (q.chunk_rows < std::min<std::int64_t>(4, L.N())) q = query(b += 16);
  return q;
}

/// The vocab-parallel workspace argument for a buffer and its sizes.
inline xent::vocab_parallel_linear_workspace vp_workspace(const xent::linear_workspace& ws,
                                                          const xent::linear_workspace_sizes& q) {
  xent::vocab_parallel_linear_workspace w;
  w.data = ws.data;
  w.bytes = ws.bytes;
  w.chunk_rows = q.chunk_rows;
  return w;
}

/// Every rank's forward outputs (of forward and of forward_backward) equal rank 0's, bit for bit.
template <class G>
std::string check_ranks_agree(const std::vector<rank_result<G>>& res) {
  auto same = [](const xtl::outputs& a, const xtl::outputs& b) {
    return xt::same_bits(a.loss, b.loss) && a.correct == b.correct && a.argmax == b.argmax &&
           std::equal(a.row_loss.begin(), a.row_loss.end(), b.row_loss.begin(),
                      xt::same_bits<float>) &&
           std::equal(a.lse.begin(), a.lse.end(), b.lse.begin(), xt::same_bits<float>);
  };
  std::string e;
  for (std::size_t r = 1; r < res.size(); ++r)
    if (!same(res[r].fwd, res[0].fwd) || !same(res[r].fb, res[0].fb))
      e += "  rank " + std::to_string(r) + "'s forward outputs differ from rank 0's\n";
  return e;
}

/// What each call's results are held to, when not the oracle's: the unsharded calls' values
/// (from_unsharded).
struct references {
  oracle::linear_result fwd, fb, gfb, gb;
};

template <class G>
std::vector<double> dense(const std::vector<G>& v, std::int64_t rows, std::int64_t cols,
                          std::int64_t ld) {
  std::vector<double> d(rows * cols);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) d[i * cols + j] = xt::to_double(v[i * ld + j]);
  return d;
}

/// The oracle's result with an unsharded call's values in place of the float64 ones (its
/// logits, which size the argmax tolerance, kept).
inline oracle::linear_result with_outputs(oracle::linear_result r, const xtl::outputs& u) {
  for (std::size_t n = 0; n < u.lse.size(); ++n) {
    r.ce.row_loss[n] = u.row_loss[n];
    r.ce.lse[n] = u.lse[n];
    r.ce.argmax[n] = u.argmax[n];
  }
  r.ce.loss = u.loss;
  return r;
}

template <class G>
oracle::linear_result with_gradients(oracle::linear_result r, const xtl::gradients<G>& g) {
  const xtl::lspec& s = g.s;
  r.dx = dense(g.dx, s.ce.rows, s.hidden, s.ld());
  r.dw = dense(g.dw, s.ce.cols, s.hidden, s.ld());
  r.db = dense(g.db, 1, s.ce.cols, s.ce.cols);
  return r;
}

template <class G>
references from_unsharded(const oracle::linear_result& r, const rank_result<G>& u) {
  return {with_outputs(r, u.fwd), with_outputs(r, u.fb), with_gradients(r, u.gfb),
          with_gradients(r, u.gb)};
}

/// Every bound doubled: two results, each within its bounds of the truth.
inline xtl::bounds twice(xtl::bounds e) {
  for (auto* v : {&e.dz, &e.grad, &e.row_loss, &e.lse, &e.dx, &e.dw, &e.db})
    for (double& x : *v) x *= 2;
  e.loss *= 2;
  return e;
}

/// The ranks' gradients (`which` of each rank_result) put together: d_weight and d_bias shards
/// side by side, held to ref with check_array, and the sum of the partial d_hidden, held to
/// ref.dx within e.dx plus each partial's rounding to G (and the rounding of a G-valued ref).
template <class T, class G>
std::string check_gradients(const ldata<T>& L, const xt::split& sp,
                            const std::vector<const xtl::gradients<G>*>& g,
                            const oracle::linear_result& ref, const xtl::bounds& e) {
  const std::int64_t N = L.N(), D = L.D(), ld = L.s.ld();
  xtl::gradients<G> full(L.s);
  std::ostringstream err;
  for (int r = 0; r < sp.ranks(); ++r) {
    std::copy(g[r]->dw.begin(), g[r]->dw.end(), full.dw.begin() + sp.first(r) * ld);
    std::copy(g[r]->db.begin(), g[r]->db.end(), full.db.begin() + sp.first(r));
  }
  std::string out = xtl::check_array("d_weight", full.dw.data(), L.V(), D, ld, ref.dw, e.dw);
  if (L.s.bias) {
    out += xtl::check_array("d_bias", full.db.data(), 1, L.V(), L.V(), ref.db, e.db);
  } else {
    for (const G& v : full.db)
      if (!xt::same_bits(v, xt::sentinel<G>())) return out + "  d_bias written without a bias\n";
  }
  const double u = xt::unit_roundoff<G>(), step = xt::subnormal_step<G>();
  int failures = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    for (int r = 0; r < sp.ranks(); ++r)
      for (std::int64_t k = D; k < ld; ++k)
        if (!xt::same_bits(g[r]->dx[n * ld + k], xt::sentinel<G>()) && failures++ < 3)
          err << "  d_hidden of rank " << r << ": padding (" << n << ", " << k << ") written\n";
    for (std::int64_t k = 0; k < D; ++k) {
      double sum = 0.0, rounding = 0.0;
      for (int r = 0; r < sp.ranks(); ++r) {
        const double p = xt::to_double(g[r]->dx[n * ld + k]);
        sum += p;
        rounding += 2 * u * std::fabs(p) + step;
      }
      const double want = ref.dx[n * D + k], t = e.dx[n * D + k];
      const double tol = t + rounding + 2 * u * (std::fabs(want) + t) + step;
      if (!xt::close(sum, want, tol) && failures++ < 3)
        err << "  d_hidden (sum of the ranks' partials) (" << n << ", " << k
            << ") = " << xt::num(sum) << " vs " << xt::num(want) << " (tol " << xt::num(tol)
            << ")\n";
    }
  }
  return out + err.str();
}

/// Every result of the ranks within `e` of its reference (forward's outputs of `fwd`, ...):
/// rank 0's forward outputs (check_ranks_agree holds the others to them), each training call's
/// gradients put together.
template <class T, class G>
std::string check_results(const ldata<T>& L, const xt::split& sp,
                          const std::vector<rank_result<G>>& res, const oracle::linear_result& fwd,
                          const oracle::linear_result& fb, const oracle::linear_result& gfb,
                          const oracle::linear_result& gb, const xtl::bounds& e) {
  std::string errors;
  auto note = [&](const char* what, const std::string& m) {
    if (!m.empty()) errors += std::string(what) + ":\n" + m;
  };
  note("vocab_parallel_linear_forward", xtl::check_outputs(L, fwd, e, res[0].fwd));
  note("vocab_parallel_linear_forward_backward", xtl::check_outputs(L, fb, e, res[0].fb));
  std::vector<const xtl::gradients<G>*> grads_fb, grads_b;
  for (const auto& r : res) {
    grads_fb.push_back(&r.gfb);
    grads_b.push_back(&r.gb);
  }
  note("vocab_parallel_linear_forward_backward", check_gradients(L, sp, grads_fb, gfb, e));
  note("vocab_parallel_linear_backward", check_gradients(L, sp, grads_b, gb, e));
  return errors;
}

/// Against the oracle: every call's results held to its one result.
template <class T, class G>
std::string check_results(const ldata<T>& L, const xt::split& sp,
                          const std::vector<rank_result<G>>& res, const oracle::linear_result& r,
                          const xtl::bounds& e) {
  return check_results(L, sp, res, r, r, r, r, e);
}

/// Against the unsharded calls.
template <class T, class G>
std::string check_results(const ldata<T>& L, const xt::split& sp,
                          const std::vector<rank_result<G>>& res, const references& u,
                          const xtl::bounds& e) {
  return check_results(L, sp, res, u.fwd, u.fb, u.gfb, u.gb, e);
}

/// The rank counts and splits the option sweeps cycle through: case i runs on 1 + i % 4 ranks,
/// on one of that count's splits.
inline xt::split split_for(std::int64_t vocab, int i) {
  const int ranks = 1 + i % 4;
  const std::vector<xt::split> all = xt::splits(vocab, ranks);
  return all[static_cast<std::size_t>(i / 4) % all.size()];
}

}  // namespace xvl
