// The judge judged: the float64 oracle against values worked out by hand and its gradient against
// central differences of its own loss, with every option; then xent's float32 gradient against
// those central differences, closing the loop (xent's gradient is the derivative of the textbook
// loss, not merely equal to a second implementation of the same formula).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "harness.hpp"

namespace {

using namespace xt::names;  // NOLINT(google-build-using-namespace): the harness's vocabulary

/// Tiny problems with every option: class ids (some ignored) and soft targets, the three
/// reductions, label smoothing, weights, z-loss and softcap on and off.
std::vector<spec> tiny_cases() {
  std::vector<spec> out;
  std::uint64_t seed = 0;
  for (target_kind kind : {target_kind::int64, target_kind::soft})
    for (reduction red : {reduction::none, reduction::mean, reduction::sum})
      for (int mask = 0; mask < 16; ++mask) {
        spec s;
        s.rows = 3;
        s.cols = 5;
        s.kind = kind;
        s.reduce = red;
        s.ignore = kind == target_kind::soft ? ignore_mode::none : ignore_mode::some;
        s.label_smoothing = mask & 1 ? 0.2f : 0.0f;
        s.weights = mask & 2;
        s.z_loss = mask & 4 ? 0.05f : 0.0f;  // large enough to matter in a finite difference
        s.softcap = mask & 8 ? 2.5f : 0.0f;  // small enough that tanh bends
        s.up = upstream_mode::pointer_or_rows;
        s.seed = ++seed;
        out.push_back(s);
      }
  return out;
}

/// Central differences of objective() in each of `values` (each restored after), with the step
/// rel * (1 + |x|).
template <class F>
std::vector<double> central_differences_in(std::vector<double>& values, double rel,
                                           const F& objective) {
  std::vector<double> fd(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double x = values[i], h = rel * (1.0 + std::fabs(x));
    values[i] = x + h;
    const double plus = objective();
    values[i] = x - h;
    const double minus = objective();
    values[i] = x;
    fd[i] = (plus - minus) / (2 * h);
  }
  return fd;
}

/// Central differences of the oracle's objective (the reduced loss times the upstream gradient).
std::vector<double> central_differences(oracle::problem pb, const oracle::upstream& up) {
  return central_differences_in(pb.logits, 1e-5, [&] { return oracle::objective(pb, up); });
}

/// xent's gradient of case `d` (forward_backward, and backward from forward's LSE) against the
/// differences `fd` (rows x cols, dense), within rel_tol of the largest of them (plus rel_tol).
template <class T>
void expect_gradient_near(const xt::dataset<T>& d, const std::vector<double>& fd, double rel_tol) {
  const spec& s = d.s;
  double scale = 0;
  for (double g : fd) scale = std::max(scale, std::fabs(g));
  for (bool fused : {true, false}) {
    const auto r = xt::call(d, fused);
    for (std::int64_t n = 0; n < s.rows; ++n)
      for (std::int64_t c = 0; c < s.cols; ++c)
        ASSERT_NEAR(r.grad[n * s.ld() + c], fd[n * s.cols + c], rel_tol * (1.0 + scale))
            << s.describe() << (fused ? " forward_backward" : " backward") << ": row " << n
            << " col " << c;
  }
}

TEST(OracleSelfCheck, GradientMatchesCentralDifferencesWithEveryOption) {
  for (const spec& s : tiny_cases()) {
    const auto d = xt::make_dataset<double>(s);
    const oracle::problem pb = d.problem();
    const oracle::upstream up = d.oracle_upstream();
    const oracle::result r = oracle::evaluate(pb, &up);
    const std::vector<double> fd = central_differences(pb, up);
    double scale = 0;
    for (double g : r.grad) scale = std::max(scale, std::fabs(g));
    for (std::size_t i = 0; i < fd.size(); ++i)
      ASSERT_NEAR(r.grad[i], fd[i], 1e-7 * (1.0 + scale))
          << s.describe() << ": element " << i << " (row " << i / s.cols << ")";
  }
}

TEST(CpuGradientCheck, Float32GradientMatchesCentralDifferencesOfFloat64Loss) {
  // xent computes in float from the same (float-representable) logits; its gradient must be the
  // derivative of the textbook loss to float accuracy.
  for (const spec& s : tiny_cases()) {
    const auto d = xt::make_dataset<float>(s);
    const oracle::problem pb = d.problem();
    const oracle::upstream up = d.oracle_upstream();
    expect_gradient_near(d, central_differences(pb, up), 2e-6);
  }
}

TEST(CpuGradientCheck, Float32MatchesOracleOnTinyCasesWithEveryOption) {
  xt::case_budget budget;
  for (spec s : tiny_cases()) {
    s.in_place = s.seed % 2;
    if (!budget.record(xt::run_case<float>(xt::make_dataset<float>(s)))) return;
  }
}

/// The objective of xent's own float64 forward: the reduced loss times the scalar upstream, or
/// sum_n g_n l_n under none (oracle::objective's counterpart).
double xent_objective(const xt::dataset<double>& d, const oracle::upstream& up) {
  const bool none = d.s.reduce == reduction::none;
  double loss = 0.0;
  std::vector<double> rows(d.s.rows);
  xent::basic_forward_outputs<double> o;
  if (none)
    o.row_loss = {rows.data(), d.s.rows};
  else
    o.loss = &loss;
  d.with_targets([&](auto t) { xent::forward(d.exec(), d.view(), t, d.options(), o); });
  if (!none) return up.scale * loss;
  double s = 0.0;
  for (std::int64_t n = 0; n < d.s.rows; ++n)
    s += (up.rows.empty() ? up.scale : up.rows[n]) * rows[n];
  return s;
}

TEST(CpuGradientCheck, Float64GradientMatchesCentralDifferencesOfItsOwnLoss) {
  // xent's float64 gradient against central differences of xent's float64 loss with a step of
  // 1e-6: truncation (h^2) and rounding (2^-53 / h) errors are ~1e-10 of the terms, so 1e-8 holds
  // and a float computation anywhere on the path (errors of 1e-7) fails.
  for (const spec& s : tiny_cases()) {
    auto d = xt::make_dataset<double>(s);  // no ld padding: d.logits is dense rows x cols
    const oracle::upstream up = d.oracle_upstream();
    const std::vector<double> fd =
        central_differences_in(d.logits, 1e-6, [&] { return xent_objective(d, up); });
    expect_gradient_near(d, fd, 1e-8);
  }
}

TEST(CpuGradientCheck, Float64MatchesOracleOnTinyCasesWithEveryOption) {
  xt::case_budget budget;
  for (spec s : tiny_cases()) {
    s.in_place = s.seed % 2;
    if (!budget.record(xt::run_case<double>(xt::make_dataset<double>(s)))) return;
  }
}

// ---------------------------------------------------------------------------------------------
// Values worked out by hand, for the oracle and for xent
// ---------------------------------------------------------------------------------------------

struct hand_case {
  std::string name;
  std::vector<double> logits;  // rows x cols
  std::int64_t cols;
  std::vector<std::int64_t> targets;  // class ids, or empty with probs
  std::vector<double> probs;
  reduction reduce = reduction::mean;
  double eps = 0, z_loss = 0, softcap = 0;
  std::vector<double> weights;
  double expected_loss;
  std::vector<double> expected_grad;  // empty: not checked (upstream 1)
};

std::vector<hand_case> hand_cases() {
  const double lse123 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));  // 3.40760596
  std::vector<hand_case> h;
  // PyTorch: cross_entropy([[1,2,3],[3,2,1]], [2,0]) = log(1 + e^-1 + e^-2) = 0.40760596.
  h.push_back({"plain mean",
               {1, 2, 3, 3, 2, 1},
               3,
               {2, 0},
               {},
               reduction::mean,
               0,
               0,
               0,
               {},
               std::log(1 + std::exp(-1.0) + std::exp(-2.0)),
               {}});
  // Label smoothing 0.1 over 3 classes: 0.9 (lse - 3) + (0.1 / 3)(3 lse - 6) = lse - 2.9.
  h.push_back(
      {"label smoothing", {1, 2, 3}, 3, {2}, {}, reduction::mean, 0.1, 0, 0, {}, lse123 - 2.9, {}});
  // Weighted mean: rows [0,0,0] -> 1 (w 2) and [1,2,3] -> 2 (w 3): (2 log 3 + 3 nll) / 5.
  h.push_back({"weighted mean",
               {0, 0, 0, 1, 2, 3},
               3,
               {1, 2},
               {},
               reduction::mean,
               0,
               0,
               0,
               {1, 2, 3},
               (2 * std::log(3.0) + 3 * (lse123 - 3)) / 5,
               {}});
  // Ignored rows do not count: the mean over the one row left.
  h.push_back({"mean with ignore",
               {0, 0, 0, 1, 2, 3},
               3,
               {-100, 2},
               {},
               reduction::mean,
               0,
               0,
               0,
               {},
               lse123 - 3,
               {}});
  // z-loss: [0, 0] -> 0, sum: log 2 + z (log 2)^2; gradient (1 + 2 z log 2) / 2 - [j = 0].
  {
    const double z = 0.01, l2 = std::log(2.0), a = (1 + 2 * z * l2) / 2;
    h.push_back(
        {"z-loss", {0, 0}, 2, {0}, {}, reduction::sum, 0, z, 0, {}, l2 + z * l2 * l2, {a - 1, a}});
  }
  // softcap 1: [100, 0] -> 1 becomes [tanh(100) = 1, 0]: log(e + 1) - 0; the slope at 100 is 0.
  h.push_back({"softcap",
               {100, 0},
               2,
               {1},
               {},
               reduction::sum,
               0,
               0,
               1,
               {},
               std::log(std::exp(1.0) + 1),
               {0.0, 1 / (std::exp(1.0) + 1) - 1}});
  // Soft targets [0.5, 0.5] on [0, log 3]: p = [1/4, 3/4]; loss -(log 1/4 + log 3/4) / 2.
  h.push_back({"soft targets",
               {0, std::log(3.0)},
               2,
               {},
               {0.5, 0.5},
               reduction::sum,
               0,
               0,
               0,
               {},
               -0.5 * (std::log(0.25) + std::log(0.75)),
               {0.25 - 0.5, 0.75 - 0.5}});
  // Every row ignored: mean is NaN, sum is 0.
  h.push_back({"all ignored mean",
               {1, 2},
               2,
               {-100},
               {},
               reduction::mean,
               0,
               0,
               0,
               {},
               std::numeric_limits<double>::quiet_NaN(),
               {0, 0}});
  h.push_back({"all ignored sum", {1, 2}, 2, {-100}, {}, reduction::sum, 0, 0, 0, {}, 0.0, {0, 0}});
  return h;
}

