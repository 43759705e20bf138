// The CUDA backend against the float64 oracle (tests/oracle) and against the CPU backend: every
// entry point, dtype and option, edge sizes, misaligned rows, CUDA graph capture, determinism,
// out-of-range targets, and one matrix of more than 2^31 elements. Without a GPU every test skips
// with the reason.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>
#include <xent/xent.hpp>

#include "cuda/device_util.cuh"
#include "oracle/oracle.hpp"

namespace {

using xent_test::dbl;
using xent_test::dbuf;
using xent_test::ok;
using xent_test::sm_count;

struct spec {
  std::int64_t rows = 7, cols = 1000, ld = 0;  // ld 0: cols
  xent::reduction reduce = xent::reduction::mean;
  float smoothing = 0.0f, z_loss = 0.0f, softcap = 0.0f;
  float spike = 0.0f;  ///< nonzero: one logit of each row, in its last columns, set to this
  bool weights = false, soft = false, some_ignored = false, all_ignored = false;
  bool last_ignored = false;  ///< the last row ignored too (a small batch's polling CTA's row)
  bool in_place = true, argmax = true;
  bool edge_targets = false;  ///< class ids at the edges of every cut of a row over 1..16 CTAs
  int edge_cluster = 0;       ///< nonzero: the edges of the cut over this many CTAs alone
  /// Class ids at the edges of the small-batch kernel's cut of rows at their own 16-byte
  /// boundaries (row_start::shifted: each rank lead(n) classes earlier), over this many CTAs.
  int shifted_cluster = 0;
  /// Class ids at the edges of the streaming kernels' tiles of this many elements, cut at each
  /// row's own 16-byte boundaries (tile k > 0 of row n starts at k span - lead(n)).
  std::int64_t shifted_span = 0;
  /// Elements by which the out-of-place gradient starts past a 256-byte boundary (the logits
  /// start on one): nonzero puts its rows' 16-byte boundaries elsewhere than the logits'.
  std::int64_t grad_offset = 0;
  std::int64_t ignore_index = -100;
  std::uint64_t seed = 1;
  std::string name() const {
    return std::to_string(rows) + "x" + std::to_string(cols) + " ld " + std::to_string(ld) +
           " red " + std::to_string(static_cast<int>(reduce)) + " eps " +
           std::to_string(smoothing) + " z " + std::to_string(z_loss) + " cap " +
           std::to_string(softcap) + (weights ? " weights" : "") + (soft ? " soft" : "") +
           (some_ignored ? " some-ign" : "") + (all_ignored ? " all-ign" : "") +
           (last_ignored ? " last-ign" : "") + (in_place ? " in-place" : " out-of-place") +
           (argmax ? " argmax" : "") + (edge_targets ? " edge-targets" : "") +
           (shifted_cluster ? " shifted-edges " + std::to_string(shifted_cluster) : "") +
           (shifted_span ? " shifted-tiles " + std::to_string(shifted_span) : "") +
           (grad_offset ? " grad-offset " + std::to_string(grad_offset) : "") +
           (spike != 0.0f ? " spike " + std::to_string(spike) : "");
  }
};

/// Plain class-id rows (no argmax: the kernels without option paths), every third ignored:
/// `rows` of shape.first classes at leading dimension shape.second (0: packed), reduced by `red`.
spec plain_rows(std::int64_t rows, std::pair<std::int64_t, std::int64_t> shape,
                xent::reduction red) {
  spec s;
  s.rows = rows;
  s.cols = shape.first;
  s.ld = shape.second;
  s.reduce = red;
  s.some_ignored = true;
  s.argmax = false;
  return s;
}

/// Runs forward, backward and forward_backward on the device for one spec and checks each against
/// the oracle evaluated on the same (rounded) inputs.
template <class T>
void check_spec(const spec& s) {
  SCOPED_TRACE(s.name());
  const std::int64_t N = s.rows, V = s.cols, ld = s.ld ? s.ld : s.cols;
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::vector<T> logits(static_cast<std::size_t>(N * ld) + 1, T(7.0f));  // padding stays 7
  oracle::problem pb;
  pb.rows = N;
  pb.cols = V;
  pb.logits.resize(N * V);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < V; ++c) {
      const bool spiked = s.spike != 0.0f && c == V - 1 - n % 7;
      logits[n * ld + c] = T(spiked ? s.spike : static_cast<float>(normal(rng)));
      pb.logits[n * V + c] = dbl(logits[n * ld + c]);
    }
  std::vector<std::int64_t> targets(N);
  std::vector<float> probs;
  pb.soft = s.soft;
  if (s.soft) {
    probs.resize(N * V);
    pb.probs.resize(N * V);
    for (std::int64_t n = 0; n < N; ++n) {
      double sum = 0.0;
      for (std::int64_t c = 0; c < V; ++c) sum += (pb.probs[n * V + c] = std::exp(normal(rng)));
      for (std::int64_t c = 0; c < V; ++c) {
        probs[n * V + c] = static_cast<float>(pb.probs[n * V + c] / sum);
        pb.probs[n * V + c] = probs[n * V + c];
      }
    }
  } else {
    // Edge targets: the first and last class of every slice a row may be cut into (1 to 16 CTAs,
    // slices of whole 16-byte vectors), where a CTA's tile starts, ends or is padded.
    std::vector<std::int64_t> edges{0, V - 1};
    const std::int64_t vec = 16 / static_cast<std::int64_t>(sizeof(T));
    for (std::int64_t c = 2; c <= 16; ++c) {
      if (s.edge_cluster != 0 && c != s.edge_cluster) continue;
      const std::int64_t slice = ((V + c - 1) / c + vec - 1) / vec * vec;
      for (std::int64_t k = 1; k * slice < V; ++k) {
        edges.push_back(k * slice - 1);
        edges.push_back(k * slice);
      }
    }
    // Shifted edges: row n starts lead = (n ld) mod vec elements past a 16-byte boundary (the
    // buffer starts on one), and rank k > 0 of its cut starts at k slice - lead.
    std::vector<std::int64_t> shifted_starts;
    if (s.shifted_cluster != 0) {
      const std::int64_t c = s.shifted_cluster, W = V + vec - 1;
      const std::int64_t slice = ((W + c - 1) / c + vec - 1) / vec * vec;
      for (std::int64_t k = 1; k < c; ++k) shifted_starts.push_back(k * slice);
    }
    for (std::int64_t k = 1; s.shifted_span != 0 && k * s.shifted_span < V + vec; ++k)
      shifted_starts.push_back(k * s.shifted_span);
    std::uniform_int_distribution<std::int64_t> cls(0, V - 1);
    std::size_t next_edge = 0;  // edges go to the rows that are not ignored, each in turn
    for (std::int64_t n = 0; n < N; ++n) {
      const bool ignored =
          s.all_ignored || (s.some_ignored && n % 3 == 1) || (s.last_ignored && n == N - 1);
      if (!shifted_starts.empty()) {  // 0, V - 1, then each rank's first class and the one before
        const std::int64_t lead = n * ld % vec, k = static_cast<std::int64_t>(next_edge++);
        const std::int64_t pick = k % (2 * static_cast<std::int64_t>(shifted_starts.size()) + 2);
        targets[n] = pick == 0   ? 0
                     : pick == 1 ? V - 1
                                 : shifted_starts[(pick - 2) / 2] - lead - (pick % 2);
        targets[n] = std::min(std::max<std::int64_t>(targets[n], 0), V - 1);
      } else if (!s.edge_targets) {
        targets[n] = cls(rng);
      } else if (!ignored) {
        targets[n] = edges[next_edge++ % edges.size()];
      }
      if (ignored) targets[n] = s.ignore_index;
    }
    pb.targets = targets;
  }
  std::vector<float> weights;
  if (s.weights) {
    std::uniform_real_distribution<double> u(0.25, 2.0);
    for (std::int64_t c = 0; c < V; ++c) weights.push_back(static_cast<float>(u(rng)));
    pb.weights.assign(weights.begin(), weights.end());
  }
  pb.reduce = static_cast<oracle::reduction>(static_cast<int>(s.reduce));
  pb.ignore_index = s.ignore_index;
  pb.label_smoothing = s.smoothing;
  pb.z_loss = s.z_loss;
  pb.softcap = s.softcap;
  oracle::upstream up_ref;
  up_ref.scale = 0.75;
  std::vector<float> up_rows;
  if (s.reduce == xent::reduction::none) {
    for (std::int64_t n = 0; n < N; ++n)
      up_rows.push_back(0.5f + 0.25f * static_cast<float>(n % 5));
    up_ref.rows.assign(up_rows.begin(), up_rows.end());
    for (double& r : up_ref.rows) r *= 0.75;
  }
  const oracle::result ref = oracle::evaluate(pb, &up_ref);

