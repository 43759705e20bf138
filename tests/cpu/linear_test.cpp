// Fused linear cross-entropy on the CPU, judged by the float64 linear oracle
// (tests/oracle/linear_oracle.hpp): every loss option, bias or not, ignored rows, per-row upstream
// gradients, odd V and D, float / bf16 / fp16, workspaces from the minimal one to one chunk, the
// workspace and argument errors, and finite differences.
//
// Tolerances. Inputs are rounded to the dtype under test and the oracle is fed the rounded values,
// so xent's only errors are its float arithmetic and the final rounding of its outputs:
//   - a logit sums D + 1 products in float: |dz| <= 2 (D + 2) u * sum_d |x w| + |b| (u = 2^-24;
//     twice the usual gamma_{D+1} bound for margin);
//   - the cross-entropy core on those logits errs as the CE tests allow (harness.hpp: fwd_tol of
//     the loss terms, bwd_tol of the gradient terms), plus what the logit errors carry: a row loss
//     moves by sum_v |dl/dz_v| |dz_v|, a gradient element by its magnitude times the relative
//     change of p_v (|dz_v| + max |dz|), and of the softcap slope (2 |dz_v| / cap);
//   - d_hidden, d_weight and d_bias sum V, N and N of those elements in float: the propagated
//     element errors plus 2 (K + 2) u of the sum of the terms' magnitudes (K the sum's length);
//   - a bf16 / fp16 output is rounded once: twice its unit roundoff of the value, plus the
//     smallest subnormal step; d_weight accumulated in its own dtype (dw_accumulation::output)
//     is rounded once per chunk instead.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "harness.hpp"
#include "oracle/linear_oracle.hpp"

namespace {

using xent::reduction;
using xt::bf16;
using xt::half;
using xt::ignore_mode;
using xt::target_kind;
using xt::upstream_mode;

constexpr double u32 = 5.9604644775390625e-08;  // 2^-24

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

  std::int64_t ld() const { return hidden + pad; }
  std::string describe() const {
    static const char* spaces[] = {"minimal", "few_rows", "all_rows"};
    std::ostringstream o;
    o << ce.describe() << " D=" << hidden << " pad=" << pad << " bias=" << bias
      << " workspace=" << spaces[static_cast<int>(space)]
      << " accumulate=" << (accumulate == xent::dw_accumulation::fp32 ? "fp32" : "output");
    return o.str();
  }
};

