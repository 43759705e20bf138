// What the fused linear cross-entropy tests of every backend share (tests/cpu/linear_test.cpp,
// tests/cuda/cuda_linear_test.cu): a case description, inputs generated in double and rounded to
// the dtype under test, the error bounds that hold each result to the float64 linear oracle
// (tests/oracle/linear_oracle.hpp), and the checks. Host memory only: a device backend copies its
// results back before checking them.
//
// Tolerances. Inputs are rounded to the dtype under test and the oracle is fed the rounded values,
// so xent's only errors are its float arithmetic and the roundings of what it stores:
//   - a logit sums D + 1 products in float: |dz| <= 2 (D + 2) u * sum_d |x w| + |b| (u = 2^-24;
//     twice the usual gamma_{D+1} bound for margin); a backend that stores the logits in the
//     inputs' dtype (CUDA) adds that dtype's rounding of |z| (rounding::logits);
//   - the cross-entropy core on those logits errs as the CE tests allow (harness.hpp: fwd_tol of
//     the loss terms, bwd_tol of the gradient terms), plus what the logit errors carry: a row loss
//     moves by sum_v |dl/dz_v| |dz_v|, a gradient element by its magnitude times the relative
//     change of p_v (|dz_v| + max |dz|), and of the softcap slope (2 |dz_v| / cap); a backend that
//     stores the logit gradient in the inputs' dtype before the GEMMs adds one rounding of it
//     (rounding::grad, rounding::grad_floor);
//   - d_hidden, d_weight and d_bias sum V, N and N of those elements in float: the propagated
//     element errors plus 2 (K + 2) u of the sum of the terms' magnitudes (K the sum's length);
//   - a bf16 / fp16 output is rounded once: twice its unit roundoff of the value, plus the
//     smallest subnormal step; d_weight accumulated in its own dtype (dw_accumulation::output)
//     is rounded once per chunk instead.
// float64 inputs compute in double: the same model with u = 2^-53 and the CE tolerances scaled to
// double (xt::tolerance_scale).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/harness.hpp"
#include "oracle/linear_oracle.hpp"

namespace xtl {

using xent::reduction;
using xt::bf16;
using xt::half;
using xt::ignore_mode;
using xt::target_kind;
using xt::upstream_mode;

enum class budget { minimal, few_rows, all_rows };

/// A linear case: the cross-entropy part (targets, options, upstream, threads) is an xt::spec
/// with rows = N and cols = V; hidden, weight and the workspace are described here.
struct lspec {
  xt::spec ce;
  std::int64_t hidden = 13;
  std::int64_t pad = 0;  ///< ld = hidden + pad for hidden, weight and the gradients
  bool bias = true;
  budget space = budget::all_rows;
  xent::dw_accumulation accumulate = xent::dw_accumulation::fp32;
  /// The training order: fast unless a test names another (the workspace is sized for it).
  xent::linear_order order = xent::linear_order::fast;
  float sparse_threshold = 0.0f;  ///< linear_options::sparse_threshold (the workspace sized for it)

  std::int64_t ld() const { return hidden + pad; }
  std::string describe() const {
    static const char* spaces[] = {"minimal", "few_rows", "all_rows"};
    std::ostringstream o;
    o << ce.describe() << " D=" << hidden << " pad=" << pad << " bias=" << bias
      << " workspace=" << spaces[static_cast<int>(space)]
      << " accumulate=" << (accumulate == xent::dw_accumulation::fp32 ? "fp32" : "output")
      << " order="
      << (order == xent::linear_order::fast         ? "fast"
          : order == xent::linear_order::low_memory ? "low_memory"
                                                    : "automatic");
    return o.str();
  }
};

inline lspec make_spec(std::int64_t rows, std::int64_t hidden, std::int64_t vocab) {
  lspec s;
  s.ce.rows = rows;
  s.ce.cols = vocab;
  s.hidden = hidden;
  return s;
}

/// The inputs in dtype T: targets and options from xt::make_dataset, hidden ~ N(0, 1) and
/// weight ~ N(0, sigma^2 / D) so the logits are ~ N(0, sigma^2) as in the CE tests; bias
/// ~ N(0, 1/4). Padding columns hold the sentinel.
template <class T>
struct ldata {
  lspec s;
  xt::dataset<T> d;
  std::vector<T> x, w, b;

