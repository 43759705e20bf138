// The sparse backward's cases (linear_options::sparse_threshold), shared by the CPU and CUDA
// tests: inputs shaped like a trained model's so that tiles are skipped, the float64 oracle's bound
// on what skipping may move (linear/options.hpp's), its count of the cold tiles, and one case run
// through a backend.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cpu/harness.hpp"
#include "cpu/linear_harness.hpp"
#include "oracle/linear_oracle.hpp"

namespace xtl {

/// The sparse cases' threshold: large enough that their small vocabularies have cold tiles.
constexpr float sparse_tau = 1.0f / 32;
constexpr std::int64_t peaked_rows = 128;

/// Rows [0, peaked_rows) shaped like a trained model's: hidden_n = c weight[t_n] / |weight[t_n]|^2
/// with t_n among the first 40 classes (the first weight block), so the row's softmax is peaked
/// there and every other block's probabilities are small; the class-id target is t_n (ignored
/// rows stay ignored), soft targets 3/4 on t_n and 1/4 on t_n + 1. Later rows stay random (every
/// tile of theirs is kept).
template <class T>
void shape_like_trained(ldata<T>& L) {
  const std::int64_t N = L.N(), D = L.D(), ld = L.s.ld();
  std::mt19937_64 rng(L.s.ce.seed + 5);
  std::uniform_int_distribution<std::int64_t> topic(0, 39);
  for (std::int64_t n = 0; n < std::min(N, peaked_rows); ++n) {
    const std::int64_t t = topic(rng);
    double norm2 = 0.0;
    for (std::int64_t k = 0; k < D; ++k) norm2 += std::pow(xt::to_double(L.w[t * ld + k]), 2);
    for (std::int64_t k = 0; k < D; ++k)
      L.x[n * ld + k] = xt::from_double<T>(14.0 * xt::to_double(L.w[t * ld + k]) / norm2);
    if (L.s.ce.kind == target_kind::soft) {
      for (std::int64_t v = 0; v < L.V(); ++v)
        L.d.probs[n * L.d.s.ld() + v] = xt::from_double<T>(v == t ? 0.75 : v == t + 1 ? 0.25 : 0.0);
    } else if (L.d.target(n) != L.s.ce.ignore_index) {
      L.d.set_target(n, t);
    }
  }
}

/// The case with the sparse bound added to its error bounds, and the oracle's count of the tiles
/// that are cold for certain and of those that may be (the float logits and LSE may put a tile
/// either side of log tau within their errors).
template <class T>
struct sparse_judged {
  ldata<T> L;
  oracle::linear_problem pb;
  oracle::upstream up;
  oracle::linear_result r;
  bounds e;
  std::int64_t surely_cold = 0, maybe_cold = 0;

  /// `chunk_rows`: the backend's panel sub-chunks' rows; its row tiles restart at each
  /// (`global_tiles` false) or are 64 global rows cut at the sub-chunks' ends (true). `stored`:
  /// the roundings its logits and their gradient take (linear_backend_tests.hpp's stored<T>()).
  sparse_judged(const lspec& s, std::int64_t chunk_rows, bool global_tiles, rounding stored = {})
      : L(make_data<T>(s)) {
    shape_like_trained(L);
    pb = L.problem();
    up = L.d.oracle_upstream();
    r = oracle::evaluate_linear(pb, &up);
    e = error_bounds(L, pb, r, 0.0, stored);
    add_sparse_bound(chunk_rows, global_tiles);
  }