lspec make_spec(std::int64_t rows, std::int64_t hidden, std::int64_t vocab) {
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

/// A workspace with its start `offset` bytes past a 64-byte boundary, poisoned with NaN bytes.
struct workspace_buffer {
  std::vector<unsigned char> raw;
  xent::linear_workspace ws;
  workspace_buffer(std::size_t bytes, std::size_t offset) : raw(bytes + 128, 0xFF) {
    const auto a = reinterpret_cast<std::uintptr_t>(raw.data());
    ws.data = raw.data() + ((64 - a % 64) % 64) + offset % 64;
    ws.bytes = bytes;
  }
};

/// The bytes a case's workspace gets: the minimum, the least that holds a few rows per chunk, or
/// the default budget (every row in one chunk at these sizes).
template <class T, class G = T>
std::size_t workspace_bytes(const ldata<T>& L, xent::linear_pass pass) {
  const xent::cpu exec(L.s.ce.threads);
  const xent::linear_shape shape{L.N(), L.D(), L.V()};
  const auto least = xent::linear_workspace_size<T, G>(exec, shape, pass, L.options(), 0);
  if (L.s.space == budget::minimal) return least.minimal;
  if (L.s.space == budget::all_rows)
    return xent::linear_workspace_size<T, G>(exec, shape, pass, L.options()).bytes;
  std::size_t b = least.minimal;
  while (xent::linear_workspace_size<T, G>(exec, shape, pass, L.options(), b).chunk_rows <
         std::min<std::int64_t>(4, L.N()))
    b += 16;
  return b;
}

/// Per-element error bounds of xent's results, from the tolerance model at the top of the file.
struct bounds {
  std::vector<double> dz;    ///< N x V, a logit's float error
  std::vector<double> grad;  ///< N x V, a logit gradient element's error
  std::vector<double> row_loss, lse;
  double loss = 0.0;
  std::vector<double> dx, dw, db;
};

template <class T>
bounds error_bounds(const ldata<T>& L, const oracle::linear_problem& pb,
                    const oracle::linear_result& r, double chunks_rounding) {
  const std::int64_t N = L.N(), V = L.V(), D = L.D();
  const xt::spec& s = L.s.ce;
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
      e.dz[n * V + v] = 2.0 * (D + 2) * u32 * r.logit_magnitude[n * V + v];
      dzmax = std::max(dzmax, e.dz[n * V + v]);
      zmax = std::max(zmax, std::fabs(r.ce.z[n * V + v]));
      sens += std::fabs(ru.ce.grad[n * V + v]) * e.dz[n * V + v];
    }
    e.row_loss[n] = s.fwd_tol() * r.ce.row_magnitude[n] + 2.0 * sens;
    e.lse[n] = s.fwd_tol() * (1.0 + std::fabs(r.ce.lse[n]) + zmax) + 2.0 * dzmax;
    magnitude += e.row_loss[n];
    if (r.ce.grad.empty()) continue;
    for (std::int64_t v = 0; v < V; ++v) {
      const double gm = r.ce.grad_magnitude[n * V + v], z = r.ce.z[n * V + v];
      double t = s.bwd_tol() * (1.0 + std::fabs(z) + std::fabs(r.ce.lse[n])) * gm;
      double rel = e.dz[n * V + v] + dzmax;
      if (s.softcap > 0) {
        const double slope = 1.0 - (z / s.softcap) * (z / s.softcap);
        if (slope > 0) t += 8 * u32 * gm / slope;
        rel += 2.0 * e.dz[n * V + v] / s.softcap;
      }
      e.grad[n * V + v] = t + 2.0 * gm * rel;
    }
  }
  const double denom = s.reduce == reduction::mean ? r.ce.normalizer : 1.0;
  e.loss = magnitude / denom + 4 * u32 * std::fabs(r.ce.loss);
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
        e.dx[n * D + k] += eg * aw + 2.0 * (V + 2) * u32 * (g + eg) * aw;
        e.dw[v * D + k] += eg * ax;
        dw_terms[v * D + k] += (g + eg) * ax;
      }
    }
  for (std::int64_t i = 0; i < V * D; ++i)
    e.dw[i] += (2.0 * (N + 2) * u32 + chunks_rounding) * dw_terms[i];
  for (std::int64_t v = 0; v < V; ++v) e.db[v] += 2.0 * (N + 2) * u32 * db_terms[v];
  return e;
}

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

/// Forward outputs, poisoned.
struct outputs {
  std::vector<float> row_loss, lse;
  std::vector<std::int64_t> argmax;
  float loss = 12345.0f;
  std::int64_t correct = -777;
  explicit outputs(std::int64_t n) : row_loss(n, 12345.0f), lse(n, 12345.0f), argmax(n, -777) {}
  xent::forward_outputs all(const xt::spec& s) {
    xent::forward_outputs o;
    if (s.reduce != reduction::none) o.loss = &loss;
    o.row_loss = {row_loss.data(), static_cast<std::int64_t>(row_loss.size())};
    o.lse = {lse.data(), static_cast<std::int64_t>(lse.size())};
    o.argmax = {argmax.data(), static_cast<std::int64_t>(argmax.size())};
    if (s.kind != target_kind::soft) o.num_correct = &correct;
    return o;
  }
};