  std::int64_t N() const { return s.ce.rows; }
  std::int64_t V() const { return s.ce.cols; }
  std::int64_t D() const { return s.hidden; }
  xent::matrix_view<const T> hidden() const { return {x.data(), N(), D(), s.ld()}; }
  xent::matrix_view<const T> weight() const { return {w.data(), V(), D(), s.ld()}; }
  xent::vector_view<const T> bias() const {
    return s.bias ? xent::vector_view<const T>(b.data(), V()) : xent::vector_view<const T>{};
  }
  xent::linear_options options() const {
    xent::linear_options o;
    static_cast<xent::options&>(o) = d.options();
    o.accumulate = s.accumulate;
    o.order = s.order;
    o.sparse_threshold = s.sparse_threshold;
    return o;
  }
  oracle::linear_problem problem() const {
    oracle::linear_problem p;
    p.hidden = D();
    p.ce = d.problem();
    for (std::int64_t n = 0; n < N(); ++n)
      for (std::int64_t k = 0; k < D(); ++k) p.x.push_back(xt::to_double(x[n * s.ld() + k]));
    for (std::int64_t v = 0; v < V(); ++v)
      for (std::int64_t k = 0; k < D(); ++k) p.w.push_back(xt::to_double(w[v * s.ld() + k]));
    if (s.bias)
      for (std::int64_t v = 0; v < V(); ++v) p.b.push_back(xt::to_double(b[v]));
    return p;
  }
};

template <class T>
ldata<T> make_data(const lspec& s) {
  ldata<T> L;
  L.s = s;
  L.d = xt::make_dataset<T>(s.ce);
  std::mt19937_64 rng(s.ce.seed * 7919 + 17);
  std::normal_distribution<double> normal(0.0, 1.0);
  const double wscale =
      s.ce.sigma / std::sqrt(static_cast<double>(std::max<std::int64_t>(s.hidden, 1)));
  L.x.assign(s.ce.rows * s.ld(), xt::sentinel<T>());
  L.w.assign(s.ce.cols * s.ld(), xt::sentinel<T>());
  for (std::int64_t n = 0; n < s.ce.rows; ++n)
    for (std::int64_t k = 0; k < s.hidden; ++k)
      L.x[n * s.ld() + k] = xt::from_double<T>(normal(rng));
  for (std::int64_t v = 0; v < s.ce.cols; ++v)
    for (std::int64_t k = 0; k < s.hidden; ++k)
      L.w[v * s.ld() + k] = xt::from_double<T>(wscale * normal(rng));
  L.b.resize(s.ce.cols);
  for (auto& v : L.b) v = xt::from_double<T>(0.5 * normal(rng));
  return L;
}

/// The bytes a case's workspace gets on `exec`: the minimum, the least that holds a few rows per
/// chunk, or the default budget (every row in one chunk at these sizes).
template <class T, class G = T, class Exec>
std::size_t workspace_bytes(const Exec& exec, const ldata<T>& L, xent::linear_pass pass) {
  const xent::linear_shape shape{L.N(), L.D(), L.V()};
  const auto least = xent::linear_workspace_size<T, G>(exec, shape, pass, L.options(), 0);
  if (L.s.space == budget::minimal) return least.minimal;
  if (L.s.space == budget::all_rows)
    return xent::linear_workspace_size<T, G>(exec, shape, pass, L.options()).bytes;
  std::size_t b = 0;
  while (xent::linear_workspace_size<T, G>(exec, shape, pass, L.options(), b).chunk_rows <
         std::min<std::int64_t>(4, L.N()))
    b += 16;
  return xent::linear_workspace_size<T, G>(exec, shape, pass, L.options(), b).bytes;
}

/// A host workspace with its start `offset` bytes past a 64-byte boundary, poisoned with NaN
/// bytes: a call must write what it reads.
struct workspace_buffer {
  std::vector<unsigned char> raw;
  xent::linear_workspace ws;
  workspace_buffer(std::size_t bytes, std::size_t offset) : raw(bytes + 128, 0xFF) {
    const auto a = reinterpret_cast<std::uintptr_t>(raw.data());
    ws.data = raw.data() + ((64 - a % 64) % 64) + offset % 64;
    ws.bytes = bytes;
  }
  /// Whether every byte still holds the poison (a call that threw wrote nothing).
  bool untouched() const {
    return std::all_of(raw.begin(), raw.end(), [](unsigned char b) { return b == 0xFF; });
  }
};

/// Per-element error bounds of xent's results, from the tolerance model at the top of the file.
struct bounds {
  std::vector<double> dz;    ///< N x V, a logit's float error
  std::vector<double> grad;  ///< N x V, a logit gradient element's error
  std::vector<double> row_loss, lse;
  double loss = 0.0;
  std::vector<double> dx, dw, db;
};

/// What a backend rounds beyond the float model (unit roundoffs; 0 for none): the logits, stored
/// in a narrower dtype before the loss, and the logit gradient, stored in one before the GEMMs
/// (`grad_floor`: that dtype's subnormal step).
struct rounding {
  double logits = 0.0;
  double grad = 0.0;
  double grad_floor = 0.0;
  /// The hidden rows, scaled by a row factor and stored before the d_weight GEMM (the CUDA
  /// backend's scaled-probabilities path: d_weight += P^T (diag(beta) X)).
  double hidden = 0.0;
};

/// The roundings of a backend that keeps the logits and their gradient in dtype T (none for
/// float).
template <class T>
rounding stored_in() {
  if (std::is_same<T, float>::value) return {};
  return {xt::unit_roundoff<T>(), xt::unit_roundoff<T>(), xt::subnormal_step<T>()};
}

template <class T>
bounds error_bounds(const ldata<T>& L, const oracle::linear_problem& pb,
                    const oracle::linear_result& r, double chunks_rounding,
                    const rounding& stored = {}) {
  using A = xent::accumulator_t<T>;
  const std::int64_t N = L.N(), V = L.V(), D = L.D();
  const xt::spec& s = L.s.ce;
  const double u = xt::unit_roundoff<A>(), fwd_tol = s.fwd_tol() * xt::tolerance_scale<A>(),
               bwd_tol = s.bwd_tol() * xt::tolerance_scale<A>();
  bounds e;
  // dl_n/dz_v for every row (reduction none, upstream 1): how a row loss moves with its logits.
  oracle::linear_problem unit = pb;
  unit.ce.reduce = oracle::reduction::none;
  oracle::upstream ones;
  ones.rows.assign(N, 1.0);
  const oracle::linear_result ru = oracle::evaluate_linear(unit, &ones);

  e.dz.resize(N * V);
  e.grad.assign(N * V, 0.0);
  e.row_loss.assign(N, 0.0);
  e.lse.assign(N, 0.0);
  double magnitude = 0.0;
  for (std::int64_t n = 0; n < N; ++n) {
    double dzmax = 0.0, zmax = 0.0, sens = 0.0;
    for (std::int64_t v = 0; v < V; ++v) {
      e.dz[n * V + v] = 2.0 * (D + 2) * u * r.logit_magnitude[n * V + v] +
                        stored.logits * std::fabs(r.logits[n * V + v]);
      dzmax = std::max(dzmax, e.dz[n * V + v]);
      zmax = std::max(zmax, std::fabs(r.ce.z[n * V + v]));
      sens += std::fabs(ru.ce.grad[n * V + v]) * e.dz[n * V + v];
    }
    e.row_loss[n] = fwd_tol * r.ce.row_magnitude[n] + 2.0 * sens;
    e.lse[n] = fwd_tol * (1.0 + std::fabs(r.ce.lse[n]) + zmax) + 2.0 * dzmax;
    magnitude += e.row_loss[n];
    if (r.ce.grad.empty()) continue;
    for (std::int64_t v = 0; v < V; ++v) {
      const double gm = r.ce.grad_magnitude[n * V + v], z = r.ce.z[n * V + v];
      double t = bwd_tol * (1.0 + std::fabs(z) + std::fabs(r.ce.lse[n])) * gm;
      // p_v moves by the factor exp(dz_v - dlse), |dlse| <= dzmax: a relative change of at most
      // expm1(|dz_v| + dzmax), which is |dz_v| + dzmax to first order but not for logits whose
      // stored rounding is many nats (|z| in the thousands, bf16: the training test's far rows).
      // Capped so that a zero magnitude keeps a zero bound rather than 0 * inf.
      double rel = e.dz[n * V + v] + dzmax;
      if (s.softcap > 0) {
        const double slope = 1.0 - (z / s.softcap) * (z / s.softcap);
        if (slope > 0) t += 8 * u * gm / slope;
        rel += 2.0 * e.dz[n * V + v] / s.softcap;
      }
      e.grad[n * V + v] = t + 2.0 * gm * std::expm1(std::min(rel, 600.0));
      e.grad[n * V + v] +=
          stored.grad * (std::fabs(r.ce.grad[n * V + v]) + e.grad[n * V + v]) + stored.grad_floor;
    }
  }
  const double denom = s.reduce == reduction::mean ? r.ce.normalizer : 1.0;
  e.loss = magnitude / denom + 4 * u * std::fabs(r.ce.loss);
  if (r.db.empty()) return e;  // no upstream gradient: forward only

  e.dx.assign(N * D, 0.0);
  e.dw.assign(V * D, 0.0);
  e.db.assign(V, 0.0);
  std::vector<double> dw_terms(V * D, 0.0), db_terms(V, 0.0);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t v = 0; v < V; ++v) {
      const double g = std::fabs(r.ce.grad[n * V + v]), eg = e.grad[n * V + v];
      e.db[v] += eg;
      db_terms[v] += g + eg;
      for (std::int64_t k = 0; k < D; ++k) {
        const double aw = std::fabs(pb.w[v * D + k]), ax = std::fabs(pb.x[n * D + k]);
        e.dx[n * D + k] += eg * aw + 2.0 * (V + 2) * u * (g + eg) * aw;
        e.dw[v * D + k] += eg * ax;
        dw_terms[v * D + k] += (g + eg) * ax;
      }
    }
  for (std::int64_t i = 0; i < V * D; ++i)
    e.dw[i] += (2.0 * (N + 2) * u + chunks_rounding + stored.hidden) * dw_terms[i];
  for (std::int64_t v = 0; v < V; ++v) e.db[v] += 2.0 * (N + 2) * u * db_terms[v];
  return e;
}