  dbuf<T> d_logits(logits);
  dbuf<T> d_grad_buffer(logits.size() + static_cast<std::size_t>(s.grad_offset));
  T* const d_grad = d_grad_buffer.ptr + s.grad_offset;
  const auto download_grad = [&] {
    const std::vector<T> g = d_grad_buffer.download();
    return std::vector<T>(g.begin() + s.grad_offset, g.end());
  };
  dbuf<std::int64_t> d_targets(targets.empty() ? std::vector<std::int64_t>{0} : targets);
  dbuf<float> d_probs(probs.empty() ? std::vector<float>{0} : probs);
  dbuf<float> d_weights(weights.empty() ? std::vector<float>{0} : weights);
  dbuf<float> d_up_rows(up_rows.empty() ? std::vector<float>{0} : up_rows);
  dbuf<float> d_row_loss(N + 1), d_lse(N + 1), d_loss(1);
  dbuf<std::int64_t> d_argmax(N + 1), d_correct(1);
  dbuf<int> d_errors(std::vector<int>{0});
  dbuf<char> d_ws(xent::cuda_workspace_size(N));

  xent::cuda exec;
  exec.workspace = d_ws.ptr;
  exec.workspace_bytes = d_ws.n;
  exec.error_count = d_errors.ptr;
  xent::options opts;
  opts.reduce = s.reduce;
  opts.ignore_index = s.ignore_index;
  opts.label_smoothing = s.smoothing;
  opts.z_loss = s.z_loss;
  opts.softcap = s.softcap;
  if (s.weights) opts.class_weights = {d_weights.ptr, V};
  xent::upstream up;
  up.scale = 0.75f;
  if (s.reduce == xent::reduction::none) up.rows = {d_up_rows.ptr, N};
  xent::forward_outputs out;
  out.loss = d_loss.ptr;
  out.row_loss = {d_row_loss.ptr, N};
  out.lse = {d_lse.ptr, N};
  if (s.argmax) {
    out.argmax = {d_argmax.ptr, N};
    if (!s.soft) out.num_correct = d_correct.ptr;
  }
  const xent::matrix_view<T> L(d_logits.ptr, N, V, ld);
  const xent::matrix_view<T> Gout(s.in_place ? d_logits.ptr : d_grad, N, V, ld);
  const xent::matrix_view<const float> P(d_probs.ptr, N, V);

  auto run = [&](auto&& targets_view) {
    // forward, then backward from its LSE (out of place), then forward_backward.
    xent::forward(exec, L, targets_view, opts, out);
    ok(cudaDeviceSynchronize());
    const auto rl = d_row_loss.download();
    const auto lse = d_lse.download();
    const auto am = d_argmax.download();
    const float loss = d_loss.download()[0];
    const double tol_row = 64 * std::ldexp(1.0, -24);
    for (std::int64_t n = 0; n < N; ++n) {
      EXPECT_NEAR(rl[n], ref.row_loss[n], tol_row * (ref.row_magnitude[n] + 1e-30) + 1e-30)
          << "row " << n;
      EXPECT_NEAR(lse[n], ref.lse[n], 1e-5 * (std::fabs(ref.lse[n]) + 1)) << "row " << n;
      if (s.argmax) {
        const std::int64_t a = am[n];
        if (a != ref.argmax[n]) {  // a tie after rounding may pick another index of equal value
          ASSERT_GE(a, 0);
          EXPECT_EQ(ref.z[n * V + a], ref.z[n * V + ref.argmax[n]]) << "row " << n;
        }
      }
    }
    if (s.reduce != xent::reduction::none) {
      if (std::isnan(ref.loss))
        EXPECT_TRUE(std::isnan(loss));
      else
        EXPECT_NEAR(loss, ref.loss, 1e-5 * std::fabs(ref.loss) + 1e-6);
    }
    if (s.argmax && !s.soft) EXPECT_EQ(d_correct.download()[0], ref.num_correct);

    auto check_grad = [&](const std::vector<T>& g, const char* what) {
      double worst = 0.0;
      for (std::int64_t n = 0; n < N; ++n) {
        for (std::int64_t c = 0; c < V; ++c) {
          const double got = dbl(g[n * ld + c]), want = ref.grad[n * V + c];
          const double tol = xent_test::gradient_tolerance<T>(want, ref.grad_magnitude[n * V + c]);
          if (!(std::fabs(got - want) <= tol)) {
            ADD_FAILURE() << what << ": grad[" << n << "," << c << "] = " << got << ", want "
                          << want << " (tol " << tol << ")";
            return;
          }
          worst = std::max(worst, std::fabs(got - want));
        }
        for (std::int64_t c = V; c < ld; ++c)
          ASSERT_EQ(dbl(g[n * ld + c]), 7.0) << what << ": padding written at row " << n;
      }
    };
    // backward, out of place (also checks that the logits are untouched by it)
    xent::backward(exec, L, targets_view, opts, xent::vector_view<const float>(d_lse.ptr, N), up,
                   xent::matrix_view<T>(d_grad, N, V, ld));
    ok(cudaDeviceSynchronize());
    if (ld > V) {  // padding of the out-of-place gradient is never written; set it for the check
      std::vector<T> g = d_grad_buffer.download();
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t c = V; c < ld; ++c) g[s.grad_offset + n * ld + c] = T(7.0f);
      d_grad_buffer.upload(g);
      xent::backward(exec, L, targets_view, opts, xent::vector_view<const float>(d_lse.ptr, N), up,
                     xent::matrix_view<T>(d_grad, N, V, ld));
      ok(cudaDeviceSynchronize());
    }
    check_grad(download_grad(), "backward");
    // forward_backward
    xent::forward_backward(exec, L, targets_view, opts, up, out, Gout);
    ok(cudaDeviceSynchronize());
    check_grad(s.in_place ? d_logits.download() : download_grad(), "forward_backward");
    // The fused call's loss against the forward's: the same bits where one kernel serves both
    // (short batches); within the LSE's tolerance where a long batch's forward streams whole
    // rows (policy::stream_forward) and the fused pass cuts them over a cluster.
    const float fused_loss = d_loss.download()[0];
    if (std::isnan(loss))
      EXPECT_TRUE(std::isnan(fused_loss));
    else
      EXPECT_NEAR(fused_loss, loss, 1e-5 * (std::fabs(loss) + 1));
  };
  if (s.soft)
    run(xent::soft(P));
  else
    run(xent::vector_view<const std::int64_t>(d_targets.ptr, N));
  EXPECT_EQ(d_errors.download()[0], 0);
}

template <class T>
class CudaBackend : public ::testing::Test {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};
using dtypes = ::testing::Types<float, Eigen::bfloat16, Eigen::half>;
TYPED_TEST_SUITE(CudaBackend, dtypes);

TYPED_TEST(CudaBackend, MatchesFloat64OracleAcrossEdgeVocabularySizes) {
  for (std::int64_t V : {1, 2, 3, 255, 256, 257, 4095, 4096, 4097, 16383, 16385, 32000, 50257})
    for (std::int64_t N : {1, 3, 19}) {
      spec s;
      s.rows = N;
      s.cols = V;
      s.seed = static_cast<std::uint64_t>(V * 31 + N);
      s.argmax = N != 3;  // without argmax, class ids take the kernels without option paths
      check_spec<TypeParam>(s);
    }
}

TYPED_TEST(CudaBackend, MatchesFloat64OracleForEveryOption) {
  std::uint64_t seed = 100;
  for (auto red : {xent::reduction::none, xent::reduction::mean, xent::reduction::sum})
    for (float eps : {0.0f, 0.1f})
      for (bool w : {false, true})
        for (float z : {0.0f, 1e-3f})
          for (float cap : {0.0f, 30.0f})
            for (bool soft : {false, true}) {
              spec s;
              s.rows = 19;
              s.cols = 3001;
              s.reduce = red;
              s.smoothing = eps;
              s.weights = w;
              s.z_loss = z;
              s.softcap = cap;
              s.soft = soft;
              s.some_ignored = !soft;
              s.in_place = (seed % 2) == 0;
              s.argmax = (seed % 3) != 0;
              s.seed = seed++;
              check_spec<TypeParam>(s);
            }
}

TYPED_TEST(CudaBackend, MatchesFloat64OracleWithPaddedAndMisalignedRows) {
  for (std::int64_t ld : {1003, 1008, 1024}) {
    spec s;
    s.rows = 7;
    s.cols = 1000;
    s.ld = ld;
    s.in_place = false;
    s.seed = static_cast<std::uint64_t>(ld);
    check_spec<TypeParam>(s);
    s.in_place = true;
    check_spec<TypeParam>(s);
  }
}

TYPED_TEST(CudaBackend, MatchesFloat64OracleOnLargeRowsAndManyRows) {
  for (auto shape : {std::pair<std::int64_t, std::int64_t>{733, 2048}, {2, 131073}, {3, 262145}}) {
    spec s;
    s.rows = shape.first;
    s.cols = shape.second;
    s.smoothing = 0.1f;
    s.some_ignored = true;
    check_spec<TypeParam>(s);
  }
}

