// Bad arguments: each throws xent::error before anything is written, and error::argument() names
// the argument at fault. Every test starts from a valid call (4 x 6 float logits) with poisoned
// outputs, breaks one thing, and checks all three entry points where the argument applies.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "harness.hpp"

namespace {

constexpr std::int64_t kRows = 4, kCols = 6;
constexpr float kPoison = 12345.0f;

/// A valid problem and poisoned outputs. Members are public so each test can break one.
struct setup {
  std::vector<float> logits, probs, weights, row_loss, lse, grad, up_rows;
  std::vector<std::int64_t> t64, argmax;
  std::vector<std::int32_t> t32;
  float loss = kPoison, scale_value = 1.0f;
  std::int64_t correct = -777;

  xent::matrix_view<const float> L;
  xent::vector_view<const std::int64_t> T;
  xent::options opts;
  xent::forward_outputs out;
  xent::upstream up;
  xent::matrix_view<float> G;
  xent::vector_view<const float> lse_in;

  setup()
      : logits(kRows * kCols),
        probs(kRows * kCols, 1.0f / kCols),
        weights(kCols, 1.0f),
        row_loss(kRows, kPoison),
        lse(kRows, kPoison),
        grad(kRows * kCols + 8, kPoison),
        up_rows(kRows, 1.0f),
        t64{0, 5, 2, -100},
        argmax(kRows, -777),
        t32{0, 5, 2, -100} {
    for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(1.0f + i);
    L = {logits.data(), kRows, kCols};
    T = {t64.data(), kRows};
    out.loss = &loss;
    out.row_loss = {row_loss.data(), kRows};
    out.lse = {lse.data(), kRows};
    out.argmax = {argmax.data(), kRows};
    out.num_correct = &correct;
    G = {grad.data(), kRows, kCols};
    lse_saved.assign(kRows, 1.5f);
    lse_in = {lse_saved.data(), kRows};
    original = logits;
  }

  void forward() { xent::forward(xent::cpu{}, L, T, opts, out); }
  void backward() { xent::backward(xent::cpu{}, L, T, opts, lse_in, up, G); }
  void forward_backward() { xent::forward_backward(xent::cpu{}, L, T, opts, up, out, G); }

  /// Nothing was written: outputs keep their poison, the gradient its, the logits their values.
  std::string untouched() const {
    for (float v : row_loss)
      if (!xt::same_bits(v, kPoison)) return "row_loss written";
    for (float v : lse)
      if (!xt::same_bits(v, kPoison)) return "lse written";
    for (std::int64_t v : argmax)
      if (v != -777) return "argmax written";
    if (!xt::same_bits(loss, kPoison)) return "loss written";
    if (correct != -777) return "num_correct written";
    for (float v : grad)
      if (!xt::same_bits(v, kPoison)) return "grad written";
    if (std::memcmp(logits.data(), original.data(), logits.size() * sizeof(float)) != 0)
      return "logits written";
    return "";
  }