/// A case's inputs in dtype T with the oracle's results and their error bounds (no chunk
/// rounding; `stored`: the backend's).
template <class T>
struct judged_case {
  ldata<T> L;
  oracle::linear_problem pb;
  oracle::upstream up;
  oracle::linear_result r;
  bounds e;
  judged_case(const lspec& s, const rounding& stored)
      : L(make_data<T>(s)),
        pb(L.problem()),
        up(L.d.oracle_upstream()),
        r(oracle::evaluate_linear(pb, &up)),
        e(error_bounds(L, pb, r, 0.0, stored)) {}
};

/// |got - ref| <= tol + the output dtype's rounding, for a dense-by-ld array; also checks that
/// padding kept its sentinel. Returns a message for the first few failures.
template <class G>
std::string check_array(const char* what, const G* got, std::int64_t rows, std::int64_t cols,
                        std::int64_t ld, const std::vector<double>& ref,
                        const std::vector<double>& tol) {
  std::ostringstream err;
  int failures = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = cols; j < ld; ++j)
      if (!xt::same_bits(got[i * ld + j], xt::sentinel<G>()) && failures++ < 3)
        err << "  " << what << ": padding (" << i << ", " << j << ") written\n";
    for (std::int64_t j = 0; j < cols; ++j) {
      const double g = xt::to_double(got[i * ld + j]), r = ref[i * cols + j];
      const double t = tol[i * cols + j] +
                       2 * xt::unit_roundoff<G>() * (std::fabs(r) + tol[i * cols + j]) +
                       xt::subnormal_step<G>();
      if (!xt::close(g, r, t) && failures++ < 3)
        err << "  " << what << "(" << i << ", " << j << ") = " << xt::num(g) << " vs oracle "
            << xt::num(r) << " (tol " << xt::num(t) << ")\n";
    }
  }
  return err.str();
}