template <class T>
std::string check_outputs(const ldata<T>& L, const oracle::linear_result& r, const bounds& e,
                          const outputs& f) {
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
      if (!xt::same_bits(f.row_loss[n], 0.0f) || !xt::same_bits(f.lse[n], 0.0f) ||
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
      fail(n, "argmax " + std::to_string(got) + " vs oracle " + std::to_string(want));
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

/// Runs linear_forward, linear_forward_backward and linear_backward (from forward's LSE) on a
/// case, with inputs of dtype T and gradients of dtype G, and checks each against the oracle.
/// Returns whether everything passed.
template <class T, class G = T>
bool run_case(const lspec& s) {
  const ldata<T> L = make_data<T>(s);
  const oracle::linear_problem pb = L.problem();
  const oracle::upstream up = L.d.oracle_upstream();
  const oracle::linear_result r = oracle::evaluate_linear(pb, &up);
  const xent::cpu exec(s.ce.threads);
  const xent::linear_options opts = L.options();
  const xent::linear_shape shape{L.N(), L.D(), L.V()};
  // Chunks d_weight is rounded in under dw_accumulation::output with a narrow d_weight.
  double chunk_rounding = 0.0;
  if (s.accumulate == xent::dw_accumulation::output && !std::is_same<G, float>::value) {
    const std::size_t bytes = workspace_bytes<T, G>(L, xent::linear_pass::training);
    const auto rows =
        xent::linear_workspace_size<T, G>(exec, shape, xent::linear_pass::training, opts, bytes)
            .chunk_rows;
    chunk_rounding =
        2.0 * xt::unit_roundoff<G>() * ((L.N() + rows - 1) / std::max<std::int64_t>(rows, 1));
  }
  const bounds e = error_bounds(L, pb, r, chunk_rounding);
  std::string errors;
  auto note = [&](const char* what, const std::string& m) {
    if (!m.empty()) errors += std::string(what) + ":\n" + m;
  };

  outputs fwd(L.N());
  {
    workspace_buffer ws(workspace_bytes(L, xent::linear_pass::forward), s.ce.seed);
    L.d.with_targets([&](auto targets) {
      xent::linear_forward(exec, L.hidden(), L.weight(), L.bias(), targets, opts, fwd.all(s.ce),
                           ws.ws);
    });
    note("linear_forward", check_outputs(L, r, e, fwd));
  }
  {
    workspace_buffer ws(workspace_bytes<T, G>(L, xent::linear_pass::training), s.ce.seed + 1);
    outputs fb(L.N());
    gradients<G> g(s);
    L.d.with_targets([&](auto targets) {
      xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), targets, opts,
                                    L.d.upstream(), fb.all(s.ce), g.views(), ws.ws);
    });
    note("linear_forward_backward", check_outputs(L, r, e, fb));
    note("linear_forward_backward", check_gradients(L, r, e, g));

    gradients<G> gb(s);
    L.d.with_targets([&](auto targets) {
      xent::linear_backward(exec, L.hidden(), L.weight(), L.bias(), targets, opts,
                            xent::vector_view<const float>(fwd.lse.data(), L.N()), L.d.upstream(),
                            gb.views(), ws.ws);
    });
    note("linear_backward", check_gradients(L, r, e, gb));
  }
  if (!errors.empty()) {
    ADD_FAILURE() << "case " << xt::dtype_name<T>() << " -> " << xt::dtype_name<G>() << " grads, "
                  << s.describe() << "\n"
                  << errors;
    return false;
  }
  return true;
}

/// Every option: targets int32 / int64 / soft, the three reductions, label smoothing, weights,
/// z-loss and softcap on and off, bias or not; ignored rows (some) with class ids, per-row or
/// pointer upstream, workspaces, threads and padding varying from case to case.
std::vector<lspec> every_option(std::int64_t rows, std::int64_t hidden, std::int64_t vocab) {
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

TEST(CpuLinear, Float32MatchesFloat64OracleWithEveryOption) {
  xt::case_budget b;
  for (const lspec& s : every_option(19, 13, 37))
    if (!b.record(run_case<float>(s))) return;
  EXPECT_EQ(b.cases(), 288);
}

TEST(CpuLinear, Bfloat16AndHalfMatchFloat64OracleWithEveryOption) {
  xt::case_budget b;
  int i = 0;
  for (const lspec& s : every_option(11, 13, 37)) {
    // Every fourth case of the float32 set, alternating bf16 and fp16.
    if (i++ % 4 != 0) continue;
    if (!b.record(i % 8 == 1 ? run_case<bf16>(s) : run_case<half>(s))) return;
  }
  EXPECT_EQ(b.cases(), 72);
}

TEST(CpuLinear, GradientDtypeMayDifferFromTheInputs) {
  // bf16 / fp16 hidden and weight with float gradients (d_weight its own accumulator), and float
  // inputs with bf16 gradients (converted rows of d_hidden, the fp32 or output d_weight).
  xt::case_budget b;
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
      if (!b.record(run_case<bf16, float>(s) && run_case<half, float>(s) &&
                    run_case<float, bf16>(s)))
        return;
    }
}

