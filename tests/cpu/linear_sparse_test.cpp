// The sparse backward of fused linear cross-entropy on the CPU (linear_options::sparse_threshold):
// threshold 0 is the exact path bit for bit; a threshold leaves every forward output as it was
// and moves each gradient by at most what the skipped tiles' probability terms can (the bound of
// linear/options.hpp), judged against the float64 linear oracle on inputs shaped so that tiles
// are skipped (forward_backward, whose statistics pass marks the cold tiles, and linear_backward,
// which marks them from the panel's logits); the tile counts it reports match the tiles the oracle
// finds cold; bad thresholds and the calls without a sparse backward throw xent::error naming the
// option.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "linear_harness.hpp"
#include "linear_host_backend.hpp"
#include "linear_sparse_harness.hpp"
#include "oracle/linear_oracle.hpp"
#include "xent/cpu/linear.hpp"
#include "xent/cpu/vocab_parallel_linear.hpp"
#include "xent/parallel/vocab_parallel_linear.hpp"

namespace {

using namespace xtl;  // NOLINT(google-build-using-namespace): the shared linear test vocabulary

const cpu_memory host{};

/// every_option's cases at N = 150 (two whole row tiles and a part), D = 61, V = 600 (two whole
/// weight blocks and a part), except softcap with label smoothing (refused with a threshold).
std::vector<lspec> sparse_cases() {
  std::vector<lspec> out;
  for (lspec s : every_option(150, 61, 600)) {
    if (s.ce.softcap > 0 && s.ce.label_smoothing > 0) continue;
    s.ce.sigma = 1.0;
    out.push_back(s);
  }
  return out;
}

TEST(CpuLinearSparse, GradientsStayWithinTheSkippedProbabilitiesBoundWithEveryOption) {
  xt::case_budget b;
  for (const lspec& s : sparse_cases())
    if (!b.record(run_sparse_case<float>(host, s))) return;
  EXPECT_EQ(b.cases(), 216);
}

TEST(CpuLinearSparse, OtherDtypesStayWithinTheBound) {
  // bf16 / fp16 inputs and gradients (the sums in float, each output rounded once), float inputs
  // with bf16 gradients, and float64 (every sum in double): every eighth case.
  xt::case_budget b;
  int i = 0;
  for (const lspec& s : sparse_cases()) {
    if (i++ % 8 != 0) continue;
    if (!b.record(run_sparse_case<bf16>(host, s) && run_sparse_case<half>(host, s) &&
                  run_sparse_case<float, bf16>(host, s) && run_sparse_case<double>(host, s)))
      return;
  }
  EXPECT_EQ(b.cases(), 27);
}

/// Every result of a training call: outputs and gradients, as bytes.
template <class T>
std::vector<unsigned char> training_bits(const lspec& s, const xent::linear_options& opts,
                                         std::size_t bytes) {
  ldata<T> L = make_data<T>(s);
  shape_like_trained(L);
  basic_outputs<float> out(L.N());
  gradients<T> g(s);
  workspace_buffer ws(bytes, 0);
  L.d.with_targets([&](auto t) {
    xent::linear_forward_backward(xent::cpu(s.ce.threads), L.hidden(), L.weight(), L.bias(), t,
                                  opts, L.d.upstream(), out.all(s.ce), g.views(), ws.ws);
  });
  std::vector<unsigned char> bits;
  auto add = [&](const auto& v) {
    const auto* p = reinterpret_cast<const unsigned char*>(v.data());
    bits.insert(bits.end(), p, p + v.size() * sizeof(v[0]));
  };
  add(out.row_loss);
  add(out.lse);
  add(g.dx);
  add(g.dw);
  add(g.db);
  return bits;
}

TEST(CpuLinearSparse, ZeroThresholdIsTheExactPathBitForBit) {
  // Threshold 0 changes nothing, not even the order automatic takes; a threshold takes the
  // low-memory order under automatic whatever the workspace.
  const auto training = xent::linear_pass::training;
  for (const lspec& base : sparse_cases()) {
    if (base.ce.seed % 9 != 0) continue;
    lspec s = base;
    s.space = budget::all_rows;
    const xent::cpu exec(s.ce.threads);
    const ldata<float> L = make_data<float>(s);
    const xent::linear_shape shape{L.N(), L.D(), L.V()};
    xent::linear_options automatic = L.options(), low_memory = automatic, fast = automatic;
    automatic.order = xent::linear_order::automatic;
    low_memory.order = xent::linear_order::low_memory;
    fast.order = xent::linear_order::fast;
    const std::size_t fast_bytes =
        xent::linear_workspace_size<float>(exec, shape, training, fast).bytes;
    const std::size_t low_bytes =
        xent::linear_workspace_size<float>(exec, shape, training, low_memory).bytes;

    xent::linear_sparse_counts counts{-1, -1};
    xent::linear_options zero_low = low_memory;
    automatic.sparse_counts = zero_low.sparse_counts = &counts;
    EXPECT_EQ(training_bits<float>(s, automatic, fast_bytes),
              training_bits<float>(s, fast, fast_bytes))
        << s.describe();
    EXPECT_EQ(training_bits<float>(s, zero_low, low_bytes),
              training_bits<float>(s, low_memory, low_bytes))
        << s.describe();
    EXPECT_EQ(counts.tiles, -1) << "threshold 0 counted tiles";

    // With a threshold, automatic in a workspace the fast order would take runs low_memory.
    automatic.sparse_threshold = low_memory.sparse_threshold = sparse_tau;
    const std::size_t both = std::max(
        fast_bytes, xent::linear_workspace_size<float>(exec, shape, training, low_memory).minimal);
    const auto sparse_bits = training_bits<float>(s, automatic, both);
    EXPECT_EQ(sparse_bits, training_bits<float>(s, low_memory, both)) << s.describe();
    EXPECT_NE(sparse_bits, training_bits<float>(s, fast, both)) << s.describe();
    EXPECT_GT(counts.skipped, 0);
  }
}

TEST(CpuLinearSparse, BadThresholdsThrowNamingTheOptionBeforeWriting) {
  lspec s = make_spec(8, 6, 10);
  s.order = xent::linear_order::low_memory;
  const ldata<float> L = make_data<float>(s);
  const xent::cpu exec(1);
  const std::size_t bytes = workspace_bytes<float>(exec, L, xent::linear_pass::training);
  auto expect_refused = [&](xent::linear_options opts, const std::string& fragment) {
    outputs f(L.N());
    gradients<float> g(s);
    workspace_buffer ws(bytes, 0);
    L.d.with_targets([&](auto t) {
      expect_error("options.sparse_threshold", fragment, [&] {
        xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, opts,
                                      L.d.upstream(), f.all(s.ce), g.views(), ws.ws);
      });
      expect_error("options.sparse_threshold", fragment, [&] {
        xent::linear_backward(exec, L.hidden(), L.weight(), L.bias(), t, opts, f.lse_view(),
                              L.d.upstream(), g.views(), ws.ws);
      });
    });
    expect_error("options.sparse_threshold", fragment, [&] {
      xent::linear_workspace_size<float>(exec, {8, 6, 10}, xent::linear_pass::training, opts);
    });
    EXPECT_TRUE(ws.untouched());
    EXPECT_EQ(f.loss, 12345.0f);
    EXPECT_TRUE(xt::same_bits(g.dw[0], xt::sentinel<float>()));
  };
  for (float bad : {-1e-3f, -1.0f, 1.5f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    xent::linear_options opts = L.options();
    opts.sparse_threshold = bad;
    expect_refused(opts, "must be in [0, 1]");
  }
  xent::linear_options capped = L.options();
  capped.sparse_threshold = sparse_tau;
  capped.softcap = 5.0f;
  capped.label_smoothing = 0.1f;
  expect_refused(capped, "softcap and label_smoothing");
  xent::linear_options fast = L.options();
  fast.sparse_threshold = sparse_tau;
  fast.order = xent::linear_order::fast;
  expect_refused(fast, "low-memory order only");

  // The vocab-parallel calls have no sparse backward yet.
  xent::linear_options vp;
  vp.sparse_threshold = sparse_tau;
  expect_error("options.sparse_threshold", "vocab-parallel", [&] {
    xent::vocab_parallel_linear_workspace_size<float>(exec, {8, 6, 5}, 10, 2,
                                                      xent::linear_pass::training, vp);
  });
}

}  // namespace