/// Forward outputs of a call accumulating in A (float; double for float64 inputs), poisoned.
template <class A>
struct basic_outputs {
  std::vector<A> row_loss, lse;
  std::vector<std::int64_t> argmax;
  A loss = A(12345.0f);
  std::int64_t correct = -777;
  explicit basic_outputs(std::int64_t n)
      : row_loss(n, A(12345.0f)), lse(n, A(12345.0f)), argmax(n, -777) {}
  xent::basic_forward_outputs<A> all(const xt::spec& s) {
    xent::basic_forward_outputs<A> o;
    if (s.reduce != reduction::none) o.loss = &loss;
    o.row_loss = {row_loss.data(), static_cast<std::int64_t>(row_loss.size())};
    o.lse = {lse.data(), static_cast<std::int64_t>(lse.size())};
    o.argmax = {argmax.data(), static_cast<std::int64_t>(argmax.size())};
    if (s.kind != target_kind::soft) o.num_correct = &correct;
    return o;
  }
  xent::vector_view<const A> lse_view() const {
    return {lse.data(), static_cast<std::int64_t>(lse.size())};
  }
  /// The results: host memory holds them already (a device backend's outputs copy them back).
  const basic_outputs& fetch() const { return *this; }
};
using outputs = basic_outputs<float>;