TEST(CpuLinear, ManyWeightBlocksAndThreadsMatchOracle) {
  // V past the 256-row weight block (a partial last block), D not a packet multiple, more rows
  // than one small chunk, 1 to 4 threads.
  xt::case_budget b;
  std::uint64_t seed = 500;
  for (std::int64_t vocab : {255, 256, 257, 611})
    for (int threads : {1, 2, 4})
      for (budget space : {budget::few_rows, budget::all_rows}) {
        lspec s = make_spec(23, 21, vocab);
        s.ce.ignore = ignore_mode::some;
        s.ce.label_smoothing = 0.05f;
        s.ce.threads = threads;
        s.ce.seed = ++seed;
        s.space = space;
        s.pad = 1;
        if (!b.record(run_case<float>(s) && run_case<bf16>(s))) return;
      }
}

TEST(CpuLinear, EveryRowIgnoredGivesPyTorchsResultsAndZeroGradients) {
  // mean: NaN loss (0 / 0), as PyTorch; sum and none: 0. Gradients are zero, not NaN.
  for (reduction red : {reduction::none, reduction::mean, reduction::sum})
    for (budget space : {budget::minimal, budget::all_rows}) {
      lspec s = make_spec(7, 5, 9);
      s.ce.reduce = red;
      s.ce.ignore = ignore_mode::all;
      s.ce.up = upstream_mode::pointer_or_rows;
      s.space = space;
      EXPECT_TRUE(run_case<float>(s));
      EXPECT_TRUE(run_case<bf16>(s));
    }
}

TEST(CpuLinear, NoRowsWritesZeroWeightAndBiasGradients) {
  for (reduction red : {reduction::mean, reduction::sum}) {
    lspec s = make_spec(0, 4, 6);
    s.ce.reduce = red;
    EXPECT_TRUE(run_case<float>(s));
    EXPECT_TRUE(run_case<half>(s));
  }
}

TEST(CpuLinear, PerRowUpstreamScalesRowsBeforeTheSumOverRows) {
  // Liger #678 / #968: with reduction none, d_weight must be sum_n g_n G_n^T x_n. Rows with
  // upstream 0 must contribute nothing, so zeroing a row's upstream equals dropping the row.
  lspec s = make_spec(6, 5, 11);
  s.ce.reduce = reduction::none;
  s.ce.up = upstream_mode::pointer_or_rows;
  ldata<float> L = make_data<float>(s);
  for (std::int64_t n = 0; n < 6; ++n) L.d.up_rows[n] = n % 2 ? 0.0f : 1.0f + n;
  const xent::cpu exec;
  const auto bytes =
      xent::linear_workspace_size<float>(exec, {6, 5, 11}, xent::linear_pass::training).bytes;
  workspace_buffer ws(bytes, 0);
  gradients<float> all(s);
  L.d.with_targets([&](auto t) {
    xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, L.options(),
                                  L.d.upstream(), xent::forward_outputs{}, all.views(), ws.ws);
  });
  // The even rows alone, their upstream as before.
  lspec h = s;
  h.ce.rows = 3;
  ldata<float> E = L;
  E.s = h;
  E.d.s.rows = 3;
  E.x.clear();
  E.d.t64.clear();
  E.d.up_rows.clear();
  for (std::int64_t n = 0; n < 6; n += 2) {
    E.x.insert(E.x.end(), L.x.begin() + n * s.ld(), L.x.begin() + (n + 1) * s.ld());
    E.d.t64.push_back(L.d.t64[n]);
    E.d.up_rows.push_back(L.d.up_rows[n]);
  }
  gradients<float> even(h);
  E.d.with_targets([&](auto t) {
    xent::linear_forward_backward(exec, E.hidden(), E.weight(), E.bias(), t, E.options(),
                                  E.d.upstream(), xent::forward_outputs{}, even.views(), ws.ws);
  });
  double scale = 0.0;
  for (float v : even.dw) scale = std::max(scale, std::fabs(static_cast<double>(v)));
  ASSERT_GT(scale, 0.0);
  for (std::size_t i = 0; i < all.dw.size(); ++i)
    ASSERT_NEAR(all.dw[i], even.dw[i], 1e-6 * scale) << "d_weight element " << i;
  for (std::size_t i = 0; i < all.db.size(); ++i)
    ASSERT_NEAR(all.db[i], even.db[i], 1e-6 * scale) << "d_bias element " << i;
}