// A forward over at least one row per CTA in flight gives each CTA whole rows: plain class-id
// rows by the streaming forward kernel (policy::stream_forward: tiles straight into registers,
// each thread's sum rescaled when a tile raises its running max), the others by the row kernel's
// chunks, those after a row's first summed relative to its running max (policy::whole_rows,
// policy::running_max). A spike in a row's last chunk lies far above that max: 60 leaves every
// exponential finite (the sum grows to ~2^80), 200 overflows them and the warp takes the max-first
// sweeps.
TYPED_TEST(CudaBackend, MatchesFloat64OracleWhenCtasStreamWholeRows) {
  const int sms = sm_count();
  std::uint64_t seed = 7;
  // One case, some rows ignored. options 0: plain; 1: argmax and smoothing; 2: plain with weights,
  // z-loss and reduction sum; 3: plain with weights and reduction mean (the streaming forward sums
  // the normaliser through its CTAs' shares). ld 0: cols.
  auto run = [&](std::int64_t rows, std::int64_t cols, std::int64_t ld, float spike, int options) {
    spec s;
    s.rows = rows;
    s.cols = cols;
    s.ld = ld;
    s.spike = spike;
    s.argmax = options == 1;
    s.smoothing = options == 1 ? 0.1f : 0.0f;
    s.weights = options >= 2;
    s.z_loss = options == 2 ? 1e-3f : 0.0f;
    s.reduce = options == 2 ? xent::reduction::sum : xent::reduction::mean;
    s.some_ignored = true;
    s.seed = seed++;
    check_spec<TypeParam>(s);
  };
  // A row per CTA: the streaming forward takes batches of at least half its grid (eight
  // 128-thread CTAs per SM; four of 256 threads for the wide rows below), a CTA per row where
  // there are fewer rows than the grid. Four or seven 32 KiB chunks.
  for (float spike : {0.0f, 60.0f, 200.0f})
    for (int options : {0, 1, 2}) run(4 * std::int64_t{sms} + 5, 50000, 0, spike, options);
  // Longer rows in every dtype (140 KiB of bf16): rows over policy::stream_forward_wide_from_kib
  // (128) take the streaming forward's CTAs of twice the threads (as fp32 rows of 50000 above).
  for (float spike : {0.0f, 200.0f}) run(4 * std::int64_t{sms} + 5, 70000, 0, spike, 0);
  // Many short rows (several per CTA, 32 per SM): rows of whole vectors (3000), and rows padded
  // to 16 bytes whose last vector is partial (1001 of ld 1008: the streaming forward's
  // element-masked last tile).
  for (const auto& shape : {std::pair<std::int64_t, std::int64_t>{3000, 3000}, {1001, 1008}})
    for (int options : {0, 2, 3})
      run(32 * std::int64_t{sms} + 7, shape.first, shape.second, options == 0 ? 200.0f : 0.0f,
          options);
}

TEST(CudaBackendSemantics, AllIgnoredGivesNanMeanZeroSumAndZeroGradient) {
  REQUIRE_GPU();
  for (auto red : {xent::reduction::mean, xent::reduction::sum}) {
    spec s;
    s.all_ignored = true;
    s.reduce = red;
    check_spec<float>(s);
  }
}

TEST(CudaBackendSemantics, IgnoreIndexThatIsAValidClass) {
  REQUIRE_GPU();
  spec s;
  s.ignore_index = 0;
  s.cols = 3;
  s.rows = 19;
  check_spec<float>(s);
}

TEST(CudaBackendSemantics, OutOfRangeTargetGivesNanRowZeroGradientAndCountsAnError) {
  REQUIRE_GPU();
  const std::int64_t N = 3, V = 100;
  std::vector<float> x(N * V, 0.5f);
  std::vector<std::int64_t> y{1, 100, -5};
  dbuf<float> dx(x), dloss(N), dl(1);
  dbuf<std::int64_t> dy(y);
  dbuf<int> derr(std::vector<int>{0});
  dbuf<char> ws(xent::cuda_workspace_size(N));
  xent::cuda exec{nullptr, ws.ptr, ws.n, derr.ptr};
  xent::options opts;
  opts.reduce = xent::reduction::sum;
  xent::forward_outputs out;
  out.loss = dl.ptr;
  out.row_loss = {dloss.ptr, N};
  xent::forward_backward(exec, xent::matrix_view<float>(dx.ptr, N, V),
                         xent::vector_view<const std::int64_t>(dy.ptr, N), opts, xent::upstream{},
                         out, xent::matrix_view<float>(dx.ptr, N, V));
  ok(cudaDeviceSynchronize());
  EXPECT_EQ(derr.download()[0], 2);
  const auto rl = dloss.download();
  EXPECT_NEAR(rl[0], std::log(100.0), 1e-5);
  EXPECT_TRUE(std::isnan(rl[1]));
  EXPECT_TRUE(std::isnan(rl[2]));
  const auto g = dx.download();
  for (std::int64_t c = 0; c < V; ++c) {
    EXPECT_EQ(g[V + c], 0.0f);
    EXPECT_EQ(g[2 * V + c], 0.0f);
  }
}

// One workspace for calls of different batch sizes in turn, as a training loop with a last short
// batch has them: the reduced loss and num_correct of each are its own, whichever kernel takes it
// (the small-batch kernel's polled records and the other kernels' per-row entries and counter
// must not see each other's leftovers). Rows of 100 classes (short rows' kernels), of 8192 and
// 16384 (32 and 64 KiB: for 700 and 4000 rows the row kernel, which takes most of them from its
// queue, by one CTA a row and by clusters of two; for 32 the small-batch kernel), some rows
// ignored, each reduction by forward and fused calls in turn, twice over; the header's counters
// back at 0 after each call, and the mean's gradient checked.
TEST(CudaBackendSemantics, OneWorkspaceServesBatchesOfEverySizeInTurn) {
  REQUIRE_GPU();
  const std::int64_t most = 4000, ignore = -100;
  for (const std::int64_t V : {std::int64_t{100}, std::int64_t{8192}, std::int64_t{16384}}) {
    std::vector<float> x(most * V);
    std::vector<std::int64_t> y(most);
    for (std::int64_t r = 0; r < most; ++r) {
      y[r] = r % 5 == 3 ? ignore : (r * 7) % V;
      for (std::int64_t c = 0; c < V; ++c) x[r * V + c] = 3.0f * std::sin(0.37f * r + 0.11f * c);
    }
    dbuf<float> dx(x), dg(most * V), dl(1);
    dbuf<std::int64_t> dy(y), dhits(1);
    dbuf<char> ws(xent::cuda_workspace_size(most));
    const xent::cuda exec{nullptr, ws.ptr, ws.n, nullptr};
    xent::options opts;
    opts.ignore_index = ignore;
    xent::forward_outputs out;
    out.loss = dl.ptr;
    // 4000 rows: more than the small-batch kernel takes; 32 and 700 of 100 classes: it takes
    // them; 32 of 8192.
    for (std::int64_t rows : {most, std::int64_t{32}, std::int64_t{700}, std::int64_t{32}, most}) {
      // The float64 oracle of the first `rows` rows: the mean's loss, W and gradient; the sum.
      oracle::problem pb;
      pb.rows = rows;
      pb.cols = V;
      pb.logits.assign(x.begin(), x.begin() + rows * V);
      pb.targets.assign(y.begin(), y.begin() + rows);
      pb.ignore_index = ignore;
      const oracle::upstream unit;
      const oracle::result ref = oracle::evaluate(pb, &unit);
      double sum = 0.0;
      for (const double l : ref.row_loss) sum += l;  // ignored rows: 0
      const double kept = ref.normalizer;
      const std::int64_t hits = ref.num_correct;
      // num_correct asked for (an argmax per row: not the plain rows' kernels) or not.
      for (const auto& [reduce, count] :
           {std::pair{xent::reduction::sum, false}, std::pair{xent::reduction::mean, false},
            std::pair{xent::reduction::mean, true}}) {
        opts.reduce = reduce;
        out.num_correct = count ? dhits.ptr : nullptr;
        const double want = reduce == xent::reduction::mean ? ref.loss : sum;
        const xent::matrix_view<const float> L(dx.ptr, rows, V);
        const xent::vector_view<const std::int64_t> Y(dy.ptr, rows);
        for (int call = 0; call < 4; ++call) {  // forward, fused, forward, fused
          if (call % 2 == 0)
            xent::forward(exec, L, Y, opts, out);
          else
            xent::forward_backward(exec, L, Y, opts, xent::upstream{}, out,
                                   xent::matrix_view<float>(dg.ptr, rows, V));
          ok(cudaDeviceSynchronize());
          EXPECT_NEAR(dl.download()[0], want, 1e-5 * std::fabs(want))
              << V << " classes, " << rows << " rows, call " << call;
          if (count) EXPECT_EQ(dhits.download()[0], hits) << V << " classes, " << rows << " rows";
          // The counters are left at 0 for the next call (the rows' queue among them).
          xent::cuda_detail::workspace_header head;
          ok(cudaMemcpy(&head, ws.ptr, sizeof head, cudaMemcpyDeviceToHost));
          EXPECT_EQ(head.rows_done, 0u) << V << " classes, " << rows << " rows, call " << call;
          EXPECT_EQ(head.rows_taken, 0u) << V << " classes, " << rows << " rows, call " << call;
        }
        // The last fused call's gradient, every row: whichever CTA took a row, it is that row's.
        if (reduce == xent::reduction::mean && !count) {
          const std::vector<float> g = dg.download();
          std::int64_t bad = 0;
          for (std::int64_t r = 0; r < rows; ++r) {
            for (std::int64_t c = 0; c < V; ++c) {
              const double want_g = ref.grad[r * V + c];
              const double got = g[r * V + c];
              if (std::fabs(got - want_g) > 1e-5 * std::fabs(want_g) + 1e-6 / kept && bad++ == 0)
                ADD_FAILURE() << V << " classes, " << rows << " rows: gradient of row " << r
                              << ", class " << c << ": " << got << " against " << want_g;
            }
          }
          EXPECT_EQ(bad, 0) << V << " classes, " << rows << " rows";
        }
      }
    }
  }
}