  /// Counts tile [r0, r1) x [v0, v1) and, when it may be cold, adds what it may drop.
  void add_tile(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1,
                const std::vector<double>& ga) {
    const oracle::problem& ce = pb.ce;
    const std::int64_t V = L.V(), D = L.D();
    const double log_tau = std::log(static_cast<double>(sparse_tau));
    bool maybe = true, surely = true;
    for (std::int64_t n = r0; n < r1; ++n) {
      if (ce.ignored(n)) continue;
      for (std::int64_t j = v0; j < v1; ++j) {
        const bool target = ce.soft ? ce.probs[n * V + j] != 0.0 : ce.targets[n] == j;
        const double margin = r.ce.z[n * V + j] - r.ce.lse[n] - log_tau;
        const double slack = e.lse[n] + 2.0 * e.dz[n * V + j] + 1e-6;
        if (target || margin >= slack) maybe = false;
        if (target || margin >= -slack) surely = false;
      }
    }
    surely_cold += surely;
    maybe_cold += maybe;
    if (!maybe) return;
    for (std::int64_t n = r0; n < r1; ++n)
      for (std::int64_t j = v0; j < v1; ++j) {
        const double drop = ga[n] * std::exp(r.ce.z[n * V + j] - r.ce.lse[n]);
        e.db[j] += drop;
        for (std::int64_t k = 0; k < D; ++k) {
          e.dx[n * D + k] += drop * std::fabs(pb.w[j * D + k]);
          e.dw[j * D + k] += drop * std::fabs(pb.x[n * D + k]);
        }
      }
  }

  /// Each element a cold tile may drop is |g_n alpha_n| p_nj (times the softcap slope, at most
  /// 1); smoothing's rank-1 term, summed apart, adds a float rounding of its own sums.
  void add_sparse_bound(std::int64_t chunk_rows, bool global_tiles) {
    const oracle::problem& ce = pb.ce;
    const std::int64_t N = L.N(), V = L.V(), D = L.D();
    // Both backends' tiles: 64 rows x 256 classes.
    const std::int64_t tile = 64, block = 256;
    const double u = xt::unit_roundoff<float>(), eps = ce.label_smoothing;
    std::vector<double> g(N, 0.0), ga(N, 0.0);
    for (std::int64_t n = 0; n < N; ++n) {
      if (ce.ignored(n)) continue;
      g[n] = ce.reduce == oracle::reduction::none   ? (up.rows.empty() ? up.scale : up.rows[n])
             : ce.reduce == oracle::reduction::mean ? up.scale / r.ce.normalizer
                                                    : up.scale;
      double mass = 0.0;
      for (std::int64_t c = 0; c < V; ++c) mass += oracle::weighted_target(ce, n, c);
      ga[n] = std::fabs(g[n] * (mass + 2.0 * ce.z_loss * r.ce.lse[n]));
    }
    for (std::int64_t c0 = 0; c0 < N; c0 += chunk_rows) {
      const std::int64_t c1 = std::min(N, c0 + chunk_rows);
      for (std::int64_t r0 = c0; r0 < c1;) {
        const std::int64_t r1 = std::min(c1, global_tiles ? (r0 / tile + 1) * tile : r0 + tile);
        for (std::int64_t v0 = 0; v0 < V; v0 += block)
          add_tile(r0, r1, v0, std::min(V, v0 + block), ga);
        r0 = r1;
      }
    }
    if (eps == 0.0) return;
    double gsum = 0.0;
    std::vector<double> s(D, 0.0), wu(D, 0.0);
    for (std::int64_t n = 0; n < N; ++n) {
      gsum += std::fabs(g[n]);
      for (std::int64_t k = 0; k < D; ++k) s[k] += std::fabs(g[n] * pb.x[n * D + k]);
    }
    for (std::int64_t j = 0; j < V; ++j)
      for (std::int64_t k = 0; k < D; ++k) wu[k] += std::fabs(ce.weight(j) * pb.w[j * D + k]);
    const double f = eps / static_cast<double>(V);
    for (std::int64_t j = 0; j < V; ++j) {
      e.db[j] += 4.0 * (N + 2) * u * f * std::fabs(ce.weight(j)) * gsum;
      for (std::int64_t k = 0; k < D; ++k)
        e.dw[j * D + k] += 4.0 * (N + 2) * u * f * std::fabs(ce.weight(j)) * s[k];
    }
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t k = 0; k < D; ++k)
        e.dx[n * D + k] += 4.0 * (V + 2) * u * f * std::fabs(g[n]) * wu[k];
  }
};