  std::vector<float> lse_saved, original;
};

enum entry : unsigned { kForward = 1, kBackward = 2, kFused = 4, kAll = 7 };

/// Runs `prepare` on a fresh setup, then each entry point in `which`; each must throw xent::error
/// naming `argument` (and, when given, with `message` in what()) and write nothing.
void expect_rejected(unsigned which, const std::string& argument,
                     const std::function<void(setup&)>& prepare, const std::string& message = "") {
  const char* names[] = {"forward", "backward", "forward_backward"};
  for (unsigned e = 0; e < 3; ++e) {
    if (!(which & (1u << e))) continue;
    setup s;
    prepare(s);
    try {
      if (e == 0) s.forward();
      if (e == 1) s.backward();
      if (e == 2) s.forward_backward();
      ADD_FAILURE() << names[e] << ": no xent::error for a bad '" << argument << "'";
    } catch (const xent::error& err) {
      EXPECT_EQ(err.argument(), argument) << names[e] << ": " << err.what();
      if (!message.empty()) {
        EXPECT_NE(std::string(err.what()).find(message), std::string::npos)
            << names[e] << ": '" << err.what() << "' does not contain '" << message << "'";
      }
      EXPECT_NE(std::string(err.what()).find(std::string("xent::") + names[e]), std::string::npos)
          << err.what();
    } catch (const std::exception& other) {
      ADD_FAILURE() << names[e] << ": threw something other than xent::error: " << other.what();
    }
    EXPECT_EQ(s.untouched(), "") << names[e];
  }
}

TEST(CpuValidation, ValidBaselineIsAccepted) {
  // The starting point of every test below works, so each failure is the one thing broken.
  setup s;
  s.forward();
  EXPECT_TRUE(std::isfinite(s.loss));
  setup b;
  b.backward();
  setup f;
  f.forward_backward();
  EXPECT_EQ(f.grad[kRows * kCols], kPoison) << "wrote past the gradient";
}

TEST(CpuValidation, TargetOutOfRangeNamesRowAndValue) {
  expect_rejected(
      kAll, "targets", [](setup& s) { s.t64[2] = kCols; }, "row 2 has target 6");
  expect_rejected(
      kAll, "targets", [](setup& s) { s.t64[1] = 1000000000000; },
      "row 1 has target 1000000000000");
}

TEST(CpuValidation, Int32TargetOutOfRangeNamesRowAndValue) {
  setup s;
  s.t32[3] = 7;
  try {
    xent::forward(xent::cpu{}, s.L, xent::vector_view<const std::int32_t>(s.t32.data(), kRows),
                  s.opts, s.out);
    ADD_FAILURE() << "no error";
  } catch (const xent::error& e) {
    EXPECT_EQ(e.argument(), "targets");
    EXPECT_NE(std::string(e.what()).find("row 3 has target 7"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.untouched(), "");
}

TEST(CpuValidation, NegativeTargetThatIsNotIgnoreIndex) {
  expect_rejected(
      kAll, "targets", [](setup& s) { s.t64[0] = -1; }, "row 0 has target -1");
  // -100 is fine by default, but not once ignore_index is something else.
  expect_rejected(
      kAll, "targets", [](setup& s) { s.opts.ignore_index = -1; }, "row 3");
}

TEST(CpuValidation, OutOfRangeTargetAfterManyValidRowsWritesNothing) {
  // The check runs over every row before any row is computed, also on many threads.
  const std::int64_t rows = 2000, cols = 64;
  std::vector<float> logits(rows * cols, 0.5f), row_loss(rows, kPoison);
  std::vector<std::int64_t> t(rows, 1);
  t[rows - 1] = cols;
  xent::options opts;
  opts.reduce = xent::reduction::none;
  xent::forward_outputs out;
  out.row_loss = {row_loss.data(), rows};
  EXPECT_THROW(
      xent::forward(xent::cpu(4), xent::matrix_view<const float>(logits.data(), rows, cols),
                    xent::vector_view<const std::int64_t>(t.data(), rows), opts, out),
      xent::error);
  for (float v : row_loss) ASSERT_EQ(v, kPoison);
}

TEST(CpuValidation, LeadingDimensionSmallerThanCols) {
  expect_rejected(
      kAll, "logits", [](setup& s) { s.L.ld = kCols - 1; }, "leading dimension");
  expect_rejected(
      kBackward | kFused, "grad", [](setup& s) { s.G.ld = kCols - 1; }, "leading dimension");
}

TEST(CpuValidation, NegativeRowsOrCols) {
  expect_rejected(
      kAll, "logits", [](setup& s) { s.L.rows = -1; }, "negative size");
  expect_rejected(
      kAll, "logits", [](setup& s) { s.L.cols = -3; }, "negative size");
}

TEST(CpuValidation, NullDataWithNonZeroSize) {
  expect_rejected(
      kAll, "logits", [](setup& s) { s.L.data = nullptr; }, "null data");
  expect_rejected(
      kAll, "targets", [](setup& s) { s.T.data = nullptr; }, "null data");
  expect_rejected(
      kBackward | kFused, "grad", [](setup& s) { s.G.data = nullptr; }, "null data");
  expect_rejected(
      kBackward, "lse", [](setup& s) { s.lse_in.data = nullptr; }, "null data");
  // Optional outputs and the per-row upstream: null data with a size is a mistake, not an
  // output nobody asked for (taken as one, the per-row upstream was dropped without a word).
  expect_rejected(
      kForward | kFused, "outputs.row_loss", [](setup& s) { s.out.row_loss.data = nullptr; },
      "null data");
  expect_rejected(
      kForward | kFused, "outputs.lse", [](setup& s) { s.out.lse.data = nullptr; }, "null data");
  expect_rejected(
      kForward | kFused, "outputs.argmax", [](setup& s) { s.out.argmax.data = nullptr; },
      "null data");
  expect_rejected(
      kBackward | kFused, "upstream.rows",
      [](setup& s) {
        s.opts.reduce = xent::reduction::none;
        s.up.rows = {nullptr, kRows};
      },
      "null data");
}

TEST(CpuValidation, SizesBeyondWhatSizeArithmeticHolds) {
  // 2^32 x 2^32 logits: rows * cols wraps past 2^64 bytes; a null pointer must not pass as "empty".
  expect_rejected(
      kAll, "logits",
      [](setup& s) {
        s.L = {nullptr, std::int64_t{1} << 32, std::int64_t{1} << 32};
      },
      "spans more than 2^59 elements");
  expect_rejected(
      kAll, "logits",
      [](setup& s) {
        s.L = {s.logits.data(), 2, kCols, std::int64_t{1} << 60};
      },
      "spans more than 2^59 elements");
  expect_rejected(
      kAll, "targets",
      [](setup& s) {
        s.T = {s.t64.data(), std::int64_t{1} << 60};
      },
      "more than 2^59");
}

TEST(CpuValidation, TargetsLengthMismatch) {
  expect_rejected(
      kAll, "targets", [](setup& s) { s.T.size = kRows - 1; }, "expected 4");
  expect_rejected(kAll, "targets", [](setup& s) { s.T.size = kRows + 1; });
}

TEST(CpuValidation, ClassWeightsLengthMismatch) {
  expect_rejected(kAll, "options.class_weights", [](setup& s) {
    s.opts.class_weights = {s.weights.data(), kCols - 1};
  });
  expect_rejected(kAll, "options.class_weights", [](setup& s) {
    s.opts.class_weights = {nullptr, kCols};
  });
}

TEST(CpuValidation, RowLossLengthMismatch) {
  expect_rejected(kForward | kFused, "outputs.row_loss",
                  [](setup& s) { s.out.row_loss.size = kRows - 1; });
}

TEST(CpuValidation, LseLengthMismatch) {
  expect_rejected(kForward | kFused, "outputs.lse", [](setup& s) { s.out.lse.size = kRows + 1; });
}

TEST(CpuValidation, ArgmaxLengthMismatch) {
  expect_rejected(kForward | kFused, "outputs.argmax", [](setup& s) { s.out.argmax.size = 1; });
}

TEST(CpuValidation, UpstreamRowsLengthMismatch) {
  expect_rejected(kBackward | kFused, "upstream.rows", [](setup& s) {
    s.opts.reduce = xent::reduction::none;
    s.up.rows = {s.up_rows.data(), kRows - 1};
  });
}

TEST(CpuValidation, UpstreamRowsWithMeanOrSum) {
  for (auto red : {xent::reduction::mean, xent::reduction::sum})
    expect_rejected(kBackward | kFused, "upstream.rows", [red](setup& s) {
      s.opts.reduce = red;
      s.up.rows = {s.up_rows.data(), kRows};
    });
}

TEST(CpuValidation, UpstreamScalePointerWithNone) {
  expect_rejected(kBackward | kFused, "upstream.scale_ptr", [](setup& s) {
    s.opts.reduce = xent::reduction::none;
    s.up.scale_ptr = &s.scale_value;
  });
}

TEST(CpuValidation, LseMissingOrWrongLengthInBackward) {
  expect_rejected(kBackward, "lse", [](setup& s) { s.lse_in = {}; });
  expect_rejected(kBackward, "lse", [](setup& s) { s.lse_in.size = kRows - 1; });
}

TEST(CpuValidation, GradientShapeMismatch) {
  expect_rejected(kBackward | kFused, "grad", [](setup& s) { s.G.rows = kRows - 1; });
  expect_rejected(kBackward | kFused, "grad", [](setup& s) {
    s.G.cols = kCols + 1;
    s.G.ld = kCols + 1;
  });
}

TEST(CpuValidation, GradientPartiallyOverlappingLogits) {
  // grad one element past the logits: overlaps them without being them.
  auto shifted = [](std::int64_t by) {
    return [by](setup& s) {
      s.logits.resize(kRows * kCols + 8, 0.0f);
      s.original = s.logits;
      s.L.data = s.logits.data();
      s.G = {s.logits.data() + by, kRows, kCols};
    };
  };
  expect_rejected(kBackward | kFused, "grad", shifted(1), "overlaps");
  expect_rejected(kBackward | kFused, "grad", shifted(kCols), "overlaps");  // one row off
  // Same start, different leading dimension.
  expect_rejected(kBackward | kFused, "grad", [](setup& s) {
    s.logits.resize(kRows * (kCols + 2), 0.0f);
    s.original = s.logits;
    s.L = {s.logits.data(), kRows, kCols, kCols + 2};
    s.G = {s.logits.data(), kRows, kCols, kCols};
  });
}

TEST(CpuValidation, WhatACallReadsOverlappingWhatItWrites) {
  // The backends read class ids, weights, a saved LSE and upstream gradients again after they
  // have started writing: class ids inside the gradient would be read back as gradient bits and
  // index anywhere. Every such overlap is refused up front, naming the written argument.
  expect_rejected(
      kBackward | kFused, "grad",
      [](setup& s) {
        s.T = {reinterpret_cast<const std::int64_t*>(s.grad.data() + 8), kRows};
      },
      "overlaps targets");
  expect_rejected(
      kBackward | kFused, "grad",
      [](setup& s) {
        s.opts.class_weights = {s.grad.data(), kCols};
      },
      "overlaps options.class_weights");
  expect_rejected(
      kBackward, "grad",
      [](setup& s) {
        s.lse_in = {s.grad.data() + kCols, kRows};
      },
      "overlaps lse");
  expect_rejected(
      kBackward | kFused, "grad",
      [](setup& s) {
        s.opts.reduce = xent::reduction::none;
        s.up.rows = {s.grad.data() + 1, kRows};
      },
      "overlaps upstream.rows");
  expect_rejected(
      kBackward | kFused, "grad", [](setup& s) { s.up.scale_ptr = s.grad.data() + 2; },
      "overlaps upstream.scale_ptr");
  // Outputs: over the logits (read), over the gradient or over each other (written).
  expect_rejected(
      kForward | kFused, "outputs.lse",
      [](setup& s) {
        s.out.lse = {s.logits.data() + kCols, kRows};
      },
      "overlaps logits");
  expect_rejected(
      kFused, "grad", [](setup& s) { s.out.loss = s.grad.data() + 3; }, "overlaps outputs.loss");
  expect_rejected(
      kForward | kFused, "outputs.row_loss",
      [](setup& s) {
        s.out.row_loss = {s.lse.data(), kRows};
      },
      "overlaps outputs.lse");
  expect_rejected(
      kForward | kFused, "outputs.loss",
      [](setup& s) { s.out.num_correct = reinterpret_cast<std::int64_t*>(&s.loss); },
      "overlaps outputs.num_correct");
}

TEST(CpuValidation, InPlaceGradientWithEveryOutputIsAccepted) {
  // The one overlap allowed: the gradient written over the logits themselves.
  setup s;
  s.G = {s.logits.data(), kRows, kCols};
  s.forward_backward();
  EXPECT_TRUE(std::isfinite(s.loss));
  setup b;
  b.G = {b.logits.data(), kRows, kCols};
  b.backward();
}

TEST(CpuValidation, GradientOverLogitsOfAnotherDtype) {
  // bf16 logits with a float gradient at the same address: not "in place", an overlap.
  std::vector<xt::bf16> logits(kRows * kCols * 2, xt::bf16(0.5f));
  std::vector<std::int64_t> t{0, 1, 2, 3};
  float loss = kPoison;
  xent::forward_outputs out;
  out.loss = &loss;
  const xent::matrix_view<xt::bf16> L(logits.data(), kRows, kCols);
  const xent::matrix_view<float> G_same_shape(reinterpret_cast<float*>(logits.data()), kRows,
                                              kCols);
  try {
    xent::forward_backward(xent::cpu{}, L, xent::vector_view<const std::int64_t>(t.data(), kRows),
                           xent::options{}, xent::upstream{}, out, G_same_shape);
    ADD_FAILURE() << "no error";
  } catch (const xent::error& e) {
    EXPECT_EQ(e.argument(), "grad") << e.what();
  }
  EXPECT_EQ(loss, kPoison);
  for (auto v : logits) ASSERT_EQ(static_cast<float>(v), 0.5f);
}

TEST(CpuValidation, LabelSmoothingOutsideZeroOne) {
  for (float eps : {-0.01f, 1.01f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()})
    expect_rejected(kAll, "options.label_smoothing",
                    [eps](setup& s) { s.opts.label_smoothing = eps; });
}

TEST(CpuValidation, SoftcapNegativeNaNOrInfinite) {
  for (float cap : {-1.0f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(), 1e-40f})  // 1 / 1e-40f is inf
    expect_rejected(kAll, "options.softcap", [cap](setup& s) { s.opts.softcap = cap; });
}

TEST(CpuValidation, ZLossNegativeNaNOrInfinite) {
  for (float z :
       {-1e-3f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()})
    expect_rejected(kAll, "options.z_loss", [z](setup& s) { s.opts.z_loss = z; });
}

TEST(CpuValidation, UnknownReduction) {
  expect_rejected(kAll, "options.reduce",
                  [](setup& s) { s.opts.reduce = static_cast<xent::reduction>(7); });
}

TEST(CpuValidation, ReductionNoneWithoutRowLoss) {
  expect_rejected(kForward, "outputs.row_loss", [](setup& s) {
    s.opts.reduce = xent::reduction::none;
    s.out.row_loss = {};
  });
}

TEST(CpuValidation, MeanOrSumWithoutLoss) {
  for (auto red : {xent::reduction::mean, xent::reduction::sum})
    expect_rejected(kForward, "outputs.loss", [red](setup& s) {
      s.opts.reduce = red;
      s.out.loss = nullptr;
    });
}

TEST(CpuValidation, SoftTargetShapeMismatch) {
  auto soft_call = [](setup& s, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    const xent::soft_targets<float> P{{s.probs.data(), rows, cols, ld}};
    return [&s, P](int e) {
      s.out.num_correct = nullptr;
      if (e == 0) xent::forward(xent::cpu{}, s.L, P, s.opts, s.out);
      if (e == 1) xent::backward(xent::cpu{}, s.L, P, s.opts, s.lse_in, s.up, s.G);
      if (e == 2) xent::forward_backward(xent::cpu{}, s.L, P, s.opts, s.up, s.out, s.G);
    };
  };
  struct bad {
    std::int64_t rows, cols, ld;
    const char* message;
  };
  for (const bad& b : {bad{kRows - 1, kCols, kCols, "soft targets are 3 x 6"},
                       bad{kRows, kCols - 1, kCols, "soft targets are 4 x 5"},
                       bad{kRows, kCols, kCols - 1, "leading dimension"}}) {
    for (int e = 0; e < 3; ++e) {
      setup s;
      s.correct = -777;
      try {
        soft_call(s, b.rows, b.cols, b.ld)(e);
        ADD_FAILURE() << "no error for " << b.message;
      } catch (const xent::error& err) {
        EXPECT_EQ(err.argument(), "targets") << err.what();
        EXPECT_NE(std::string(err.what()).find(b.message), std::string::npos) << err.what();
      }
      EXPECT_EQ(s.untouched(), "");
    }
  }
}

TEST(CpuValidation, NumCorrectWithSoftTargets) {
  setup s;
  const xent::soft_targets<float> P{{s.probs.data(), kRows, kCols}};
  try {
    xent::forward(xent::cpu{}, s.L, P, s.opts, s.out);
    ADD_FAILURE() << "no error";
  } catch (const xent::error& e) {
    EXPECT_EQ(e.argument(), "outputs.num_correct") << e.what();
  }
  EXPECT_EQ(s.untouched(), "");
}

TEST(CpuValidation, ZeroColsWithRows) {
  expect_rejected(
      kAll, "logits",
      [](setup& s) {
        s.L.cols = 0;
        s.L.ld = 0;
        s.G.cols = 0;
        s.G.ld = 0;
        s.probs.clear();
      },
      "at least one class");
}

}  // namespace