// A fused call on rows that do not start on 16-byte boundaries, where the row kernel cannot hold
// them (longer than a cluster's chunks: 262147 bf16 classes), keeps each row's LSE between its two
// kernels in the caller's LSE output, else in the workspace (the same kernels: the same bits),
// else, with neither, takes the row kernel's element-wise staging (the same values to rounding).
// Rows it holds (50257; policy::shifted_rows) take it whatever the call keeps: the same bits.
TEST(CudaBackendSemantics, FusedShiftedRowsKeepTheirLseInTheOutputOrTheWorkspace) {
  REQUIRE_GPU();
  const int sms = sm_count();
  for (const std::int64_t V : {std::int64_t{50257}, std::int64_t{262147}}) {
    SCOPED_TRACE("V " + std::to_string(V));
    const std::int64_t N = 2 * std::int64_t{sms} + 3;
    std::mt19937_64 rng(31);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<Eigen::bfloat16> x(static_cast<std::size_t>(N * V));
    for (auto& v : x) v = Eigen::bfloat16(normal(rng));
    std::vector<std::int64_t> y(static_cast<std::size_t>(N));
    for (std::int64_t n = 0; n < N; ++n) y[n] = n % 5 == 2 ? -100 : (n * 7919) % V;
    dbuf<std::int64_t> dy(y);
    dbuf<float> d_lse(N), d_rows(N);
    dbuf<char> ws(xent::cuda_workspace_size(N));
    xent::options opts;
    opts.reduce = xent::reduction::none;
    // Returns the gradient (in place) and the row losses.
    auto fused = [&](bool lse_out, bool workspace) {
      dbuf<Eigen::bfloat16> dx(x);
      xent::cuda exec;
      if (workspace) {
        exec.workspace = ws.ptr;
        exec.workspace_bytes = ws.n;
      }
      xent::forward_outputs out;
      out.row_loss = {d_rows.ptr, N};
      if (lse_out) out.lse = {d_lse.ptr, N};
      const xent::matrix_view<Eigen::bfloat16> L(dx.ptr, N, V);
      xent::forward_backward(exec, L, xent::vector_view<const std::int64_t>(dy.ptr, N), opts,
                             xent::upstream{}, out, L);
      ok(cudaDeviceSynchronize());
      return std::make_pair(dx.download(), d_rows.download());
    };
    const auto given = fused(true, true), held = fused(false, true), neither = fused(false, false);
    EXPECT_TRUE(std::memcmp(given.first.data(), held.first.data(), x.size() * 2) == 0);
    EXPECT_TRUE(std::memcmp(given.second.data(), held.second.data(), sizeof(float) * N) == 0);
    for (std::int64_t n = 0; n < N; ++n) {
      ASSERT_NEAR(neither.second[n], given.second[n], 1e-5 * (std::fabs(given.second[n]) + 1))
          << "row " << n;
      for (std::int64_t c = 0; c < V; ++c) {
        const double a = dbl(given.first[n * V + c]), b = dbl(neither.first[n * V + c]);
        ASSERT_NEAR(a, b, 1e-2 * std::fabs(a) + 1e-7) << "row " << n << " class " << c;
      }
    }
  }
}

// A fused call whose gradient is float where the logits are bf16, on rows that are not 16-byte
// aligned (a short batch: the small-batch kernel; a long one: the row kernel): their gradient rows
// never share the logits' boundaries, so the element-wise paths take them. The gradient is the
// in-place bf16 call's to within bf16 rounding, the loss the same to float rounding.
TEST(CudaBackendSemantics, FusedFloatGradientOfBfloat16LogitsOnUnalignedRows) {
  REQUIRE_GPU();
  const int sms = sm_count();
  for (const auto& shape :
       {std::pair<std::int64_t, std::int64_t>{19, 4097},
        std::pair<std::int64_t, std::int64_t>{8 * std::int64_t{sms} + 7, 3001}}) {
    const std::int64_t N = shape.first, V = shape.second;
    SCOPED_TRACE(std::to_string(N) + " x " + std::to_string(V));
    std::mt19937_64 rng(static_cast<std::uint64_t>(N * V));
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<Eigen::bfloat16> x(static_cast<std::size_t>(N * V));
    for (auto& v : x) v = Eigen::bfloat16(normal(rng));
    std::vector<std::int64_t> y(static_cast<std::size_t>(N));
    for (std::int64_t n = 0; n < N; ++n) y[n] = n % 4 == 1 ? -100 : (n * 131) % V;
    dbuf<Eigen::bfloat16> d_logits(x), d_in_place(x);
    dbuf<float> d_grad(static_cast<std::size_t>(N * V)), d_loss(1), d_loss_in_place(1);
    dbuf<std::int64_t> dy(y);
    dbuf<char> ws(xent::cuda_workspace_size(N));
    const xent::cuda exec{nullptr, ws.ptr, ws.n, nullptr};
    const xent::vector_view<const std::int64_t> targets(dy.ptr, N);
    xent::forward_outputs out;
    out.loss = d_loss.ptr;
    xent::forward_backward(exec, xent::matrix_view<Eigen::bfloat16>(d_logits.ptr, N, V), targets,
                           xent::options{}, xent::upstream{}, out,
                           xent::matrix_view<float>(d_grad.ptr, N, V));
    out.loss = d_loss_in_place.ptr;
    const xent::matrix_view<Eigen::bfloat16> in_place(d_in_place.ptr, N, V);
    xent::forward_backward(exec, in_place, targets, xent::options{}, xent::upstream{}, out,
                           in_place);
    ok(cudaDeviceSynchronize());
    const float loss = d_loss_in_place.download()[0];
    EXPECT_NEAR(d_loss.download()[0], loss, 1e-5 * (std::fabs(loss) + 1));
    const auto g = d_grad.download();
    const auto b = d_in_place.download();
    for (std::int64_t i = 0; i < N * V; ++i)
      ASSERT_NEAR(g[i], dbl(b[i]), std::ldexp(std::fabs(g[i]), -7) + 1e-9) << "element " << i;
  }
}

TEST(CudaBackendSemantics, ZeroRowsGiveNanMeanAndZeroSum) {
  REQUIRE_GPU();
  dbuf<float> dl(std::vector<float>{5.0f});
  dbuf<char> ws(xent::cuda_workspace_size(0) + 256);
  float dummy = 0;
  xent::cuda exec{nullptr, ws.ptr, ws.n, nullptr};
  xent::forward_outputs out;
  out.loss = dl.ptr;
  xent::options opts;
  xent::forward(exec, xent::matrix_view<const float>(&dummy, 0, 10),
                xent::vector_view<const std::int64_t>(nullptr, 0), opts, out);
  ok(cudaDeviceSynchronize());
  EXPECT_TRUE(std::isnan(dl.download()[0]));
  opts.reduce = xent::reduction::sum;
  xent::forward(exec, xent::matrix_view<const float>(&dummy, 0, 10),
                xent::vector_view<const std::int64_t>(nullptr, 0), opts, out);
  ok(cudaDeviceSynchronize());
  EXPECT_EQ(dl.download()[0], 0.0f);
}

TEST(CudaBackendSemantics, MissingWorkspaceIsAClearError) {
  REQUIRE_GPU();
  dbuf<float> dx(std::vector<float>(30, 1.0f)), dl(1);
  dbuf<std::int64_t> dy(std::vector<std::int64_t>{0, 1, 2});
  xent::forward_outputs out;
  out.loss = dl.ptr;
  try {
    xent::forward(xent::cuda{}, xent::matrix_view<const float>(dx.ptr, 3, 10),
                  xent::vector_view<const std::int64_t>(dy.ptr, 3), xent::options{}, out);
    FAIL() << "no error";
  } catch (const xent::error& e) {
    EXPECT_EQ(e.argument(), "exec.workspace");
  }
}

// No GPU needed: the overlap checks throw from the views' addresses (host memory here) before
// anything reaches the device.
TEST(CudaBackendArguments, WorkspaceOrErrorCountOverlappingAnArgumentIsAClearError) {
  std::vector<float> x(3 * 10, 0.0f), g(3 * 10, 0.0f);
  std::vector<std::int64_t> y{0, 1, 2};
  float loss = 0.0f;
  xent::forward_outputs out;
  out.loss = &loss;
  const xent::matrix_view<const float> logits(x.data(), 3, 10);
  const xent::vector_view<const std::int64_t> targets(y.data(), 3);
  auto named = [&](const xent::cuda& exec, bool fused) -> std::string {
    try {
      if (fused)
        xent::forward_backward(exec, logits, targets, xent::options{}, xent::upstream{}, out,
                               xent::matrix_view<float>(g.data(), 3, 10));
      else
        xent::forward(exec, logits, targets, xent::options{}, out);
    } catch (const xent::error& e) {
      return e.argument();
    }
    return "(no error)";
  };
  const xent::cuda over_logits{nullptr, x.data() + 5, 64, nullptr, nullptr};
  EXPECT_EQ(named(over_logits, false), "exec.workspace");
  EXPECT_EQ(named(over_logits, true), "exec.workspace");
  const xent::cuda over_grad{nullptr, g.data() + 29, 64, nullptr, nullptr};
  EXPECT_EQ(named(over_grad, true), "grad");  // the first written span of the pair is named
  const xent::cuda over_loss{nullptr, &loss, sizeof loss, nullptr, nullptr};
  EXPECT_EQ(named(over_loss, false), "outputs.loss");
  const xent::cuda count_in_targets{nullptr, nullptr, 0, reinterpret_cast<int*>(y.data() + 1),
                                    nullptr};
  EXPECT_EQ(named(count_in_targets, false), "exec.error_count");
  EXPECT_EQ(named(count_in_targets, true), "exec.error_count");
}