TEST(CpuLinear, LowerMemoryAccumulationIsCloseAndFp32IsCloser) {
  // bf16 d_weight over 64 one-row chunks (the minimal workspace): accumulated in bf16 it is
  // rounded 64 times, in the fp32 buffer once. Both within their bounds (run_case), and the fp32
  // default strictly closer to the oracle in the largest relative error.
  lspec s = make_spec(64, 24, 40);
  s.space = budget::minimal;
  s.ce.reduce = reduction::sum;
  s.ce.scale = 1.0f;
  double worst[2] = {0.0, 0.0};
  for (auto mode : {xent::dw_accumulation::fp32, xent::dw_accumulation::output}) {
    s.accumulate = mode;
    EXPECT_TRUE(run_case<bf16>(s));
    const ldata<bf16> L = make_data<bf16>(s);
    const oracle::upstream up = L.d.oracle_upstream();
    const oracle::linear_result r = oracle::evaluate_linear(L.problem(), &up);
    const xent::cpu exec;
    workspace_buffer ws(workspace_bytes(L, xent::linear_pass::training), 0);
    gradients<bf16> g(s);
    L.d.with_targets([&](auto t) {
      xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, L.options(),
                                    L.d.upstream(), xent::forward_outputs{}, g.views(), ws.ws);
    });
    double ref = 0.0;
    for (double v : r.dw) ref = std::max(ref, std::fabs(v));
    for (std::int64_t v = 0; v < L.V(); ++v)
      for (std::int64_t k = 0; k < L.D(); ++k)
        worst[mode == xent::dw_accumulation::output] =
            std::max(worst[mode == xent::dw_accumulation::output],
                     std::fabs(xt::to_double(g.dw[v * s.ld() + k]) - r.dw[v * L.D() + k]) / ref);
  }
  EXPECT_LT(worst[0], worst[1]) << "fp32 accumulation " << worst[0] << ", bf16 " << worst[1];
  std::printf("d_weight max error / max |d_weight|: fp32 accumulation %.3g, bf16 %.3g\n", worst[0],
              worst[1]);
  // One rounding of the float sum: bf16's unit roundoff 2^-8 (twice xt::unit_roundoff).
  EXPECT_LE(worst[0], 2 * xt::unit_roundoff<bf16>());
}

TEST(CpuLinear, Float32AccumulationModesAreIdentical) {
  lspec s = make_spec(9, 7, 19);
  s.space = budget::minimal;
  const ldata<float> L = make_data<float>(s);
  const xent::cpu exec;
  std::vector<float> results[2];
  for (auto mode : {xent::dw_accumulation::fp32, xent::dw_accumulation::output}) {
    xent::linear_options o = L.options();
    o.accumulate = mode;
    const auto size =
        xent::linear_workspace_size<float>(exec, {9, 7, 19}, xent::linear_pass::training, o, 0);
    workspace_buffer ws(size.minimal, 0);
    gradients<float> g(s);
    L.d.with_targets([&](auto t) {
      xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, o, L.d.upstream(),
                                    xent::forward_outputs{}, g.views(), ws.ws);
    });
    results[mode == xent::dw_accumulation::output] = g.dw;
  }
  EXPECT_EQ(0, std::memcmp(results[0].data(), results[1].data(), results[0].size() * 4));
}