template <class T, class A>
std::string check_outputs(const ldata<T>& L, const oracle::linear_result& r, const bounds& e,
                          const basic_outputs<A>& f) {
  const xt::spec& s = L.s.ce;
  std::ostringstream err;
  int failures = 0;
  auto fail = [&](std::int64_t n, const std::string& m) {
    if (failures++ < 4) err << "  row " << n << ": " << m << "\n";
  };
  std::int64_t correct = 0;
  for (std::int64_t n = 0; n < L.N(); ++n) {
    const bool ignored = s.kind != target_kind::soft && L.d.target(n) == s.ignore_index;
    if (ignored) {
      if (!xt::same_bits(f.row_loss[n], A(0)) || !xt::same_bits(f.lse[n], A(0)) ||
          f.argmax[n] != -1)
        fail(n, "ignored, but loss / lse / argmax are not 0 / 0 / -1");
      continue;
    }
    if (!xt::close(f.row_loss[n], r.ce.row_loss[n], e.row_loss[n]))
      fail(n, "row_loss " + xt::num(f.row_loss[n]) + " vs oracle " + xt::num(r.ce.row_loss[n]));
    if (!xt::close(f.lse[n], r.ce.lse[n], e.lse[n]))
      fail(n, "lse " + xt::num(f.lse[n]) + " vs oracle " + xt::num(r.ce.lse[n]));
    // argmax: the oracle's, or an index whose logit is within the two logits' float errors.
    const std::int64_t got = f.argmax[n], want = r.ce.argmax[n], V = L.V();
    if (got != want &&
        !(got >= 0 && got < V &&
          r.ce.z[n * V + want] - r.ce.z[n * V + got] <= e.dz[n * V + want] + e.dz[n * V + got]))
      fail(n, "argmax " + std::to_string(got) + " vs oracle " + std::to_string(want) +
                  (got >= 0 && got < V ? " (z " + xt::num(r.ce.z[n * V + got]) + " vs " +
                                             xt::num(r.ce.z[n * V + want]) + ", tol " +
                                             xt::num(e.dz[n * V + want] + e.dz[n * V + got]) + ")"
                                       : std::string()));
    if (s.kind != target_kind::soft && got == L.d.target(n)) ++correct;
  }
  if (s.kind != target_kind::soft && f.correct != correct)
    err << "  num_correct " << f.correct << ", the rows' argmax give " << correct << "\n";
  if (s.reduce != reduction::none && !xt::close(f.loss, r.ce.loss, e.loss))
    err << "  loss " << xt::num(f.loss) << " vs oracle " << xt::num(r.ce.loss) << " (tol "
        << xt::num(e.loss) << ")\n";
  return err.str();
}

/// Gradients, poisoned, padding columns included.
template <class G>
struct gradients {
  std::vector<G> dx, dw, db;
  lspec s;
  explicit gradients(const lspec& s_)
      : dx(s_.ce.rows * s_.ld(), xt::sentinel<G>()),
        dw(s_.ce.cols * s_.ld(), xt::sentinel<G>()),
        db(s_.ce.cols, xt::sentinel<G>()),
        s(s_) {}
  xent::linear_grads<G> views() {
    xent::linear_grads<G> g;
    g.d_hidden = {dx.data(), s.ce.rows, s.hidden, s.ld()};
    g.d_weight = {dw.data(), s.ce.cols, s.hidden, s.ld()};
    if (s.bias) g.d_bias = {db.data(), s.ce.cols};
    return g;
  }
  /// The results: host memory holds them already (as basic_outputs::fetch).
  const gradients& fetch() const { return *this; }
};

template <class T, class G>
std::string check_gradients(const ldata<T>& L, const oracle::linear_result& r, const bounds& e,
                            const gradients<G>& g) {
  std::string err = check_array("d_hidden", g.dx.data(), L.N(), L.D(), L.s.ld(), r.dx, e.dx) +
                    check_array("d_weight", g.dw.data(), L.V(), L.D(), L.s.ld(), r.dw, e.dw);
  if (L.s.bias) {
    err += check_array("d_bias", g.db.data(), 1, L.V(), L.V(), r.db, e.db);
  } else {
    for (const G& v : g.db)
      if (!xt::same_bits(v, xt::sentinel<G>())) return err + "  d_bias written without a bias\n";
  }
  return err;
}