/// Everything at once, in a CUDA graph: captured, replayed twice, equal to the direct call.
TEST(CudaBackendGraphs, ForwardBackwardAndBackwardUnderStreamCaptureMatchDirectCalls) {
  REQUIRE_GPU();
  const std::int64_t N = 64, V = 32000;
  std::vector<Eigen::bfloat16> x(N * V);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (auto& v : x) v = Eigen::bfloat16(nd(rng));
  std::vector<std::int64_t> y(N);
  for (std::int64_t n = 0; n < N; ++n) y[n] = (n * 7919) % V;
  dbuf<Eigen::bfloat16> a(x), b(x), g(x.size());
  dbuf<std::int64_t> dy(y);
  dbuf<float> la(1), lb(1), lse(N);
  dbuf<char> ws(xent::cuda_workspace_size(N));
  cudaStream_t stream;
  ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  xent::cuda exec{stream, ws.ptr, ws.n, nullptr};
  xent::options opts;
  opts.label_smoothing = 0.1f;
  xent::forward_outputs out;
  out.loss = la.ptr;
  out.lse = {lse.ptr, N};
  const xent::vector_view<const std::int64_t> T(dy.ptr, N);
  xent::forward_backward(exec, xent::matrix_view<Eigen::bfloat16>(a.ptr, N, V), T, opts,
                         xent::upstream{}, out, xent::matrix_view<Eigen::bfloat16>(a.ptr, N, V));
  ok(cudaStreamSynchronize(stream));
  const auto direct = a.download();
  const float direct_loss = la.download()[0];

  cudaGraph_t graph;
  cudaGraphExec_t inst;
  out.loss = lb.ptr;
  ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  xent::forward_backward(exec, xent::matrix_view<Eigen::bfloat16>(b.ptr, N, V), T, opts,
                         xent::upstream{}, out, xent::matrix_view<Eigen::bfloat16>(g.ptr, N, V));
  xent::backward(exec, xent::matrix_view<Eigen::bfloat16>(b.ptr, N, V), T, opts,
                 xent::vector_view<const float>(lse.ptr, N), xent::upstream{},
                 xent::matrix_view<Eigen::bfloat16>(b.ptr, N, V));
  ok(cudaStreamEndCapture(stream, &graph));
  ok(cudaGraphInstantiate(&inst, graph, 0));
  ok(cudaGraphLaunch(inst, stream));
  ok(cudaStreamSynchronize(stream));
  const auto fused = g.download();
  const auto from_lse = b.download();
  EXPECT_EQ(lb.download()[0], direct_loss);
  for (std::size_t i = 0; i < direct.size(); ++i) {
    ASSERT_EQ(dbl(fused[i]), dbl(direct[i])) << i;
    ASSERT_EQ(dbl(from_lse[i]), dbl(direct[i])) << i;
  }
  cudaGraphExecDestroy(inst);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

/// Normal fp32 logits (sd `sd`) and class ids (n * stride) % V of an N x V problem.
struct plain_problem {
  std::int64_t N, V;
  std::vector<float> x;
  std::vector<std::int64_t> y;
  plain_problem(std::int64_t rows, std::int64_t cols, unsigned seed, float sd, std::int64_t stride)
      : N(rows),
        V(cols),
        x(static_cast<std::size_t>(rows * cols)),
        y(static_cast<std::size_t>(rows)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, sd);
    for (auto& v : x) v = nd(rng);
    for (std::int64_t n = 0; n < N; ++n) y[n] = (n * stride) % V;
  }
};

/// The mean loss and the gradient of one forward_backward on the current device.
struct plain_result {
  float loss;
  std::vector<float> grad;
};

plain_result forward_backward_on_device(const plain_problem& p) {
  dbuf<float> dx(p.x), g(p.x.size()), l(1);
  dbuf<std::int64_t> dy(p.y);
  dbuf<char> ws(xent::cuda_workspace_size(p.N));
  const xent::cuda exec{nullptr, ws.ptr, ws.n, nullptr};
  xent::forward_outputs out;
  out.loss = l.ptr;
  xent::forward_backward(exec, xent::matrix_view<const float>(dx.ptr, p.N, p.V),
                         xent::vector_view<const std::int64_t>(dy.ptr, p.N), xent::options{},
                         xent::upstream{}, out, xent::matrix_view<float>(g.ptr, p.N, p.V));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {l.download()[0], g.download()};
}

TEST(CudaBackendDeterminism, SameInputsGiveBitwiseSameResults) {
  REQUIRE_GPU();
  const plain_problem p(333, 50257, 5, 3.0f, 31);
  const plain_result a = forward_backward_on_device(p), b = forward_backward_on_device(p);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(std::memcmp(a.grad.data(), b.grad.data(), a.grad.size() * sizeof(float)), 0);
}

/// One process calling xent on every visible GPU in turn (as a single-process NCCL group or a
/// torch program on cuda:1 does) gets the same bits on each: the kernels' attributes (the shared
/// memory above 48 KiB, the cluster sizes) are set on every device, not only the first one used.
TEST(CudaBackendDevices, EveryVisibleGpuOfOneProcessGivesTheSameResults) {
  REQUIRE_GPU();
  int gpus = 0;
  ok(cudaGetDeviceCount(&gpus));
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs in one process; " << gpus << " visible";
  const plain_problem p(1024, 32003, 9, 2.0f, 131);
  const plain_result first = forward_backward_on_device(p);
  EXPECT_TRUE(std::isfinite(first.loss));
  for (int d = 1; d < gpus; ++d) {
    ok(cudaSetDevice(d));
    const plain_result r = forward_backward_on_device(p);
    EXPECT_EQ(r.loss, first.loss) << "device " << d;
    EXPECT_EQ(std::memcmp(r.grad.data(), first.grad.data(), r.grad.size() * sizeof(float)), 0)
        << "device " << d;
  }
  ok(cudaSetDevice(0));
}

TEST(CudaBackendAgreement, MatchesTheCpuBackend) {
  REQUIRE_GPU();
  const std::int64_t N = 37, V = 32000;
  std::vector<Eigen::bfloat16> x(N * V);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (auto& v : x) v = Eigen::bfloat16(nd(rng));
  std::vector<std::int32_t> y(N);
  for (std::int64_t n = 0; n < N; ++n) y[n] = static_cast<std::int32_t>((n * 577) % V);
  y[5] = -100;
  xent::options opts;
  opts.label_smoothing = 0.05f;
  opts.z_loss = 1e-4f;
  std::vector<float> cpu_rows(N), cpu_lse(N);
  std::vector<Eigen::bfloat16> cpu_grad(x.size());
  xent::forward_outputs out;
  float cpu_loss = 0;
  out.loss = &cpu_loss;
  out.row_loss = {cpu_rows.data(), N};
  xent::forward_backward(xent::cpu{}, xent::matrix_view<const Eigen::bfloat16>(x.data(), N, V),
                         xent::vector_view<const std::int32_t>(y.data(), N), opts, xent::upstream{},
                         out, xent::matrix_view<Eigen::bfloat16>(cpu_grad.data(), N, V));
  dbuf<Eigen::bfloat16> dx(x);
  dbuf<std::int32_t> dy(y);
  dbuf<float> drows(N), dloss(1);
  dbuf<char> ws(xent::cuda_workspace_size(N));
  xent::cuda exec{nullptr, ws.ptr, ws.n, nullptr};
  out.loss = dloss.ptr;
  out.row_loss = {drows.ptr, N};
  xent::forward_backward(exec, xent::matrix_view<Eigen::bfloat16>(dx.ptr, N, V),
                         xent::vector_view<const std::int32_t>(dy.ptr, N), opts, xent::upstream{},
                         out, xent::matrix_view<Eigen::bfloat16>(dx.ptr, N, V));
  ok(cudaDeviceSynchronize());
  EXPECT_NEAR(dloss.download()[0], cpu_loss, 1e-5 * std::fabs(cpu_loss));
  const auto rows = drows.download();
  for (std::int64_t n = 0; n < N; ++n) EXPECT_NEAR(rows[n], cpu_rows[n], 1e-4 * (1 + cpu_rows[n]));
  const auto g = dx.download();
  std::size_t differ = 0;
  for (std::size_t i = 0; i < g.size(); ++i)
    if (std::fabs(dbl(g[i]) - dbl(cpu_grad[i])) > 1e-2 * std::fabs(dbl(cpu_grad[i])) + 1e-9)
      ++differ;
  EXPECT_EQ(differ, 0u);  // bf16 outputs agree to one rounding of the float value
}