oracle::problem to_problem(const hand_case& c) {
  oracle::problem p;
  p.cols = c.cols;
  p.rows = static_cast<std::int64_t>(c.logits.size()) / c.cols;
  p.logits = c.logits;
  p.soft = c.targets.empty();
  p.targets = c.targets;
  p.probs = c.probs;
  p.reduce = static_cast<oracle::reduction>(static_cast<int>(c.reduce));
  p.label_smoothing = c.eps;
  p.z_loss = c.z_loss;
  p.softcap = c.softcap;
  p.weights = c.weights;
  return p;
}

TEST(OracleSelfCheck, MatchesValuesWorkedOutByHand) {
  for (const hand_case& c : hand_cases()) {
    const oracle::upstream up;
    const oracle::result r = oracle::evaluate(to_problem(c), &up);
    if (std::isnan(c.expected_loss)) {
      EXPECT_TRUE(std::isnan(r.loss)) << c.name;
    } else {
      EXPECT_NEAR(r.loss, c.expected_loss, 1e-12) << c.name;
    }
    for (std::size_t i = 0; i < c.expected_grad.size(); ++i)
      EXPECT_NEAR(r.grad[i], c.expected_grad[i], 1e-12) << c.name << " grad " << i;
  }
}

TEST(CpuForward, MatchesValuesWorkedOutByHand) {
  for (const hand_case& c : hand_cases()) {
    const oracle::problem p = to_problem(c);
    std::vector<float> logits(c.logits.begin(), c.logits.end()),
        probs(c.probs.begin(), c.probs.end());
    std::vector<float> weights(c.weights.begin(), c.weights.end()), grad(logits.size(), 7.0f);
    xent::options opts;
    opts.reduce = c.reduce;
    opts.label_smoothing = static_cast<float>(c.eps);
    opts.z_loss = static_cast<float>(c.z_loss);
    opts.softcap = static_cast<float>(c.softcap);
    if (!weights.empty()) opts.class_weights = {weights.data(), c.cols};
    float loss = 12345.0f;
    std::vector<float> row_loss(p.rows);
    xent::forward_outputs out;
    out.loss = &loss;
    out.row_loss = {row_loss.data(), p.rows};
    const xent::matrix_view<const float> L(logits.data(), p.rows, c.cols);
    const xent::matrix_view<float> G(grad.data(), p.rows, c.cols);
    if (p.soft) {
      const xent::soft_targets<float> P{{probs.data(), p.rows, c.cols}};
      xent::forward_backward(xent::cpu{}, L, P, opts, xent::upstream{}, out, G);
    } else {
      xent::forward_backward(xent::cpu{}, L,
                             xent::vector_view<const std::int64_t>(c.targets.data(), p.rows), opts,
                             xent::upstream{}, out, G);
    }
    if (std::isnan(c.expected_loss)) {
      EXPECT_TRUE(std::isnan(loss)) << c.name;
    } else {
      EXPECT_NEAR(loss, c.expected_loss, 1e-6 * (1 + std::fabs(c.expected_loss))) << c.name;
    }
    for (std::size_t i = 0; i < c.expected_grad.size(); ++i)
      EXPECT_NEAR(grad[i], c.expected_grad[i], 1e-6) << c.name << " grad " << i;
  }
}

}  // namespace