// ---------------------------------------------------------------------------------------------
// The workspace
// ---------------------------------------------------------------------------------------------

TEST(CpuLinearWorkspace, SizeQueryPlansChunksWithinTheBudget) {
  const xent::cpu exec(2);
  const xent::linear_shape shape{1000, 64, 5003};
  const auto train = xent::linear_pass::training;
  const auto all = xent::linear_workspace_size<float>(exec, shape, train, {}, std::size_t{1} << 40);
  EXPECT_EQ(all.chunk_rows, 1000);
  EXPECT_GE(all.bytes, 1000u * 5003u * 4u);  // the whole logits matrix in float
  const auto least = xent::linear_workspace_size<float>(exec, shape, train, {}, 0);
  EXPECT_EQ(least.chunk_rows, 1);
  EXPECT_EQ(least.bytes, least.minimal);
  EXPECT_EQ(least.minimal, all.minimal);
  for (std::size_t budget : {least.minimal + 1, std::size_t{1} << 20, std::size_t{4} << 20}) {
    const auto s = xent::linear_workspace_size<float>(exec, shape, train, {}, budget);
    EXPECT_LE(s.bytes, budget);
    EXPECT_GE(s.chunk_rows, 1);
    // One more row would not fit.
    const auto more = xent::cpu_detail::make_linear_plan<float, float>(
        exec, shape, train, xent::dw_accumulation::fp32, s.chunk_rows + 1);
    EXPECT_GT(more.bytes, budget);
  }
  // The fp32 d_weight accumulator of a bf16 d_weight costs 4 V D bytes; a float d_weight is its
  // own accumulator; the lower-memory mode needs none.
  xent::linear_options lo;
  lo.accumulate = xent::dw_accumulation::output;
  const auto bf_fp32 = xent::linear_workspace_size<bf16>(exec, shape, train, {}, 0);
  const auto bf_out = xent::linear_workspace_size<bf16>(exec, shape, train, lo, 0);
  EXPECT_GE(bf_fp32.minimal - bf_out.minimal, 5003u * 64u * 4u - 2u * 256u * 64u * 4u);
  EXPECT_LT(least.minimal, 5003u * 64u * 4u);
  // Forward needs no gradient buffers.
  EXPECT_LT(xent::linear_workspace_size<bf16>(exec, shape, xent::linear_pass::forward).minimal,
            bf_out.minimal);
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

TEST(CpuLinearWorkspace, TooSmallThrowsNamingWorkspaceAndTheSizeBeforeWriting) {
  lspec s = make_spec(8, 6, 10);
  const ldata<bf16> L = make_data<bf16>(s);
  const xent::cpu exec;
  for (auto pass : {xent::linear_pass::forward, xent::linear_pass::training}) {
    const auto need = xent::linear_workspace_size<bf16>(exec, {8, 6, 10}, pass, L.options());
    workspace_buffer ws(need.minimal - 1, 0);
    outputs f(8);
    gradients<bf16> g(s);
    L.d.with_targets([&](auto t) {
      expect_error("workspace", std::to_string(need.minimal), [&] {
        if (pass == xent::linear_pass::forward)
          xent::linear_forward(exec, L.hidden(), L.weight(), L.bias(), t, L.options(), f.all(s.ce),
                               ws.ws);
        else
          xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, L.options(),
                                        L.d.upstream(), f.all(s.ce), g.views(), ws.ws);
      });
    });
    EXPECT_EQ(f.loss, 12345.0f);
    EXPECT_EQ(f.lse[0], 12345.0f);
    EXPECT_TRUE(xt::same_bits(g.dw[0], xt::sentinel<bf16>()));
    EXPECT_EQ(ws.raw[64], 0xFF);
  }
}

// ---------------------------------------------------------------------------------------------
// Arguments
// ---------------------------------------------------------------------------------------------