/// Small cases that compute-sanitizer memcheck / racecheck run (.ci/device).
TEST(CudaSanitizer, SmallCasesOfEveryPath) {
  REQUIRE_GPU();
  for (std::int64_t V : {3, 1000, 20000}) {
    spec s;
    s.rows = 5;
    s.cols = V;
    s.smoothing = 0.1f;
    s.some_ignored = true;
    check_spec<Eigen::bfloat16>(s);
    s.soft = true;
    s.ld = V + 3;
    s.in_place = false;
    check_spec<float>(s);
  }
  // Plain class-id rows of a small batch: the small-batch kernel (policy::small_regs), rows
  // 16-byte aligned, cut at their own boundaries (in place and out), and element by element (the
  // gradient at another offset).
  for (std::int64_t ld : {20000, 20003}) {
    spec s;
    s.rows = 5;
    s.cols = 20000;
    s.ld = ld;
    s.some_ignored = true;
    s.argmax = false;
    s.in_place = ld == 20000;
    check_spec<float>(s);
    if (ld == 20003) {
      s.in_place = true;
      check_spec<Eigen::bfloat16>(s);
      s.in_place = false;
      s.grad_offset = 1;
      check_spec<float>(s);
    }
  }
  // Plain fused rows of 280 KB: the row kernel's wide shape (policy::wide_rows), each row spread
  // over a cluster of 16 CTAs of 512 threads.
  spec s;
  s.rows = 3;
  s.cols = 140000;
  s.some_ignored = true;
  s.argmax = false;
  check_spec<Eigen::bfloat16>(s);
}

// A batch of plain rows that gives every CTA in flight several rows: the streaming forward
// (policy::stream_forward), rows of whole tiles and a partial one, each CTA's row parts handed to
// warp 0 through two parities that every CTA reuses (three rows a CTA, some ignored, so parities
// are reused across skipped rows too); the bulk backward's CTAs and the row kernel's refill stages
// they have read. Under memcheck only: racecheck does not follow the mbarrier hand-offs that order
// those refills (a stage's readers arrive, the thread that refills it waits) and reports each
// refill as a hazard (.ci/device). The non-sanitizer build runs it with the named-barrier
// hand-offs.
TEST(CudaSanitizerLongBatch, PlainRowsThroughEveryPass) {
  REQUIRE_GPU();
  const int sms = sm_count();
  spec s;
  s.rows = 24 * std::int64_t{sms} + 5;  // the streaming forward runs 8 * sms CTAs
  s.cols = 9000;  // one 8192-element bf16 tile and a partial one; two fp32 tiles and a partial one
  s.some_ignored = true;
  s.argmax = false;
  check_spec<Eigen::bfloat16>(s);
  check_spec<float>(s);
  // Rows off 16-byte boundaries (ld 9003), in place: each pass cut at every row's own boundaries,
  // the fused one by the row kernel (policy::shifted_rows). The last row ends 4 elements before
  // the buffer does, nearer than its last 16 bytes reach: its tail is read element by element.
  s.ld = 9003;
  check_spec<Eigen::bfloat16>(s);
  // Short rows off 16-byte boundaries, in place: the fused pass by the streaming forward and the
  // bulk backward through the LSE (policy::split_fused_kib).
  s.cols = 3001;
  s.ld = 3003;
  check_spec<Eigen::bfloat16>(s);
}

// Short aligned rows in a batch too long for the small-batch kernel: a warp per row
// (policy::warp_rows_kib), forward and fused, its shares summed in shared memory per CTA, in both
// of the kernel's forms (6 and 12 KiB); racecheck too (no mbarrier hand-offs there).
TEST(CudaSanitizer, ShortRowsAWarpEach) {
  REQUIRE_GPU();
  const int sms = sm_count();
  spec s;
  s.rows = 16 * std::int64_t{sms} + 5;  // two CTAs of eight warps per SM, and five rows more
  s.cols = 3000;  // 6000 bytes of bf16, 16-byte aligned; fp32: 1500 (the same bytes)
  s.some_ignored = true;
  s.argmax = false;
  check_spec<Eigen::bfloat16>(s);
  s.cols = 1500;
  s.reduce = xent::reduction::sum;
  check_spec<float>(s);
  s.cols = 6000;  // 12000 bytes of bf16: the long form
  check_spec<Eigen::bfloat16>(s);
}

// Plain fused rows through the row kernel (a batch too long for the small-batch kernel) with every
// target at a slice's edge: the slices of whole vectors sweep whole register tiles past the slice
// (the stage holds -inf there), the others the tested tiles; rows padded to 16 bytes with a last
// slice that is not whole vectors; rows that fit one CTA. Slices of 12000 and 28000 classes fill
// at most 6 and 7 of each thread's 8 vectors (trimmed sweeps, policy::trim_tiles).
TYPED_TEST(CudaBackend, PlainFusedRowsWithTargetsAtSliceEdges) {
  const int sms = sm_count();
  for (auto shape :
       {std::pair<std::int64_t, std::int64_t>{32000, 0}, {32001, 32008}, {12000, 0}, {28000, 0}}) {
    spec s;
    s.rows = 8 * std::int64_t{sms} + 5;
    s.cols = shape.first;
    s.ld = shape.second;
    s.edge_targets = true;
    s.some_ignored = true;
    s.argmax = false;
    s.seed = static_cast<std::uint64_t>(shape.first);
    check_spec<TypeParam>(s);
  }
}

// Plain rows of a small batch whose starts are not 16-byte aligned (odd V or ld): the small-batch
// kernel cuts each row at its own 16-byte boundaries where the gradient's fall on the same
// elements (row_start::shifted: in place, or out of place at the same offset), rank 0's tile
// starting up to vec - 1 elements before the row; elsewhere every element alone
// (row_start::any). Rows of every lead (19 rows of odd ld), targets at 0, V - 1 and each rank's
// first class and the one before it, rows ignored (with the same offset, the last row too: its
// rank 0 polls the rows' losses, and in a fused mean takes W from no exchange), every reduction.
TYPED_TEST(CudaBackend, PlainSmallBatchRowsCutAtTheirOwn16ByteBoundaries) {
  using xent::cuda_detail::make_small_plan;
  const int sms = sm_count();
  constexpr std::int64_t bytes = sizeof(TypeParam), vec = 16 / bytes;
  std::uint64_t seed = 900;
  for (auto shape : {std::pair<std::int64_t, std::int64_t>{50257, 0},
                     {4097, 0},
                     {3000, 3003},
                     {20000, 20001},
                     {5, 0}})
    for (auto red : {xent::reduction::mean, xent::reduction::sum, xent::reduction::none})
      for (int layout = 0; layout < 3; ++layout) {  // in place; same offset; another offset
        spec s = plain_rows(19, shape, red);
        s.in_place = layout == 0;
        s.grad_offset = layout == 2 ? 1 : 0;
        s.last_ignored = layout == 1;
        s.shifted_cluster =
            static_cast<int>(make_small_plan(s.rows, s.cols + vec - 1, bytes, sms).cluster);
        s.seed = seed++;
        check_spec<TypeParam>(s);
      }
}

// A small batch of more clusters than fit at once (fp32 128 x 32000: 1024 CTAs where about 660
// run together), so that the rows' records reach the polling CTA from two waves. Rows of 125 KiB
// and of a partial last vector, padded and not, every reduction (the mean's class-weighted
// normaliser summed by one warp of each row's rank 0), some rows ignored, targets at each rank's
// edges, in place and out of place.
TYPED_TEST(CudaBackend, PlainSmallBatchesOfMoreThanOneWave) {
  using xent::cuda_detail::make_small_plan;
  const int sms = sm_count();
  constexpr std::int64_t bytes = sizeof(TypeParam), vec = 16 / bytes;
  std::uint64_t seed = 1100;
  for (auto shape : {std::pair<std::int64_t, std::int64_t>{128000 / bytes, 0},
                     {128000 / bytes - vec - 1, 128000 / bytes}})
    for (auto red : {xent::reduction::mean, xent::reduction::sum, xent::reduction::none}) {
      // 128 rows, or one per SM on a smaller GPU (8 CTAs a row: the plan spans at most 8 per SM).
      spec s = plain_rows(std::min<std::int64_t>(128, sms), shape, red);
      s.weights = red == xent::reduction::mean;
      s.in_place = red != xent::reduction::sum;
      const auto plan = make_small_plan(s.rows, s.cols, static_cast<int>(bytes), sms);
      ASSERT_GT(plan.cluster * s.rows, 5 * sms) << "the batch should need more than one wave";
      s.edge_targets = true;
      s.edge_cluster = static_cast<int>(plan.cluster);
      s.seed = seed++;
      check_spec<TypeParam>(s);
    }
}