/// Whether two forward outputs hold the same bits.
template <class A>
bool same_outputs(const basic_outputs<A>& a, const basic_outputs<A>& b) {
  auto same = [](const auto& x, const auto& y) {
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!xt::same_bits(x[i], y[i])) return false;
    return true;
  };
  return xt::same_bits(a.loss, b.loss) && a.correct == b.correct && same(a.row_loss, b.row_loss) &&
         same(a.lse, b.lse) && a.argmax == b.argmax;
}

/// One case in the low-memory order with the threshold sparse_tau through backend B
/// (linear_backend_tests.hpp, with the sparse members of linear_host_backend.hpp):
/// forward_backward's outputs the same bits as at threshold 0, its gradients and linear_backward's
/// within the sparse bound, their tile counts those the oracle finds cold (where the backend's
/// tiles are the oracle's: not global tiles over several sub-chunks, which forward_backward marks
/// whole). Returns whether it passed (a failure is reported).
template <class T, class G = T, class B>
bool run_sparse_case(const B& backend, lspec s) {
  using A = xent::accumulator_t<T>;
  s.order = xent::linear_order::low_memory;
  typename B::error_count errors;
  const auto exec = backend.exec(s, errors);
  const std::size_t exact_bytes =
      workspace_bytes<T, G>(exec, make_data<T>(s), xent::linear_pass::training);
  s.sparse_threshold = sparse_tau;
  const std::size_t bytes =
      workspace_bytes<T, G>(exec, make_data<T>(s), xent::linear_pass::training);
  const std::int64_t chunk_rows =
      B::template sparse_chunk_rows<T, G>(exec, {s.ce.rows, s.hidden, s.ce.cols}, bytes);
  const sparse_judged<T> J(s, chunk_rows, B::sparse_global_tiles, B::template stored<T>());
  const bool counted = !B::sparse_global_tiles || chunk_rows >= s.ce.rows;
  const typename B::template inputs<T> in(J.L);
  xent::linear_options sparse = in.options(), exact = sparse;
  exact.sparse_threshold = 0.0f;
  typename B::sparse_counts fb_counts, b_counts;
  std::string errs;

  typename B::template outputs<A> dense_out(J.L.N()), out(J.L.N());
  typename B::template grads<G> dense_g(s), g(s), gb(s);
  typename B::workspace dense_ws(exact_bytes, B::offset(s.ce.seed, 0)),
      ws(bytes, B::offset(s.ce.seed, 1));
  in.with_targets([&](auto t) {
    xent::linear_forward_backward(exec, in.hidden(), in.weight(), in.bias(), t, exact,
                                  in.upstream(), dense_out.all(s.ce), dense_g.views(), dense_ws.ws);
    sparse.sparse_counts = fb_counts.ptr();
    xent::linear_forward_backward(exec, in.hidden(), in.weight(), in.bias(), t, sparse,
                                  in.upstream(), out.all(s.ce), g.views(), ws.ws);
    sparse.sparse_counts = b_counts.ptr();
    xent::linear_backward(exec, in.hidden(), in.weight(), in.bias(), t, sparse,
                          dense_out.lse_view(), in.upstream(), gb.views(), ws.ws);
  });
  B::sync();
  const basic_outputs<A> o = out.fetch();
  if (!same_outputs(o, dense_out.fetch())) errs += "  forward outputs differ from threshold 0's\n";
  errs += check_outputs(J.L, J.r, J.e, o);
  errs += check_gradients(J.L, J.r, J.e, g.fetch());
  errs += check_gradients(J.L, J.r, J.e, gb.fetch());
  for (const auto& c : {fb_counts.fetch(), b_counts.fetch()})
    if (counted && (c.skipped < J.surely_cold || c.skipped > J.maybe_cold || c.tiles < c.skipped))
      errs += "  " + std::to_string(c.skipped) + " of " + std::to_string(c.tiles) +
              " tiles skipped, the oracle finds " + std::to_string(J.surely_cold) + " to " +
              std::to_string(J.maybe_cold) + " cold\n";
  if (J.surely_cold == 0) errs += "  no tile is surely cold: the case checks nothing sparse\n";
  if (!errs.empty()) ADD_FAILURE() << s.describe() << " threshold=" << sparse_tau << "\n" << errs;
  return errs.empty();
}

}  // namespace xtl