TEST(CpuLinearValidation, BadArgumentsThrowNamingThemBeforeWriting) {
  lspec s = make_spec(4, 3, 5);
  s.ce.reduce = reduction::mean;
  ldata<float> L = make_data<float>(s);
  const xent::cpu exec;
  workspace_buffer ws(1 << 20, 0);
  const auto opts = L.options();
  const xent::vector_view<const std::int64_t> t(L.d.t64.data(), 4);
  outputs f(4);
  gradients<float> g(s);
  auto fb = [&](xent::matrix_view<const float> x, xent::matrix_view<const float> w,
                xent::vector_view<const float> b, xent::vector_view<const std::int64_t> tg,
                const xent::linear_options& o, const xent::upstream& up,
                const xent::linear_grads<float>& gr, const xent::linear_workspace& w_s) {
    return [=, &f, &s] {
      xent::linear_forward_backward(exec, x, w, b, tg, o, up, f.all(s.ce), gr, w_s);
    };
  };
  const auto X = L.hidden();
  const auto W = L.weight();
  const auto B = L.bias();
  const auto up = L.d.upstream();
  const auto G = g.views();

  expect_error("weight", "both need D columns",
               fb(X, {W.data, 5, 2, s.ld()}, B, t, opts, up, G, ws.ws));
  expect_error("hidden", "leading dimension", fb({X.data, 4, 3, 2}, W, B, t, opts, up, G, ws.ws));
  expect_error("bias", "expected 5", fb(X, W, {B.data, 4}, t, opts, up, G, ws.ws));
  expect_error("targets", "expected 4", fb(X, W, B, {t.data, 3}, opts, up, G, ws.ws));
  auto bad_target = L.d.t64;
  bad_target[2] = 5;
  expect_error("targets", "row 2", fb(X, W, B, {bad_target.data(), 4}, opts, up, G, ws.ws));
  auto bad_opts = opts;
  bad_opts.label_smoothing = 2.0f;
  expect_error("options.label_smoothing", "[0, 1]", fb(X, W, B, t, bad_opts, up, G, ws.ws));
  std::vector<float> five(5, 1.0f);
  xent::upstream rows_up;
  rows_up.rows = {five.data(), 4};
  expect_error("upstream.rows", "reduction none", fb(X, W, B, t, opts, rows_up, G, ws.ws));
  auto gx = G;
  gx.d_hidden.rows = 3;
  expect_error("grads.d_hidden", "expected 4 x 3", fb(X, W, B, t, opts, up, gx, ws.ws));
  auto gw = G;
  gw.d_weight.cols = 2;
  expect_error("grads.d_weight", "expected 5 x 3", fb(X, W, B, t, opts, up, gw, ws.ws));
  expect_error("grads.d_bias", "without a bias",
               fb(X, W, xent::vector_view<const float>{}, t, opts, up, G, ws.ws));
  auto overlap = G;
  overlap.d_weight.data = const_cast<float*>(W.data);
  expect_error("grads.d_weight", "overlaps weight", fb(X, W, B, t, opts, up, overlap, ws.ws));
  expect_error("grads.d_hidden", "overlaps workspace",
               fb(X, W, B, t, opts, up, G, {G.d_hidden.data, 1 << 20}));
  expect_error("workspace", "null data", fb(X, W, B, t, opts, up, G, {nullptr, 64}));

  // linear_forward needs the reduction's loss; linear_backward the LSE.
  expect_error("outputs.loss", "required", [&] {
    xent::linear_forward(exec, X, W, B, t, opts, xent::forward_outputs{}, ws.ws);
  });
  std::vector<float> lse(3, 0.0f);
  expect_error("lse", "expected 4", [&] {
    xent::linear_backward(exec, X, W, B, t, opts, {lse.data(), 3}, up, G, ws.ws);
  });

  EXPECT_EQ(f.loss, 12345.0f);
  for (float v : f.row_loss) EXPECT_EQ(v, 12345.0f);
  for (float v : g.dx) EXPECT_TRUE(xt::same_bits(v, xt::sentinel<float>()));
  for (float v : g.dw) EXPECT_TRUE(xt::same_bits(v, xt::sentinel<float>()));
}