// Plain rows of at most 12 KiB, 16-byte aligned, several per warp in flight: the warp-rows kernel
// where policy::warp_rows_kib takes them (a warp's registers hold the row from its load to its
// gradient's store; 2 CTAs of 8 warps per SM, or for fused rows past that tile, 1 CTA of lanes
// with twice the vectors), the streaming forward and the row kernel otherwise. Rows of one
// partial vector (5 classes), of whole vectors, of a partial last vector, of either form's whole
// tile (32 lanes x 12 or 24 vectors) with and without padding, and one vector past the short
// form's; some rows ignored, weights and z-loss, every reduction, in place and out of place, a
// spike past the running max.
TYPED_TEST(CudaBackend, ShortAlignedRowsAWarpEach) {
  const int sms = sm_count();
  constexpr std::int64_t vec = 16 / sizeof(TypeParam), tile = 32 * 12 * vec, long_tile = 2 * tile;
  std::uint64_t seed = 1200;
  for (const auto& shape : {std::pair<std::int64_t, std::int64_t>{5, 8},
                            {1000, 1000},
                            {1001, 1008},
                            {tile, tile},
                            {tile - vec + 1, tile},
                            {tile + vec, tile + vec},
                            {long_tile, long_tile},
                            {long_tile - vec + 1, long_tile}})
    for (int layout = 0; layout < 3; ++layout) {
      spec s;
      s.rows = 40 * std::int64_t{sms} + 9;
      s.cols = shape.first;
      s.ld = shape.second;
      s.reduce = layout == 0   ? xent::reduction::mean
                 : layout == 1 ? xent::reduction::sum
                               : xent::reduction::none;
      s.weights = layout != 0;
      s.z_loss = layout == 1 ? 1e-3f : 0.0f;
      s.in_place = layout != 2;
      s.spike = layout == 0 ? 60.0f : 0.0f;
      s.edge_targets = layout == 1;
      s.some_ignored = true;
      s.argmax = false;
      s.seed = seed++;
      check_spec<TypeParam>(s);
    }
}

// Plain rows that do not start on 16-byte boundaries (odd V or ld) in batches too long for the
// small-batch kernel: the streaming forward and backward cut each row at its own boundaries
// (tile k > 0 starting at k span - lead, the first lead elements before the row), and so does the
// fused pass's row kernel where the gradient's rows share the logits' boundaries (in place, or out
// of place at the same offset; policy::shifted_rows: rank r of the row's cluster from r slice -
// lead), or for rows of at most 6 KiB the warp-rows kernel (policy::warp_rows_shifted: 16-bit
// rows of 3001 and 5 classes); at another offset the row kernel's element-wise path. Rows of every
// lead, targets at 0, V - 1 and each tile's and each rank's first class and the one before, rows
// ignored, weights, z-loss, a spike in the last columns, every reduction; the wide streaming
// forward's CTAs for rows over 128 KiB (70001 x 2 bytes); rows of 5 classes, shorter than a 16-bit
// vector with their lead (nothing before such a row may be written).
TYPED_TEST(CudaBackend, PlainLongBatchRowsCutAtTheirOwn16ByteBoundaries) {
  const int sms = sm_count();
  constexpr std::int64_t vec = 16 / sizeof(TypeParam);
  // More rows than the small-batch kernel's clusters cover (8 CTAs per SM at most).
  const std::int64_t many = 8 * std::int64_t{sms} + 7, long_rows = 2 * std::int64_t{sms} + 3;
  std::uint64_t seed = 950;
  for (const auto& shape :
       {std::array<std::int64_t, 3>{many, 3001, 3003},
        std::array<std::int64_t, 3>{long_rows, 50257, 0},
        std::array<std::int64_t, 3>{long_rows, 70001, 0}, std::array<std::int64_t, 3>{many, 5, 7}})
    for (int layout = 0; layout < 3; ++layout) {  // in place; same offset; another offset
      spec s;
      s.rows = shape[0];
      s.cols = shape[1];
      s.ld = shape[2];
      s.reduce = layout == 0   ? xent::reduction::mean
                 : layout == 1 ? xent::reduction::none
                               : xent::reduction::sum;
      s.weights = shape[1] == 3001;
      s.z_loss = layout == 1 ? 1e-3f : 0.0f;
      s.some_ignored = true;
      s.argmax = false;
      s.in_place = layout == 0;
      s.grad_offset = layout == 2 ? 1 : 0;
      s.shifted_span = 1024 * vec;  // 4 vectors x 256 threads (the wide forward's: twice that)
      s.shifted_cluster = static_cast<int>(
          xent::cuda_detail::make_launch_plan(s.rows, s.cols + vec - 1, sizeof(TypeParam), sms, 16)
              .cluster);
      s.spike = shape[1] == 50257 ? 60.0f : 0.0f;
      s.seed = seed++;
      check_spec<TypeParam>(s);
    }
}

// Plain fused rows longer than 120 KiB (policy::wide_rows): CTAs of twice the threads and chunks,
// one per SM, clusters of up to 16 holding rows of up to 1 MiB; just past 1 MiB the default shape
// streams them in chunks. Targets at every slice's edge, rows ignored, in place and not, a spike
// in the last columns.
TYPED_TEST(CudaBackend, PlainFusedLongRowsTakeTheWideShape) {
  constexpr std::int64_t bytes = sizeof(TypeParam);
  for (std::int64_t row_bytes :
       {128000, (128 << 10) + 16, (256 << 10) + 16, 600000, 1 << 20, (1 << 20) + 16}) {
    spec s;
    s.rows = 90;  // enough clusters that the plan does not spread a row over more CTAs
    s.cols = row_bytes / bytes;
    s.edge_targets = true;
    s.edge_cluster = static_cast<int>((row_bytes + (64 << 10) - 1) / (64 << 10));  // wide cut
    if (s.edge_cluster > 16) s.edge_cluster = 16;
    s.some_ignored = true;
    s.argmax = false;
    s.in_place = row_bytes != 600000;
    s.spike = row_bytes == 1 << 20 ? 60.0f : 0.0f;
    if (row_bytes < 256 << 10) s.rows = 89;  // 3 CTAs per row
    s.seed = static_cast<std::uint64_t>(row_bytes);
    check_spec<TypeParam>(s);
  }
  // Far more rows than the clusters in flight: most come from the row queue, each ticket handed
  // from rank 0 to the other CTAs of its cluster (policy::queue_form: the queue as a branch of the
  // kernel for 16-bit rows of this shape, a kernel of its own for fp32).
  spec s = plain_rows(400, {128000 / bytes, 0}, xent::reduction::mean);
  s.seed = 128400;
  check_spec<TypeParam>(s);
}

// Host-only (runs without a GPU): the small-batch kernel's cut of a row over a cluster.
TEST(CudaLaunchPlan, SmallBatchesCutEachRowOverAClusterThatHoldsIt) {
  using xent::cuda_detail::make_small_plan;
  using xent::cuda_detail::policy;
  if (policy::small_regs == 0) GTEST_SKIP() << "no small-batch kernel (XENT_CUDA_SMALL_REGS=0)";
  const int sms = 132;
  // The seed shapes: 32 x 32000 fp32 (125 KiB rows) over 9 CTAs of 3556 classes, 32 x 50257 over
  // 13; 128 x 32000 over 8 (1024 CTAs, within 8 per SM).
  EXPECT_EQ(make_small_plan(32, 32000, 4, sms).cluster, 9);
  EXPECT_EQ(make_small_plan(32, 32000, 4, sms).slice, 3556);
  EXPECT_EQ(make_small_plan(32, 50257, 4, sms).cluster, 13);
  EXPECT_EQ(make_small_plan(128, 32000, 4, sms).cluster, 8);
  // Not small: too many rows, or rows longer than 16 CTAs hold, or more rows than the workspace
  // keeps records for (however many SMs there are).
  EXPECT_EQ(make_small_plan(8192, 32000, 2, sms).cluster, 0);
  EXPECT_EQ(make_small_plan(4, 262144, 4, sms).cluster, 0);
  EXPECT_GT(make_small_plan(xent::cuda_detail::workspace_records, 3, 4, 1000).cluster, 0);
  EXPECT_EQ(make_small_plan(xent::cuda_detail::workspace_records + 1, 3, 4, 1000).cluster, 0);
  for (std::int64_t rows : {1, 2, 7, 32, 100})
    for (std::int64_t cols : {1, 3, 255, 4097, 32000, 50257, 65536})
      for (int bytes : {2, 4}) {
        const auto p = make_small_plan(rows, cols, bytes, sms);
        if (p.cluster == 0) continue;
        const std::int64_t vec = 16 / bytes;
        EXPECT_LE(p.cluster, policy::cluster_max);
        EXPECT_EQ(p.slice % vec, 0);
        EXPECT_LE(p.slice, std::int64_t{policy::small_regs} * policy::block * vec);
        EXPECT_GE(p.slice * p.cluster, cols) << rows << " x " << cols;
        EXPECT_LE(rows * p.cluster, std::int64_t{policy::small_ctas_per_sm} * sms);
      }
}

