// Semantics at the edges (ignored rows, empty batches, masked and NaN logits, ignore_index equal to
// a class id), invariances (shift, vocabulary permutation), determinism and precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "harness.hpp"

namespace {

using namespace xt::names;  // NOLINT(google-build-using-namespace): the harness's vocabulary

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

spec base(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  spec s;
  s.rows = rows;
  s.cols = cols;
  s.seed = seed;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Ignored rows, empty batches
// ---------------------------------------------------------------------------------------------

TEST(CpuEdge, AllTargetsIgnoredMeanIsNaNWithZeroGradient) {
  for (target_kind kind : {target_kind::int32, target_kind::int64}) {
    spec s = base(5, 33, 1);
    s.kind = kind;
    s.ignore = ignore_mode::all;
    s.weights = true;
    s.label_smoothing = 0.1f;
    s.z_loss = 1e-3f;
    auto d = xt::make_dataset<float>(s);
    for (bool fused : {true, false}) {
      auto r = xt::call(d, fused);
      EXPECT_TRUE(std::isnan(r.loss)) << "mean over no rows is NaN, as PyTorch; got " << r.loss;
      EXPECT_EQ(r.correct, 0);
      for (std::int64_t n = 0; n < s.rows; ++n) {
        EXPECT_EQ(r.row_loss[n], 0.0f);
        EXPECT_EQ(r.lse[n], 0.0f);
        EXPECT_EQ(r.argmax[n], -1);
        for (std::int64_t c = 0; c < s.cols; ++c)
          ASSERT_TRUE(xt::same_bits(r.grad[n * s.ld() + c], 0.0f))
              << "row " << n << " col " << c << " = " << r.grad[n * s.ld() + c];
      }
    }
    EXPECT_TRUE(xt::run_case<float>(d));
  }
}

TEST(CpuEdge, AllTargetsIgnoredSumIsZero) {
  spec s = base(4, 17, 2);
  s.reduce = reduction::sum;
  s.ignore = ignore_mode::all;
  s.z_loss = 1e-3f;
  auto d = xt::make_dataset<bf16>(s);
  auto r = xt::call(d);
  EXPECT_TRUE(xt::same_bits(r.loss, 0.0f)) << r.loss;
  for (std::int64_t i = 0; i < s.rows * s.cols; ++i) ASSERT_EQ(xt::to_double(r.grad[i]), 0.0);
  EXPECT_TRUE(xt::run_case<bf16>(d));
}

TEST(CpuEdge, EmptyBatchMeanIsNaNAndSumIsZero) {
  for (target_kind kind : {target_kind::int64, target_kind::soft}) {
    for (reduction red : {reduction::mean, reduction::sum, reduction::none}) {
      spec s = base(0, 10, 3);
      s.kind = kind;
      s.reduce = red;
      auto d = xt::make_dataset<float>(s);
      auto r = xt::call(d);
      if (red == reduction::mean) {
        EXPECT_TRUE(std::isnan(r.loss)) << r.loss;
      } else if (red == reduction::sum) {
        EXPECT_TRUE(xt::same_bits(r.loss, 0.0f)) << r.loss;
      } else {
        EXPECT_EQ(r.loss, 12345.0f) << "no loss output under none";
      }
      if (kind != target_kind::soft) {
        EXPECT_EQ(r.correct, 0);
      }
      EXPECT_TRUE(xt::run_case<float>(d));
    }
  }
  // No logits at all (0 x 0) is an empty batch too.
  float loss = 1.0f;
  xent::forward_outputs o;
  o.loss = &loss;
  xent::forward(xent::cpu{}, xent::matrix_view<const float>(nullptr, 0, 0),
                xent::vector_view<const std::int64_t>(nullptr, 0), xent::options{}, o);
  EXPECT_TRUE(std::isnan(loss));
}

TEST(CpuEdge, IgnoreIndexEqualToAValidClassIgnoresThoseRows) {
  spec s = base(6, 9, 4);
  s.ignore_index = 0;
  auto d = xt::make_dataset<float>(s);
  const std::int64_t targets[6] = {0, 3, 0, 8, 1, 0};
  for (std::int64_t n = 0; n < 6; ++n) d.set_target(n, targets[n]);
  auto r = xt::call(d);
  for (std::int64_t n : {0, 2, 5}) {
    EXPECT_EQ(r.row_loss[n], 0.0f);
    EXPECT_EQ(r.argmax[n], -1);
    for (std::int64_t c = 0; c < s.cols; ++c) EXPECT_EQ(r.grad[n * s.ld() + c], 0.0f);
  }
  // The mean divides by the three rows left.
  const oracle::result o = oracle::evaluate(d.problem());
  EXPECT_EQ(o.normalizer, 3.0);
  EXPECT_NEAR(r.loss, (o.row_loss[1] + o.row_loss[3] + o.row_loss[4]) / 3.0, 1e-5);
  EXPECT_TRUE(xt::run_case<float>(d));
}

TEST(CpuEdge, ClassWeightsWithIgnoredRowsDivideByTheWeightsOfRowsKept) {
  spec s = base(4, 5, 5);
  s.weights = true;
  s.label_smoothing = 0.1f;
  s.z_loss = 1e-3f;
  auto d = xt::make_dataset<float>(s);
  d.weights = {0.5f, 2.0f, 1.0f, 3.0f, 0.25f};
  const std::int64_t targets[4] = {1, -100, 3, -100};
  for (std::int64_t n = 0; n < 4; ++n) d.set_target(n, targets[n]);
  auto r = xt::call(d);
  // W = w[1] + w[3] = 5; loss = (l_0 + l_2) / 5 with l_n computed by the oracle.
  const oracle::result o = oracle::evaluate(d.problem());
  EXPECT_EQ(o.normalizer, 5.0);
  EXPECT_NEAR(r.loss, (o.row_loss[0] + o.row_loss[2]) / 5.0, 1e-5 * std::fabs(r.loss));
  EXPECT_TRUE(xt::run_case<float>(d));
}

// PyTorch's nll_loss reads each row's w_y alone: an inf or NaN weight on a class no row targets
// leaves every loss and gradient finite. Only smoothing weighs every class (then it is +inf or
// NaN, in PyTorch too).
TEST(CpuEdge, NonFiniteWeightOfAClassNoRowTargetsChangesNothing) {
  for (float bad : {kInf, kNaN})
    for (reduction red : {reduction::mean, reduction::sum, reduction::none})
      for (float z : {0.0f, 1e-3f}) {
        spec s = base(6, 9, 11);
        s.weights = true;
        s.reduce = red;
        s.z_loss = z;
        auto d = xt::make_dataset<float>(s);
        for (std::int64_t n = 0; n < s.rows; ++n) d.set_target(n, n % 4 == 3 ? -100 : n % 8);
        auto finite = d;
        finite.weights[8] = 1.0f;
        d.weights[8] = bad;  // class 8: no row's target
        for (bool fused : {true, false}) {
          const auto r = xt::call(d, fused);
          const auto want = xt::call(finite, fused);
          for (std::size_t i = 0; i < r.grad.size(); ++i)
            ASSERT_EQ(r.grad[i], want.grad[i]) << "element " << i << " fused " << fused;
          for (std::int64_t n = 0; n < s.rows; ++n) ASSERT_EQ(r.row_loss[n], want.row_loss[n]);
          if (red != reduction::none) {
            ASSERT_EQ(r.loss, want.loss);
          }
        }
        EXPECT_TRUE(xt::run_case<float>(d));
      }
}

TEST(CpuEdge, SingleClassRowsHaveZeroLossAndGradient) {
  for (float eps : {0.0f, 0.3f}) {
    spec s = base(3, 1, 6);
    s.label_smoothing = eps;
    s.weights = true;
    s.reduce = reduction::sum;
    auto d = xt::make_dataset<float>(s);
    auto r = xt::call(d);
    for (std::int64_t n = 0; n < 3; ++n) {
      // log p = 0 exactly; with smoothing and weights, w * lse - w * z may keep one rounding of
      // the product (contracted into an FMA), an ulp of |w z|.
      EXPECT_NEAR(r.row_loss[n], 0.0f,
                  std::ldexp(std::fabs(d.weights[0] * static_cast<float>(d.x(n, 0))), -23));
      EXPECT_EQ(r.argmax[n], 0);
      EXPECT_EQ(r.grad[n], 0.0f);
      EXPECT_EQ(r.lse[n], static_cast<float>(d.x(n, 0)));
    }
    EXPECT_EQ(r.correct, 3);
  }
}

TEST(CpuEdge, ZeroUpstreamGivesZeroGradientNotNaN) {
  for (reduction red : {reduction::mean, reduction::sum, reduction::none}) {
    spec s = base(5, 40, 7);
    s.reduce = red;
    s.scale = 0.0f;
    s.softcap = 30.0f;
    s.z_loss = 1e-3f;
    auto d = xt::make_dataset<bf16>(s);
    auto r = xt::call(d);
    for (std::int64_t i = 0; i < s.rows * s.cols; ++i) ASSERT_EQ(xt::to_double(r.grad[i]), 0.0);
  }
}

// ---------------------------------------------------------------------------------------------
// Masked (-inf) and NaN logits
// ---------------------------------------------------------------------------------------------

/// Masks a random third of each row with -inf (never the target, never the whole row).
template <class T>
void mask(xt::dataset<T>& d, std::int64_t first_masked_chunk = 0) {
  std::mt19937_64 rng(d.s.seed);
  for (std::int64_t n = 0; n < d.s.rows; ++n) {
    const std::int64_t y = d.s.kind == target_kind::soft ? -1 : d.target(n);
    std::int64_t kept = -1;
    for (std::int64_t c = 0; c < d.s.cols; ++c) {
      const bool masked = c < first_masked_chunk || rng() % 3 == 0;
      if (masked && c != y)
        d.x(n, c) = static_cast<T>(-kInf);
      else
        kept = c;
    }
    if (kept < 0) d.x(n, d.s.cols - 1) = static_cast<T>(1.0f);
  }
}

TEST(CpuEdge, MaskedLogitsGiveFiniteCorrectResults) {
  xt::case_budget budget;
  std::uint64_t seed = 10;
  for (std::int64_t cols : {5, 64, 200, 33000}) {
    for (int variant = 0; variant < 4; ++variant) {
      spec s = base(cols > 1000 ? 3 : 7, cols, ++seed);
      s.chunk = cols > 1000 ? 0 : 64;
      s.threads = cols > 1000 ? 7 : 1;  // 3 rows x 33000 on 7 threads: vocabulary split
      s.weights = variant & 1;
      s.z_loss = variant & 2 ? 1e-3f : 0.0f;
      s.softcap = variant == 3 ? 30.0f : 0.0f;
      s.reduce = variant == 2 ? reduction::none : reduction::mean;
      s.in_place = variant == 1;
      auto d = xt::make_dataset<float>(s);
      mask(d, cols == 200 ? 64 : 0);  // cols 200: the whole first chunk is masked
      auto r = xt::call(d);
      for (std::int64_t n = 0; n < s.rows; ++n) EXPECT_TRUE(std::isfinite(r.row_loss[n]));
      if (s.reduce != reduction::none) {
        EXPECT_TRUE(std::isfinite(r.loss));
      }
      for (std::int64_t i = 0; i < s.rows * s.ld(); ++i) ASSERT_TRUE(std::isfinite(r.grad[i]));
      if (!budget.record(xt::run_case<float>(d))) return;
      auto h = xt::make_dataset<bf16>(s);
      mask(h);
      if (!budget.record(xt::run_case<bf16>(h))) return;
    }
  }
}

TEST(CpuEdge, MaskedLogitsWithLabelSmoothingGiveInfiniteLossAndFiniteGradient) {
  // eps / V of the target mass sits on every class, so a masked class makes the loss +inf
  // (PyTorch agrees); the gradient stays finite (p_j = 0 there).
  spec s = base(3, 20, 30);
  s.label_smoothing = 0.1f;
  s.reduce = reduction::none;
  auto d = xt::make_dataset<float>(s);
  mask(d);
  auto r = xt::call(d);
  for (std::int64_t n = 0; n < 3; ++n) EXPECT_EQ(r.row_loss[n], kInf);
  for (std::int64_t i = 0; i < s.rows * s.ld(); ++i) ASSERT_TRUE(std::isfinite(r.grad[i]));
  EXPECT_TRUE(xt::run_case<float>(d));
}

// A soft target with no mass on the masked classes: PyTorch's -(t * log_softmax(x)).sum() forms
// 0 * -inf there and returns NaN, and so do xent (its dot sum_c t'_c z_c) and the oracle (which
// forms PyTorch's terms; it once skipped classes without mass and expected a finite loss).
TEST(CpuEdge, MaskedLogitsWithSoftTargetsOfZeroMassAreNaNLikePyTorch) {
  spec s = base(3, 20, 31);
  s.kind = target_kind::soft;
  s.reduce = reduction::none;
  auto d = xt::make_dataset<float>(s);
  mask(d);
  for (std::int64_t n = 0; n < 3; ++n)
    for (std::int64_t c = 0; c < 20; ++c)
      if (std::isinf(d.x(n, c))) d.probs[n * s.ld() + c] = 0.0f;
  auto r = xt::call(d);
  const oracle::result o = oracle::evaluate(d.problem());
  for (std::int64_t n = 0; n < 3; ++n) {
    EXPECT_TRUE(std::isnan(r.row_loss[n])) << "row " << n << ": " << r.row_loss[n];
    EXPECT_TRUE(std::isnan(o.row_loss[n])) << "oracle row " << n << ": " << o.row_loss[n];
  }
  EXPECT_TRUE(xt::run_case<float>(d));
}

// The same with label smoothing over class ids: a masked class of weight 0 enters the smoothing
// sum -sum_c w_c log p_c as 0 * -inf, NaN in PyTorch and in xent alike.
TEST(CpuEdge, MaskedClassOfZeroWeightWithLabelSmoothingIsNaNLikePyTorch) {
  spec s = base(3, 20, 32);
  s.weights = true;
  s.label_smoothing = 0.1f;
  s.reduce = reduction::none;
  auto d = xt::make_dataset<float>(s);
  mask(d);
  for (std::int64_t c = 0; c < 20; ++c)
    if (std::isinf(d.x(0, c))) d.weights[c] = 0.0f;  // row 0's masked classes weigh nothing
  auto r = xt::call(d);
  const oracle::result o = oracle::evaluate(d.problem());
  EXPECT_TRUE(std::isnan(r.row_loss[0])) << r.row_loss[0];
  EXPECT_TRUE(std::isnan(o.row_loss[0])) << o.row_loss[0];
  EXPECT_TRUE(xt::run_case<float>(d));
}

// Mean over rows whose every class weight is 0 (W = 0 with rows kept): PyTorch's
// (1 - eps) * nll_mean + eps * smooth / W is NaN through its 0 / 0 NLL term, and its gradient is
// NaN on every kept row (nll_loss_backward's w_y * g / W = 0 * inf); ignored rows stay 0. Without
// the rule a positive smoothing or z-loss total gave +inf, and +inf and NaN mixed in the rows.
TEST(CpuEdge, MeanOverKeptRowsOfZeroWeightIsNaNLikePyTorch) {
  for (float eps : {0.0f, 0.1f})
    for (float z : {0.0f, 1e-3f}) {
      SCOPED_TRACE(std::to_string(eps) + " " + std::to_string(z));
      spec s = base(3, 6, 33);
      s.weights = true;
      s.label_smoothing = eps;
      s.z_loss = z;
      auto d = xt::make_dataset<float>(s);
      d.weights = {0.0f, 1.0f, 2.0f, 0.5f, 1.0f, 3.0f};
      const std::int64_t targets[3] = {0, -100, 0};
      for (std::int64_t n = 0; n < 3; ++n) d.set_target(n, targets[n]);
      for (bool fused : {true, false}) {
        auto r = xt::call(d, fused);
        EXPECT_TRUE(std::isnan(r.loss)) << r.loss;
        for (std::int64_t c = 0; c < s.cols; ++c) {
          EXPECT_TRUE(std::isnan(r.grad[0 * s.ld() + c])) << "row 0 col " << c;
          EXPECT_TRUE(xt::same_bits(r.grad[1 * s.ld() + c], 0.0f)) << "ignored row, col " << c;
          EXPECT_TRUE(std::isnan(r.grad[2 * s.ld() + c])) << "row 2 col " << c;
        }
      }
      EXPECT_TRUE(xt::run_case<float>(d));
    }
}

TEST(CpuEdge, NaNLogitPropagatesToItsRowOnly) {
  struct variant {
    std::int64_t rows, cols;
    int threads;
    bool softcap;
  };
  for (const variant& v : {variant{3, 50, 1, false}, variant{3, 50, 1, true},
                           variant{3, 40000, 7, false}, variant{2, 40000, 7, true}}) {
    for (reduction red : {reduction::none, reduction::mean}) {
      spec s = base(v.rows, v.cols, 40);
      s.threads = v.threads;
      s.softcap = v.softcap ? 30.0f : 0.0f;
      s.reduce = red;
      s.label_smoothing = 0.1f;
      auto d = xt::make_dataset<float>(s);
      d.x(1, v.cols / 2 + 1) = kNaN;
      auto r = xt::call(d);
      EXPECT_TRUE(std::isnan(r.row_loss[1]));
      EXPECT_TRUE(std::isnan(r.lse[1]));
      EXPECT_EQ(r.argmax[1], v.cols / 2 + 1) << "NaN counts as the maximum (torch.argmax)";
      for (std::int64_t n = 0; n < v.rows; ++n)
        if (n != 1) {
          EXPECT_TRUE(std::isfinite(r.row_loss[n])) << "row " << n;
        }
      if (red == reduction::mean) {
        EXPECT_TRUE(std::isnan(r.loss));
      }
      for (std::int64_t n = 0; n < v.rows; ++n) {
        if (n == 1) continue;
        for (std::int64_t c = 0; c < v.cols; ++c)
          ASSERT_TRUE(std::isfinite(r.grad[n * s.ld() + c])) << "row " << n << " col " << c;
      }
      EXPECT_TRUE(xt::run_case<float>(d)) << "NaN variant " << v.rows << "x" << v.cols;
    }
  }
}

/// A row whose every logit is -inf: PyTorch's log_softmax is NaN there (x - max = -inf - -inf),
/// so its loss and whole gradient row are NaN, in every dtype and through every entry point
/// (backward from the saved LSE of -inf, forward_backward), with or without label smoothing.
template <class T, class G>
void expect_all_masked_row_is_nan(float eps) {
  using A = xent::accumulator_t<T>;
  constexpr std::int64_t rows = 2, cols = 4;
  const T inf = T(std::numeric_limits<float>::infinity());
  std::vector<T> logits = {T(0.5f), T(-1.0f), T(2.0f), T(0.25f), -inf, -inf, -inf, -inf};
  const std::vector<std::int64_t> targets = {2, 1};
  std::vector<A> row_loss(rows), lse(rows);
  std::vector<G> grad(rows * cols), fused(rows * cols);
  xent::options opts;
  opts.reduce = reduction::none;
  opts.label_smoothing = eps;
  xent::basic_forward_outputs<A> out;
  out.row_loss = {row_loss.data(), rows};
  out.lse = {lse.data(), rows};
  const xent::matrix_view<const T> L(logits.data(), rows, cols);
  const xent::vector_view<const std::int64_t> y(targets.data(), rows);
  std::vector<A> ones(rows, A(1));
  xent::basic_upstream<A> up;
  up.rows = {ones.data(), rows};
  xent::forward(xent::cpu{1}, L, y, opts, out);
  EXPECT_TRUE(std::isfinite(row_loss[0]));
  EXPECT_TRUE(std::isnan(row_loss[1])) << row_loss[1];
  EXPECT_EQ(lse[1], -std::numeric_limits<A>::infinity());
  xent::backward(xent::cpu{1}, L, y, opts, xent::vector_view<const A>(lse.data(), rows), up,
                 xent::matrix_view<G>(grad.data(), rows, cols));
  xent::forward_backward(xent::cpu{1}, L, y, opts, up, out,
                         xent::matrix_view<G>(fused.data(), rows, cols));
  for (std::int64_t c = 0; c < cols; ++c) {
    EXPECT_TRUE(std::isfinite(static_cast<double>(grad[c])));
    EXPECT_TRUE(std::isnan(static_cast<double>(grad[cols + c])))
        << "backward, class " << c << ": " << static_cast<double>(grad[cols + c]);
    EXPECT_TRUE(std::isnan(static_cast<double>(fused[cols + c])))
        << "forward_backward, class " << c << ": " << static_cast<double>(fused[cols + c]);
  }
}

TEST(CpuEdge, RowOfMinusInfinityAloneIsNaNLikePyTorch) {
  for (float eps : {0.0f, 0.5f}) {
    SCOPED_TRACE(eps);
    expect_all_masked_row_is_nan<float, float>(eps);
    expect_all_masked_row_is_nan<double, double>(eps);
    expect_all_masked_row_is_nan<double, float>(eps);
    expect_all_masked_row_is_nan<bf16, bf16>(eps);
  }
}

TEST(CpuEdge, Float64KeepsPyTorchsResultsAtTheEdges) {
  // Every row ignored (mean NaN, sum 0), an empty batch, masked logits, a NaN logit: the float64
  // path gives PyTorch's results as the float path does, to double precision.
  for (reduction red : {reduction::mean, reduction::sum}) {
    spec s = base(5, 33, 50);
    s.reduce = red;
    s.ignore = ignore_mode::all;
    s.label_smoothing = 0.1f;
    const auto d = xt::make_dataset<double>(s);
    const auto r = xt::call(d);
    if (red == reduction::mean)
      EXPECT_TRUE(std::isnan(r.loss)) << r.loss;
    else
      EXPECT_TRUE(xt::same_bits(r.loss, 0.0)) << r.loss;
    for (std::int64_t i = 0; i < s.rows * s.cols; ++i) ASSERT_TRUE(xt::same_bits(r.grad[i], 0.0));
    EXPECT_TRUE(xt::run_case<double>(d));
  }
  EXPECT_TRUE(xt::run_case<double>(xt::make_dataset<double>(base(0, 10, 51))));
  for (int variant = 0; variant < 4; ++variant) {
    spec s = base(7, 200, 52 + variant);
    s.chunk = 64;
    s.weights = variant & 1;
    s.z_loss = variant & 2 ? 1e-3f : 0.0f;
    s.softcap = variant == 3 ? 30.0f : 0.0f;
    auto d = xt::make_dataset<double>(s);
    mask(d, 64);
    EXPECT_TRUE(xt::run_case<double>(d)) << "masked variant " << variant;
  }
  spec s = base(3, 50, 60);
  s.reduce = reduction::none;
  s.label_smoothing = 0.1f;
  auto d = xt::make_dataset<double>(s);
  d.x(1, 26) = std::numeric_limits<double>::quiet_NaN();
  const auto r = xt::call(d);
  EXPECT_TRUE(std::isnan(r.row_loss[1]));
  EXPECT_TRUE(std::isfinite(r.row_loss[0]) && std::isfinite(r.row_loss[2]));
  EXPECT_EQ(r.argmax[1], 26);
  EXPECT_TRUE(xt::run_case<double>(d));
}

TEST(CpuEdge, SoftcapNearSaturationKeepsDistinctLogitsApart) {
  // x / cap from 7.6 to 8.0 and one at 8.8: float soft-caps those to at most 4.9999990 and to
  // 4.9999995 (a float step apart), but Eigen's float packet tanh gave one value for every
  // argument past 7.9053, so 8.0 and 8.8 tied and argmax named the first class past 7.9053, where
  // torch.argmax of float32 soft-capped logits (and xent's float64 path) names the 8.8.
  constexpr float cap = 5.0f;
  for (std::int64_t cols : {16, 19}) {  // whole packets, and a remainder
    for (std::int64_t best : {std::int64_t{0}, cols / 2, cols - 1}) {
      std::vector<float> row(static_cast<std::size_t>(cols));
      for (std::int64_t c = 0; c < cols; ++c)
        row[c] = cap * (7.6f + 0.4f * static_cast<float>(c) / static_cast<float>(cols - 1));
      row[best] = cap * 8.8f;
      SCOPED_TRACE(::testing::Message() << cols << " classes, largest at " << best);
      const std::int64_t target = best;
      xent::options o;
      o.softcap = cap;
      float loss = 0.0f;
      std::int64_t argmax = -2, correct = -1;
      xent::forward_outputs out;
      out.loss = &loss;
      out.argmax = {&argmax, 1};
      out.num_correct = &correct;
      xent::forward(xent::cpu{1}, xent::matrix_view<const float>(row.data(), 1, cols),
                    xent::vector_view<const std::int64_t>(&target, 1), o, out);
      EXPECT_EQ(argmax, best);
      EXPECT_EQ(correct, 1);
      double m = -1e300, sum = 0.0;
      for (float v : row) m = std::max(m, cap * std::tanh(double(v) / cap));
      for (float v : row) sum += std::exp(cap * std::tanh(double(v) / cap) - m);
      const double expected = m + std::log(sum) - cap * std::tanh(double(row[best]) / cap);
      EXPECT_NEAR(loss, expected, 1e-5 * expected);
    }
  }
}

TEST(CpuEdge, SaturatedSoftcapTargetNeverGivesANegativeLoss) {
  // A confident row under softcap: the target's logit far past the cap, the rest 0. Its capped
  // logit is the row's maximum, so its loss is lse - z_y >= 0 (5.9e-12 in float64). The target
  // was capped by std::tanh and the row by Eigen's packet tanh, which differ by up to 3e-7
  // relative there: a loss of -1.9e-6 and a target gradient of +1.2e-11 at x_y = 200.
  constexpr float cap = 30.0f;
  for (std::int64_t cols : {64, 67}) {  // whole packets, and a remainder
    for (std::int64_t y : {std::int64_t{3}, cols - 1}) {
      for (float big : {200.0f, 240.0f, 270.0f, 1000.0f}) {
        SCOPED_TRACE(::testing::Message() << cols << " classes, target " << y << " at " << big);
        std::vector<float> x(static_cast<std::size_t>(cols), 0.0f), grad(x.size());
        x[static_cast<std::size_t>(y)] = big;
        const std::int64_t target = y;
        xent::options o;
        o.softcap = cap;
        o.reduce = reduction::none;
        float row_loss = -1.0f, lse = 0.0f, one = 1.0f;
        xent::forward_outputs out;
        out.row_loss = {&row_loss, 1};
        out.lse = {&lse, 1};
        xent::upstream up;
        up.rows = {&one, 1};
        xent::forward_backward(xent::cpu{1}, xent::matrix_view<const float>(x.data(), 1, cols),
                               xent::vector_view<const std::int64_t>(&target, 1), o, up, out,
                               xent::matrix_view<float>(grad.data(), 1, cols));
        EXPECT_GE(row_loss, 0.0f);
        // The float64 loss is 5.9e-12; a float tanh near saturation errs by a few 1e-7 relative.
        EXPECT_LE(row_loss, 1e-5f);
        EXPECT_LE(grad[static_cast<std::size_t>(y)], 0.0f) << "p_y - 1 cannot be positive";
        const double z_y = cap * std::tanh(double(big) / cap);
        EXPECT_NEAR(lse, z_y + std::log1p((cols - 1) * std::exp(-z_y)), 1e-5);
        float forward_loss = -1.0f;
        xent::forward_outputs fout;
        fout.row_loss = {&forward_loss, 1};
        xent::forward(xent::cpu{1}, xent::matrix_view<const float>(x.data(), 1, cols),
                      xent::vector_view<const std::int64_t>(&target, 1), o, fout);
        EXPECT_TRUE(xt::same_bits(forward_loss, row_loss)) << forward_loss << " " << row_loss;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Invariances
// ---------------------------------------------------------------------------------------------

/// An invariance test's problem: class weights and label smoothing on, 64-element chunks.
spec invariance_case(target_kind kind, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  spec s = base(rows, cols, seed);
  s.kind = kind;
  s.chunk = 64;
  s.weights = true;
  s.label_smoothing = 0.1f;
  return s;
}

/// Row n of b's gradient equals column moved(c) of a's row n for every column c, within `tol` of
/// a's largest |element| in that row.
template <class Moved>
void expect_row_gradient_near(const xt::call_result<float>& a, const xt::call_result<float>& b,
                              const spec& s, std::int64_t n, double tol, Moved moved) {
  double rowmax = 0;
  for (std::int64_t c = 0; c < s.cols; ++c)
    rowmax = std::max(rowmax, std::fabs(double(a.grad[n * s.ld() + c])));
  for (std::int64_t c = 0; c < s.cols; ++c)
    ASSERT_NEAR(b.grad[n * s.ld() + c], a.grad[n * s.ld() + moved(c)], tol * rowmax)
        << "row " << n << " col " << c;
}

TEST(CpuInvariance, AddingAConstantToARowChangesNothing) {
  for (target_kind kind : {target_kind::int64, target_kind::soft}) {
    for (std::int64_t cols : {7, 300, 5000}) {
      const spec s = invariance_case(kind, 5, cols, 50);
      auto d = xt::make_dataset<float>(s);
      // Logits on a 2^-10 grid in [-8, 8], so x + 16 is exact in float.
      for (auto& x : d.logits)
        if (x != xt::sentinel<float>()) x = std::round(x * 1024.0f) / 1024.0f;
      auto shifted = d;
      for (std::int64_t n = 0; n < s.rows; ++n)
        for (std::int64_t c = 0; c < cols; ++c) shifted.x(n, c) += 16.0f * static_cast<float>(n);
      auto a = xt::call(d), b = xt::call(shifted);
      EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(a.loss));
      for (std::int64_t n = 0; n < s.rows; ++n) {
        EXPECT_NEAR(a.row_loss[n], b.row_loss[n], 2e-5 * (1 + std::fabs(a.row_loss[n])));
        EXPECT_NEAR(a.lse[n] + 16.0f * n, b.lse[n], 1e-5 * (1 + std::fabs(b.lse[n])));
        EXPECT_EQ(a.argmax[n], b.argmax[n]);
        expect_row_gradient_near(a, b, s, n, 2e-5, [](std::int64_t c) { return c; });
      }
    }
  }
}

TEST(CpuInvariance, PermutingTheVocabularyPermutesTheGradient) {
  for (target_kind kind : {target_kind::int32, target_kind::soft}) {
    for (std::int64_t cols : {9, 130, 4100}) {
      spec s = invariance_case(kind, 6, cols, 60);
      s.z_loss = 1e-3f;
      s.softcap = 30.0f;
      s.ignore = ignore_mode::some;
      auto d = xt::make_dataset<float>(s);
      std::vector<std::int64_t> perm(cols), inverse(cols);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), std::mt19937_64(cols));
      for (std::int64_t c = 0; c < cols; ++c) inverse[perm[c]] = c;
      // Column c of the permuted problem is column perm[c] of the original.
      auto p = d;
      for (std::int64_t n = 0; n < s.rows; ++n) {
        for (std::int64_t c = 0; c < cols; ++c) {
          p.x(n, c) = d.x(n, perm[c]);
          if (kind == target_kind::soft) p.probs[n * s.ld() + c] = d.probs[n * s.ld() + perm[c]];
        }
        if (kind != target_kind::soft && d.target(n) != s.ignore_index)
          p.set_target(n, inverse[d.target(n)]);
      }
      for (std::int64_t c = 0; c < cols; ++c) p.weights[c] = d.weights[perm[c]];
      auto a = xt::call(d), b = xt::call(p);
      EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(a.loss));
      if (kind != target_kind::soft) {
        EXPECT_EQ(a.correct, b.correct);
      }
      for (std::int64_t n = 0; n < s.rows; ++n) {
        EXPECT_NEAR(a.row_loss[n], b.row_loss[n], 1e-5 * (1 + std::fabs(a.row_loss[n])));
        EXPECT_NEAR(a.lse[n], b.lse[n], 1e-5 * (1 + std::fabs(a.lse[n])));
        if (a.argmax[n] >= 0) {
          EXPECT_EQ(a.argmax[n], perm[b.argmax[n]]);
        }
        expect_row_gradient_near(a, b, s, n, 1e-5, [&](std::int64_t c) { return perm[c]; });
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Determinism
// ---------------------------------------------------------------------------------------------

/// The first difference between two results, or "" when they are bitwise equal.
template <class G>
std::string bitwise_diff(const xt::call_result<G>& a, const xt::call_result<G>& b,
                         bool compare_loss) {
  std::ostringstream m;
  if (compare_loss && !xt::same_bits(a.loss, b.loss))
    m << "loss " << xt::num(a.loss) << " vs " << xt::num(b.loss);
  else if (a.correct != b.correct)
    m << "num_correct " << a.correct << " vs " << b.correct;
  else if (a.argmax != b.argmax)
    m << "argmax differs";
  if (!m.str().empty()) return m.str();
  for (std::size_t n = 0; n < a.row_loss.size(); ++n)
    if (!xt::same_bits(a.row_loss[n], b.row_loss[n]) || !xt::same_bits(a.lse[n], b.lse[n])) {
      m << "row " << n << ": row_loss " << xt::num(a.row_loss[n]) << " vs "
        << xt::num(b.row_loss[n]) << ", lse " << xt::num(a.lse[n]) << " vs " << xt::num(b.lse[n]);
      return m.str();
    }
  if (a.grad.size() != b.grad.size()) return "gradient sizes differ";
  for (std::size_t i = 0; i < a.grad.size(); ++i)
    if (!xt::same_bits(a.grad[i], b.grad[i])) {
      m << "grad element " << i << ": " << xt::num(xt::to_double(a.grad[i])) << " vs "
        << xt::num(xt::to_double(b.grad[i]));
      return m.str();
    }
  return "";
}

/// The same call twice, with the same inputs and the same output buffers, gives the same bits.
template <class T>
void expect_same_bits_twice(const spec& s, bool fused) {
  const auto d = xt::make_dataset<T>(s);
  xt::call_result<T> r;
  xt::call_into(d, fused, r);
  const auto first = r;
  xt::call_into(d, fused, r);
  EXPECT_EQ(bitwise_diff(first, r, true), "") << s.describe();
}

TEST(CpuDeterminism, SameCallTwiceIsBitwiseIdentical) {
  struct variant {
    std::int64_t rows, cols;
    int threads;
  };
  for (const variant& v : {variant{733, 129, 4}, variant{3, 32000, 7}, variant{19, 3000, 1}}) {
    for (bool fused : {true, false}) {
      spec s = base(v.rows, v.cols, 70);
      s.threads = v.threads;
      s.weights = true;
      s.label_smoothing = 0.1f;
      s.ignore = ignore_mode::some;
      expect_same_bits_twice<float>(s, fused);
      s.kind = target_kind::soft;
      s.softcap = 30.0f;
      expect_same_bits_twice<bf16>(s, fused);
    }
  }
}

TEST(CpuDeterminism, ResultsDoNotDependOnBufferAddresses) {
  // The same values at another address must give the same bits: callers allocate fresh gradient
  // buffers every step. Logits and gradient are placed at every float offset mod 64 bytes.
  struct variant {
    float eps;
    bool weights, softcap, fused;
  };
  for (const variant& v : {variant{0.0f, false, false, false}, variant{0.1f, false, false, false},
                           variant{0.1f, true, true, false}, variant{0.0f, false, false, true},
                           variant{0.1f, true, false, true}, variant{0.0f, false, true, true}}) {
    spec s = base(64, 200, 75);
    s.label_smoothing = v.eps;
    s.weights = v.weights;
    s.softcap = v.softcap ? 30.0f : 0.0f;
    s.pad = 5;  // rows start at different offsets too
    auto d = xt::make_dataset<float>(s);
    const auto ref = xt::call(d, v.fused);
    for (int shift = 1; shift < 16; ++shift) {
      // The logits `shift` floats further on, and the gradient too (call() allocates it; a
      // prefix moves it).
      std::vector<float> moved(d.logits.size() + shift, 0.0f);
      std::copy(d.logits.begin(), d.logits.end(), moved.begin() + shift);
      std::vector<float> grad(s.rows * s.ld() + shift, 0.0f);
      xt::call_result<float> r;
      r.row_loss.resize(s.rows);
      r.lse.resize(s.rows);
      r.argmax.resize(s.rows);
      xent::forward_outputs o;
      o.loss = &r.loss;
      o.row_loss = {r.row_loss.data(), s.rows};
      o.lse = {r.lse.data(), s.rows};
      o.argmax = {r.argmax.data(), s.rows};
      o.num_correct = &r.correct;
      const xent::matrix_view<const float> L(moved.data() + shift, s.rows, s.cols, s.ld());
      const xent::matrix_view<float> G(grad.data() + shift, s.rows, s.cols, s.ld());
      d.with_targets([&](auto t) {
        if (v.fused) {
          xent::forward_backward(d.exec(), L, t, d.options(), d.upstream(), o, G);
        } else {
          xent::forward(d.exec(), L, t, d.options(), o);
          xent::backward(d.exec(), L, t, d.options(), {r.lse.data(), s.rows}, d.upstream(), G);
        }
      });
      r.grad.assign(grad.begin() + shift, grad.end());
      for (std::int64_t n = 0; n < s.rows; ++n)
        for (std::int64_t c = s.cols; c < s.ld(); ++c)
          r.grad[n * s.ld() + c] = xt::sentinel<float>();
      const std::string diff = bitwise_diff(ref, r, true);
      if (!diff.empty()) {
        ADD_FAILURE() << (v.fused ? "forward_backward" : "forward + backward") << " eps=" << v.eps
                      << " weights=" << v.weights << " softcap=" << v.softcap
                      << ", logits and gradient moved by " << shift << " floats: " << diff;
        break;
      }
    }
  }
}

TEST(CpuDeterminism, ThreadCountDoesNotChangePerRowResults) {
  // Rows >= threads: each row is computed whole by one thread, so per-row results are bitwise
  // equal for any thread count; only the reduced loss sums per-thread partials in another order.
  for (target_kind kind : {target_kind::int64, target_kind::soft}) {
    for (bool fused : {true, false}) {
      spec s = base(733, 200, 80);
      s.kind = kind;
      s.weights = true;
      s.z_loss = 1e-3f;
      s.ignore = ignore_mode::some;
      auto d1 = xt::make_dataset<float>(s);
      xt::call_result<float> many;  // the same output addresses for every call
      xt::call_into(d1, fused, many);
      const auto one = many;
      for (int threads : {2, 4, 7, 16}) {
        d1.s.threads = threads;  // the same logits buffer too
        xt::call_into(d1, fused, many);
        EXPECT_EQ(bitwise_diff(one, many, false), "") << "threads " << threads;
        EXPECT_NEAR(one.loss, many.loss, 2 * std::ldexp(std::fabs(one.loss), -24))
            << "threads " << threads;
      }
    }
  }
}

TEST(CpuDeterminism, VocabularySplitAgreesWithOneThreadWithinRounding) {
  // Rows < threads: each row's vocabulary is cut into slices merged through online_lse, which
  // rounds differently; results agree to float rounding.
  for (bool fused : {true, false}) {
    spec s = base(3, 65537, 90);
    s.label_smoothing = 0.1f;
    s.weights = true;
    auto d1 = xt::make_dataset<float>(s);
    auto dn = d1;
    dn.s.threads = 7;
    auto a = xt::call(d1, fused), b = xt::call(dn, fused);
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(a.loss));
    EXPECT_EQ(a.argmax, b.argmax);
    for (std::int64_t n = 0; n < s.rows; ++n) {
      EXPECT_NEAR(a.lse[n], b.lse[n], 1e-5 * std::fabs(a.lse[n]));
      double rowmax = 0;
      for (std::int64_t c = 0; c < s.cols; ++c)
        rowmax = std::max(rowmax, std::fabs(double(a.grad[n * s.ld() + c])));
      for (std::int64_t c = 0; c < s.cols; ++c)
        ASSERT_NEAR(a.grad[n * s.ld() + c], b.grad[n * s.ld() + c], 1e-5 * rowmax);
    }
  }
}

TEST(CpuForwardBackward, LossAndLseBitwiseEqualToForward) {
  // One call for training must report the loss that forward reports for the same inputs (a
  // recomputed forward, e.g. under activation checkpointing, must agree with the fused call).
  struct variant {
    target_kind kind;
    std::int64_t rows, cols;
    int threads;
  };
  for (const variant& v :
       {variant{target_kind::int64, 19, 300, 1}, variant{target_kind::soft, 19, 300, 1},
        variant{target_kind::int64, 733, 129, 4}, variant{target_kind::int64, 3, 32000, 7}}) {
    spec s = base(v.rows, v.cols, 95);
    s.kind = v.kind;
    s.threads = v.threads;
    s.chunk = 64;
    auto d = xt::make_dataset<float>(s);
    auto fused = xt::call(d, true), split = xt::call(d, false);
    EXPECT_TRUE(xt::same_bits(fused.loss, split.loss))
        << s.describe() << ": forward_backward loss " << xt::num(fused.loss) << " vs forward "
        << xt::num(split.loss);
    for (std::int64_t n = 0; n < s.rows; ++n) {
      if (!xt::same_bits(fused.lse[n], split.lse[n]) ||
          !xt::same_bits(fused.row_loss[n], split.row_loss[n])) {
        ADD_FAILURE() << s.describe() << ": row " << n << " forward_backward lse/row_loss "
                      << xt::num(fused.lse[n]) << "/" << xt::num(fused.row_loss[n])
                      << " vs forward " << xt::num(split.lse[n]) << "/"
                      << xt::num(split.row_loss[n]);
        break;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Precision
// ---------------------------------------------------------------------------------------------

TEST(CpuPrecision, MeanOverManyIdenticalRowsDoesNotDrift) {
  const std::int64_t rows = 100000, cols = 8;
  for (int threads : {1, 4}) {
    spec s = base(rows, cols, 100);
    s.threads = threads;
    auto d = xt::make_dataset<float>(s);
    for (std::int64_t n = 1; n < rows; ++n) {
      for (std::int64_t c = 0; c < cols; ++c) d.x(n, c) = d.x(0, c);
      d.set_target(n, d.target(0));
    }
    float mean = 0, row0 = 0;
    xent::forward_outputs o;
    o.loss = &mean;
    std::vector<float> row_loss(rows);
    o.row_loss = {row_loss.data(), rows};
    d.with_targets([&](auto t) { xent::forward(d.exec(), d.view(), t, d.options(), o); });
    row0 = row_loss[0];
    EXPECT_NEAR(mean, row0, 1e-6 * row0) << "threads " << threads;
    for (std::int64_t n = 0; n < rows; ++n) ASSERT_TRUE(xt::same_bits(row_loss[n], row0));
    float sum = 0;
    o.loss = &sum;
    auto ds = d;
    ds.s.reduce = reduction::sum;
    ds.with_targets([&](auto t) { xent::forward(ds.exec(), ds.view(), t, ds.options(), o); });
    EXPECT_NEAR(sum, double(row0) * rows, 1e-6 * double(row0) * rows);
  }
}

TEST(CpuPrecision, Bfloat16TargetGradientNearOneIsRoundedOnceFromFloat) {
  // Row logits [20, 0, 0, ...], target 0: p_0 is within 1e-4 of 1, so p_0 - 1 formed in bf16
  // would be 0 or a multiple of 2^-8. xent forms it in float and rounds once: the bf16 gradient
  // must be the bf16 rounding of the float gradient, and that float value must be within float
  // error of the oracle (|d(z_y - lse)| <= 2^-24 |lse| ~ 1e-6, a ~2% bound here, not 100%).
  for (std::int64_t cols : {32000, 4096}) {
    for (reduction red : {reduction::sum, reduction::mean}) {
      spec s = base(2, cols, 110);
      s.reduce = red;
      s.scale = 1.0f;
      auto d = xt::make_dataset<bf16>(s);
      for (std::int64_t n = 0; n < 2; ++n) {
        for (std::int64_t c = 0; c < cols; ++c) d.x(n, c) = bf16(0.0f);
        d.x(n, 0) = bf16(20.0f);
        d.set_target(n, 0);
      }
      const oracle::upstream up = d.oracle_upstream();
      const oracle::result o = oracle::evaluate(d.problem(), &up);
      auto g16 = xt::call<bf16, bf16>(d, false);
      auto g32 = xt::call<bf16, float>(d, false);
      for (std::int64_t n = 0; n < 2; ++n) {
        const double ref = o.grad[n * cols];
        const float f = g32.grad[n * cols];
        EXPECT_TRUE(xt::same_bits(g16.grad[n * cols], bf16(f)))
            << "bf16 " << xt::to_double(g16.grad[n * cols]) << " vs bf16(float) "
            << xt::to_double(bf16(f));
        const double g = red == reduction::mean ? 0.5 : 1.0;
        EXPECT_NEAR(f, ref, 2.0 * std::ldexp(20.0, -24) * g) << "float target gradient";
        EXPECT_NEAR(xt::to_double(g16.grad[n * cols]), ref,
                    std::ldexp(std::fabs(ref), -8) + 2.0 * std::ldexp(20.0, -24) * g)
            << "bf16 target gradient vs oracle " << ref;
        EXPECT_LT(xt::to_double(g16.grad[n * cols]), 0.0);
      }
      EXPECT_TRUE(xt::run_case<bf16>(d));
      EXPECT_TRUE((xt::run_case<bf16, float>(d)));
    }
  }
}

TEST(CpuPrecision, TargetGradientBelowFloatResolutionOfOneErrsByAtMostAnUlpOfOne) {
  // With few classes, 1 - p_y (here 7 e^-20 ~ 1.4e-8) is below the float spacing of 1 (6e-8):
  // xent's float p_y - 1 is then 0 or one ulp of 1 — an absolute error of at most 2^-24 * g,
  // which is the most a float computation of p_y - 1 from lse promises.
  spec s = base(1, 8, 120);
  s.reduce = reduction::sum;
  s.scale = 1.0f;
  auto d = xt::make_dataset<float>(s);
  for (std::int64_t c = 0; c < 8; ++c) d.x(0, c) = 0.0f;
  d.x(0, 0) = 20.0f;
  d.set_target(0, 0);
  const oracle::upstream up = d.oracle_upstream();
  const oracle::result o = oracle::evaluate(d.problem(), &up);
  auto r = xt::call(d, false);
  EXPECT_NEAR(r.grad[0], o.grad[0], std::ldexp(1.0, -24));
}

TEST(CpuPrecision, LargeLogitsDoNotOverflow) {
  for (float scale : {1e3f, 3e4f}) {
    spec s = base(4, 300, 130);
    s.sigma = scale;
    s.z_loss = 1e-4f;
    auto d = xt::make_dataset<float>(s);
    EXPECT_TRUE(xt::run_case<float>(d)) << "sigma " << scale;
    auto h = xt::make_dataset<half>(s);  // up to fp16's largest finite 65504, some become inf
    for (auto& x : h.logits)
      if (std::isinf(static_cast<float>(x)))
        x = half(std::copysign(65504.0f, static_cast<float>(x)));
    EXPECT_TRUE(xt::run_case<half>(h)) << "sigma " << scale;
  }
}

}  // namespace