// ---------------------------------------------------------------------------------------------
// Finite differences
// ---------------------------------------------------------------------------------------------

/// Central differences of the linear oracle's objective with respect to x, w and b.
std::vector<double> central_differences(oracle::linear_problem pb, const oracle::upstream& up,
                                        std::vector<double> oracle::linear_problem::*member) {
  std::vector<double>& v = pb.*member;
  std::vector<double> fd(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double x = v[i], h = 1e-5 * (1.0 + std::fabs(x));
    v[i] = x + h;
    const double plus = oracle::linear_objective(pb, up);
    v[i] = x - h;
    const double minus = oracle::linear_objective(pb, up);
    v[i] = x;
    fd[i] = (plus - minus) / (2 * h);
  }
  return fd;
}

std::vector<lspec> gradient_check_cases() {
  std::vector<lspec> out;
  std::uint64_t seed = 900;
  for (target_kind kind : {target_kind::int64, target_kind::soft})
    for (reduction red : {reduction::none, reduction::mean, reduction::sum})
      for (int mask : {0, 15}) {
        lspec s = make_spec(4, 3, 7);
        s.ce.kind = kind;
        s.ce.reduce = red;
        s.ce.ignore = kind == target_kind::soft ? ignore_mode::none : ignore_mode::some;
        s.ce.label_smoothing = mask & 1 ? 0.2f : 0.0f;
        s.ce.weights = mask & 2;
        s.ce.z_loss = mask & 4 ? 0.05f : 0.0f;
        s.ce.softcap = mask & 8 ? 2.5f : 0.0f;
        s.ce.up = upstream_mode::pointer_or_rows;
        s.ce.seed = ++seed;
        s.space = budget::minimal;
        out.push_back(s);
      }
  return out;
}

TEST(CpuLinearGradientCheck, OracleAndFloat32GradientsMatchCentralDifferences) {
  // The linear oracle's dx, dw, db against central differences of its own loss (float64), then
  // xent's float32 gradients against those differences: xent differentiates the textbook loss.
  for (const lspec& s : gradient_check_cases()) {
    const ldata<float> L = make_data<float>(s);
    const oracle::linear_problem pb = L.problem();
    const oracle::upstream up = L.d.oracle_upstream();
    const oracle::linear_result r = oracle::evaluate_linear(pb, &up);
    workspace_buffer ws(workspace_bytes(L, xent::linear_pass::training), 3);
    gradients<float> g(s);
    L.d.with_targets([&](auto t) {
      xent::linear_forward_backward(xent::cpu{}, L.hidden(), L.weight(), L.bias(), t, L.options(),
                                    L.d.upstream(), xent::forward_outputs{}, g.views(), ws.ws);
    });
    struct part {
      const char* name;
      std::vector<double> oracle::linear_problem::*member;
      const std::vector<double>* ref;
      const std::vector<float>* got;
      std::int64_t cols, ld;
    };
    const part parts[] = {{"dx", &oracle::linear_problem::x, &r.dx, &g.dx, s.hidden, s.ld()},
                          {"dw", &oracle::linear_problem::w, &r.dw, &g.dw, s.hidden, s.ld()},
                          {"db", &oracle::linear_problem::b, &r.db, &g.db, s.ce.cols, s.ce.cols}};
    for (const part& p : parts) {
      const std::vector<double> fd = central_differences(pb, up, p.member);
      double scale = 0;
      for (double v : *p.ref) scale = std::max(scale, std::fabs(v));
      for (std::size_t i = 0; i < fd.size(); ++i) {
        ASSERT_NEAR((*p.ref)[i], fd[i], 1e-7 * (1.0 + scale))
            << "oracle " << p.name << "[" << i << "], " << s.describe();
        const std::size_t at = (i / p.cols) * p.ld + i % p.cols;
        // float32 gradients: a few ulps of the largest element (the terms are of its size).
        ASSERT_NEAR((*p.got)[at], fd[i], 2e-6 * (1.0 + scale))
            << "xent " << p.name << "[" << i << "], " << s.describe();
      }
    }
  }
}

}  // namespace