// Host-only (runs without a GPU): which fused rows take the wide shape (policy::wide_rows), and
// its cut of them: every such row held on chip (one chunk per CTA) by a cluster of at most 16.
TEST(CudaLaunchPlan, LongFusedRowsTakeTheWideShapeUpTo1MiB) {
  using xent::cuda_detail::make_launch_plan;
  using xent::cuda_detail::policy;
  using xent::cuda_detail::wide_rows_for;
  using xent::cuda_detail::wide_shape;
  if (!policy::wide_rows) GTEST_SKIP() << "no wide shape (XENT_CUDA_WIDE_ROWS=0)";
  const std::int64_t most =
      std::int64_t{policy::cluster_max} * static_cast<std::int64_t>(wide_shape::chunk_bytes);
  EXPECT_FALSE(wide_rows_for(policy::wide_from_bytes));
  EXPECT_TRUE(wide_rows_for(policy::wide_from_bytes + 16));
  EXPECT_TRUE(wide_rows_for(most));
  EXPECT_FALSE(wide_rows_for(most + 16));
  const int sms = 132;
  auto wide = [&](std::int64_t rows, std::int64_t cols, int bytes) {
    return make_launch_plan(rows, cols, bytes, sms, policy::cluster_max, wide_shape::chunk_bytes);
  };
  // The benchmark's shapes: bf16 4096 x 262144 over 8 CTAs (16 of the default shape), 16384 x
  // 128256 over 4, fp32 8192 x 128256 over 8.
  EXPECT_EQ(wide(4096, 262144, 2).cluster, 8);
  EXPECT_EQ(wide(16384, 128256, 2).cluster, 4);
  EXPECT_EQ(wide(8192, 128256, 4).cluster, 8);
  for (std::int64_t rows : {1, 3, 60, 4096})
    for (std::int64_t row_bytes : {policy::wide_from_bytes + 16, std::int64_t{600000}, most})
      for (int bytes : {2, 4}) {
        const std::int64_t cols = row_bytes / bytes;
        ASSERT_TRUE(wide_rows_for(cols * bytes));
        const auto p = wide(rows, cols, bytes);
        EXPECT_EQ(p.chunks, 1) << rows << " x " << cols;
        EXPECT_LE(p.cluster, policy::cluster_max);
        EXPECT_EQ(p.slice % (16 / bytes), 0);
        EXPECT_GE(p.slice * p.cluster, cols);
        EXPECT_LE(p.slice * bytes, static_cast<std::int64_t>(wide_shape::chunk_bytes));
      }
}

TEST(CudaLaunchPlan, PersistentGridsWalkEvenShares) {
  using xent::cuda_detail::ceil_div;
  using xent::cuda_detail::persistent_grid;
  using xent::cuda_detail::policy;
  EXPECT_EQ(persistent_grid(0, 396), 0);
  EXPECT_EQ(persistent_grid(7, 396), 7);
  EXPECT_EQ(persistent_grid(396, 396), 396);
  EXPECT_EQ(persistent_grid(5, 0), 1);  // a device that holds none still gets one
  // bf16 8192 x 32000 backward in 8 KiB tiles over three CTAs per SM of 132: 65536 tiles.
  EXPECT_EQ(persistent_grid(65536, 396), policy::balanced_grid ? 395 : 396);
  for (std::int64_t units : {397, 1000, 32768, 65536, 1000003})
    for (std::int64_t most : {1, 2, 132, 396, 528}) {
      const std::int64_t grid = persistent_grid(units, most);
      ASSERT_GE(grid, 1);
      EXPECT_LE(grid, most);
      // No CTA walks more units than with the largest grid, and the grid covers them all.
      EXPECT_EQ(ceil_div(units, grid), ceil_div(units, most)) << units << " over " << most;
    }
}

// The row kernel's queue (row_queue.cuh), its counting on the host: clusters in a random order,
// each with its first two rows dealt out in turn, then a ticket per row taken while its last one
// was a row, as the kernel's taker does. Every row is taken once, and the take that resets the
// counter is the launch's last.
TEST(CudaRowQueue, EveryRowOnceAndTheLastTakeResetsTheCounter) {
  constexpr int stages = 2;
  std::mt19937 rng(11);
  for (std::int64_t rows : {1, 2, 3, 131, 132, 133, 263, 264, 265, 700, 4000})
    for (std::int64_t clusters : {1, 2, 7, 132}) {
      if (clusters > rows) continue;  // the launch's grid has at most a cluster a row
      const std::int64_t takes = xent::cuda_detail::row_queue_takes(rows, clusters, stages);
      struct cluster_state {
        std::vector<std::int64_t> item;  // each item's row, rows past the last
        std::size_t next = 0;
        bool dry = false;
      };
      std::vector<cluster_state> c(static_cast<std::size_t>(clusters));
      for (std::int64_t b = 0; b < clusters; ++b) {
        for (int k = 0; k < stages; ++k) c[b].item.push_back(std::min(b + k * clusters, rows));
        c[b].dry = c[b].item.back() == rows;
      }
      std::vector<int> seen(static_cast<std::size_t>(rows));
      std::int64_t counter = 0, taken = 0, resets = 0;
      for (;;) {
        std::vector<std::size_t> live;
        for (std::size_t b = 0; b < c.size(); ++b)
          if (c[b].item[c[b].next] < rows) live.push_back(b);
        if (live.empty()) break;
        cluster_state& s = c[live[rng() % live.size()]];
        ++seen[static_cast<std::size_t>(s.item[s.next])];
        if (!s.dry) {  // item next + stages's ticket
          ASSERT_EQ(resets, 0) << "a take after the last";
          const std::int64_t t = counter++;
          ++taken;
          if (t == takes - 1) {
            counter = 0;
            ++resets;
          }
          const std::int64_t n = std::min(stages * clusters + t, rows);
          s.item.push_back(n);
          s.dry = n == rows;
        }
        ++s.next;
        ASSERT_LT(s.next, s.item.size()) << "an item without a row";
      }
      EXPECT_EQ(taken, takes) << rows << " rows, " << clusters << " clusters";
      EXPECT_EQ(counter, 0) << rows << " rows, " << clusters << " clusters";
      EXPECT_EQ(resets, takes > 0 ? 1 : 0) << rows << " rows, " << clusters << " clusters";
      for (std::int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(seen[static_cast<std::size_t>(r)], 1)
            << "row " << r << " of " << rows << ", " << clusters << " clusters";
    }
}

/// 16384 x 131073 bf16 = 2.1e9 elements (> 2^31): 64-bit offsets end to end. Rows are checked by
/// sampling against the oracle.
TEST(CudaBackendLarge, MoreThan2Pow31ElementsIndexCorrectly) {
  REQUIRE_GPU();
  const std::int64_t N = 16384, V = 131073;
  std::size_t free_bytes = 0, total = 0;
  ok(cudaMemGetInfo(&free_bytes, &total));
  if (free_bytes < std::size_t(6) << 30) GTEST_SKIP() << "needs 6 GiB of free device memory";
  dbuf<Eigen::bfloat16> dx(static_cast<std::size_t>(N * V));
  std::vector<Eigen::bfloat16> row(V);
  std::vector<std::int64_t> y(N);
  for (std::int64_t n = 0; n < N; ++n) y[n] = (n * 104729) % V;
  // Fill every row with a shifted copy of one pattern (cheap to upload, distinct per row).
  for (std::int64_t c = 0; c < V; ++c) row[c] = Eigen::bfloat16(std::sin(0.001f * c) * 3.0f);
  for (std::int64_t n = 0; n < N; ++n)
    ok(cudaMemcpy(dx.ptr + n * V, row.data() + 0, sizeof(Eigen::bfloat16) * V,
                  cudaMemcpyHostToDevice));
  dbuf<std::int64_t> dy(y);
  dbuf<float> drows(N), dl(1);
  dbuf<char> ws(xent::cuda_workspace_size(N));
  xent::cuda exec{nullptr, ws.ptr, ws.n, nullptr};
  xent::options opts;
  opts.reduce = xent::reduction::sum;
  xent::forward_outputs out;
  out.loss = dl.ptr;
  out.row_loss = {drows.ptr, N};
  xent::forward_backward(exec, xent::matrix_view<Eigen::bfloat16>(dx.ptr, N, V),
                         xent::vector_view<const std::int64_t>(dy.ptr, N), opts, xent::upstream{},
                         out, xent::matrix_view<Eigen::bfloat16>(dx.ptr, N, V));
  ok(cudaDeviceSynchronize());
  oracle::problem pb;
  pb.rows = 1;
  pb.cols = V;
  pb.reduce = oracle::reduction::sum;
  for (std::int64_t c = 0; c < V; ++c) pb.logits.push_back(dbl(row[c]));
  const auto rows = drows.download();
  for (std::int64_t n :
       {std::int64_t{0}, std::int64_t{16383}, std::int64_t{16384 - 2}, std::int64_t{9000}}) {
    pb.targets = {y[n]};
    oracle::upstream up;
    const auto ref = oracle::evaluate(pb, &up);
    EXPECT_NEAR(rows[n], ref.row_loss[0], 1e-4 * ref.row_loss[0]) << "row " << n;
    std::vector<Eigen::bfloat16> g(V);
    ok(cudaMemcpy(g.data(), dx.ptr + n * V, sizeof(Eigen::bfloat16) * V, cudaMemcpyDeviceToHost));
    for (std::int64_t c : {std::int64_t{0}, y[n], V - 1})
      EXPECT_NEAR(dbl(g[c]), ref.grad[c], 1e-2 * std::fabs(ref.grad[c]) + 1e-9) << n << "," << c;
  }
}

}  // namespace