/// The cases of gradients in another dtype than the inputs: both d_weight accumulations, each
/// workspace size, reduction none with per-row upstream, some rows ignored, padded rows.
inline std::vector<lspec> mixed_dtype_cases() {
  std::vector<lspec> cases;
  std::uint64_t seed = 700;
  for (auto mode : {xent::dw_accumulation::fp32, xent::dw_accumulation::output})
    for (budget space : {budget::minimal, budget::few_rows, budget::all_rows}) {
      lspec s = make_spec(13, 9, 31);
      s.ce.ignore = ignore_mode::some;
      s.ce.reduce = reduction::none;
      s.ce.up = upstream_mode::pointer_or_rows;
      s.ce.z_loss = 1e-2f;
      s.ce.seed = ++seed;
      s.space = space;
      s.accumulate = mode;
      s.pad = 2;
      cases.push_back(s);
    }
  return cases;
}

/// Every row ignored, for each reduction (mean: NaN loss, 0 / 0 as PyTorch; sum and none: 0; the
/// gradients zero, not NaN), with per-row or pointer upstream gradients, in the minimal workspace
/// and in one chunk.
inline std::vector<lspec> all_ignored_cases() {
  std::vector<lspec> cases;
  for (reduction red : {reduction::none, reduction::mean, reduction::sum})
    for (budget space : {budget::minimal, budget::all_rows}) {
      lspec s = make_spec(7, 5, 9);
      s.ce.reduce = red;
      s.ce.ignore = ignore_mode::all;
      s.ce.up = upstream_mode::pointer_or_rows;
      s.space = space;
      cases.push_back(s);
    }
  return cases;
}

/// Every option: targets int32 / int64 / soft, the three reductions, label smoothing, weights,
/// z-loss and softcap on and off, bias or not; ignored rows (some) with class ids, per-row or
/// pointer upstream, workspaces, threads and padding varying from case to case.
inline std::vector<lspec> every_option(std::int64_t rows, std::int64_t hidden, std::int64_t vocab) {
  std::vector<lspec> out;
  std::uint64_t seed = 100;
  for (target_kind kind : {target_kind::int32, target_kind::int64, target_kind::soft})
    for (reduction red : {reduction::none, reduction::mean, reduction::sum})
      for (int mask = 0; mask < 16; ++mask)
        for (bool bias : {false, true}) {
          lspec s = make_spec(rows, hidden, vocab);
          s.ce.kind = kind;
          s.ce.reduce = red;
          s.ce.ignore = kind == target_kind::soft ? ignore_mode::none : ignore_mode::some;
          s.ce.label_smoothing = mask & 1 ? 0.1f : 0.0f;
          s.ce.weights = mask & 2;
          s.ce.z_loss = mask & 4 ? 1e-2f : 0.0f;
          s.ce.softcap = mask & 8 ? 3.0f : 0.0f;
          s.ce.up = (mask + bias) % 2 ? upstream_mode::pointer_or_rows : upstream_mode::scale;
          s.ce.seed = ++seed;
          s.ce.threads = seed % 3 == 0 ? 3 : 1;
          s.bias = bias;
          s.pad = seed % 4 == 1 ? 3 : 0;
          s.space = static_cast<budget>(seed % 3);
          out.push_back(s);
        }
  return out;
}

/// The every-option cases in bf16 and fp16: every k-th case of every_option(11, 13, 37),
/// alternating the two. Calls run(case, k-th index, (T*)nullptr) for each, T its dtype, until one
/// fails (xt::case_budget), and checks that all were run.
template <class Run>
void narrow_every_option(int k, Run&& run) {
  xt::case_budget b;
  int i = 0;
  for (const lspec& s : every_option(11, 13, 37)) {
    if (i++ % k != 0) continue;
    const bool passed = i % (2 * k) == 1 ? run(s, i / k, static_cast<bf16*>(nullptr))
                                         : run(s, i / k, static_cast<half*>(nullptr));
    if (!b.record(passed)) return;
  }
  EXPECT_EQ(b.cases(), 288 / k);
}

template <class F>
void expect_error(const char* argument, const std::string& fragment, F&& f) {
  try {
    f();
    ADD_FAILURE() << "no xent::error for '" << argument << "'";
  } catch (const xent::error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "'" << e.what() << "' lacks '" << fragment << "'";
  }
}

}  // namespace xtl
