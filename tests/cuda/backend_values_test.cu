// The CUDA backend's values against the float64 oracle (tests/oracle) in every dtype: edge
// vocabulary sizes, every option, padded and misaligned rows, the shapes that send rows to each
// kernel and to each cut of a row (short rows a warp each, small batches over a cluster, long
// batches, wide rows), the small cases the sanitizers run, agreement with the CPU backend, and a
// matrix of more than 2^31 elements. Without a GPU every test skips with the reason.
//
// The one file of xent_cuda_tests that calls the CUDA entry points (backend_check.cuh says why):
// the oracle comparison, check_spec, and the calls of the other files (xent_test::calls).
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

#include "cuda/backend_check.cuh"
#include "cuda/device_util.cuh"
#include "oracle/oracle.hpp"

namespace xent_test {

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

template void check_spec<float>(const spec&);
template void check_spec<Eigen::bfloat16>(const spec&);
template void check_spec<Eigen::half>(const spec&);

namespace calls {

void forward(const xent::cuda& exec, xent::matrix_view<const float> logits, ids64 targets,
             const xent::options& opts, const xent::forward_outputs& out) {
  xent::forward(exec, logits, targets, opts, out);
}

void forward_backward(const xent::cuda& exec, xent::matrix_view<const float> logits, ids64 targets,
                      const xent::options& opts, const xent::upstream& up,
                      const xent::forward_outputs& out, xent::matrix_view<float> grad) {
  xent::forward_backward(exec, logits, targets, opts, up, out, grad);
}

void forward_backward(const xent::cuda& exec, xent::matrix_view<const bf16> logits, ids64 targets,
                      const xent::options& opts, const xent::upstream& up,
                      const xent::forward_outputs& out, xent::matrix_view<bf16> grad) {
  xent::forward_backward(exec, logits, targets, opts, up, out, grad);
}

void forward_backward(const xent::cuda& exec, xent::matrix_view<const bf16> logits, ids64 targets,
                      const xent::options& opts, const xent::upstream& up,
                      const xent::forward_outputs& out, xent::matrix_view<float> grad) {
  xent::forward_backward(exec, logits, targets, opts, up, out, grad);
}

void backward(const xent::cuda& exec, xent::matrix_view<const bf16> logits, ids64 targets,
              const xent::options& opts, xent::vector_view<const float> lse,
              const xent::upstream& up, xent::matrix_view<bf16> grad) {
  xent::backward(exec, logits, targets, opts, lse, up, grad);
}

}  // namespace calls
}  // namespace xent_test

namespace {

using xent_test::check_spec;
using xent_test::dbl;
using xent_test::dbuf;
using xent_test::ok;
using xent_test::plain_rows;
using xent_test::sm_count;
using xent_test::spec;

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

// Plain aligned rows 4 KiB longer than policy::bulk_backward_long_from_kib: the bulk backward's
// long form, over enough rows that every CTA walks more tiles than it has stages (each stage
// refilled), in place and not.
TYPED_TEST(CudaBackend, PlainLongRowsRefillEveryStageOfTheBulkBackward) {
  using xent::cuda_detail::policy;
  if constexpr (policy::bulk_backward_long_from_kib > 0) {
    constexpr std::int64_t bytes = sizeof(TypeParam),
                           tile = std::int64_t{policy::bulk_backward_regs} * policy::block * 16;
    const std::int64_t row = (std::int64_t{policy::bulk_backward_long_from_kib} << 10) + 4096;
    const std::int64_t tiles_per_row = (row + tile - 1) / tile;
    const std::int64_t ctas = std::int64_t{policy::bulk_backward_long_min_blocks} * sm_count();
    const std::int64_t rows =
        2 * (policy::bulk_backward_long_stages + 1) * ctas / tiles_per_row + 3;
    for (bool in_place : {false, true}) {
      spec s = plain_rows(rows, {row / bytes, 0}, xent::reduction::sum);
      s.in_place = in_place;
      s.seed = 4242 + in_place;
      check_spec<TypeParam>(s);
    }
  }
}

/// Small cases that compute-sanitizer memcheck / racecheck run (bench/gpu/run.sh sanitize).
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
  // Class weights with smoothing and a soft cap on rows off 16-byte boundaries: the streaming
  // backward's tiles start before each row, and those lead elements look up no class.
  spec w;
  w.rows = 23;
  w.cols = 37;
  w.smoothing = 0.1f;
  w.softcap = 4.0f;
  w.weights = true;
  w.some_ignored = true;
  check_spec<float>(w);
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
// refill as a hazard (bench/gpu/run.sh leaves it out). The non-sanitizer build runs it with the
// named-barrier hand-offs.
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

TEST(CudaBackendAgreement, MatchesTheCpuBackend) {
  REQUIRE_GPU();
  const std::int64_t N = 37, V = 32000;
  const std::vector<Eigen::bfloat16> x = xent_test::normal_bf16(N * V, 9);
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

namespace {

/// The same forward and forward_backward (out of place; every output, the argmax where `argmax`)
/// through run-time sized views and through views whose extents are R x C, on the device; both
/// results downloaded. Without the argmax and options, plain class ids take the small-batch
/// kernel, whose static form has its launch plan fixed at compile time.
template <std::int64_t R, std::int64_t C>
void expect_static_bits(const xent::options& opts, bool weighted, bool soft, bool argmax,
                        std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> x(R * C), probs(R * C, 0.0f), weights(C);
  for (float& v : x) v = normal(rng);
  for (std::int64_t c = 0; c < C; ++c) weights[c] = 0.5f + static_cast<float>(c % 7) / 4;
  std::vector<std::int64_t> ids(R);
  for (std::int64_t n = 0; n < R; ++n) {
    ids[n] = n % 5 == 4 ? opts.ignore_index : (n * 7919) % C;
    probs[n * C + (n * 7919) % C] = 0.75f;
    probs[n * C + (n * 104729) % C] += 0.25f;
  }
  dbuf<float> d_x(x), d_probs(probs), d_w(weights);
  dbuf<std::int64_t> d_ids(ids);
  dbuf<char> ws(xent::cuda_workspace_size(R));
  xent::cuda exec;
  exec.workspace = ws.ptr;
  exec.workspace_bytes = ws.n;
  xent::options o = opts;
  if (weighted) o.class_weights = {d_w.ptr, C};
  xent::basic_options<xent::extent<C>> so;
  so.reduce = o.reduce;
  so.ignore_index = o.ignore_index;
  so.label_smoothing = o.label_smoothing;
  so.z_loss = o.z_loss;
  so.softcap = o.softcap;
  if (weighted) so.class_weights = {d_w.ptr, C};
  constexpr int outputs = 7;  // the fused call's four, then the forward's three
  std::vector<float> got[2][outputs];
  for (int pass = 0; pass < 2; ++pass) {
    dbuf<float> loss(1), row_loss(R), lse(R), grad(R * C), f_loss(1), f_row_loss(R), f_lse(R);
    dbuf<std::int64_t> arg(R);
    auto call = [&](const auto& logits, const auto& targets, const auto& options, auto out,
                    const auto& up, const auto& g) {
      if (argmax) out.argmax = decltype(out.argmax)(arg.ptr, R);
      out.loss = loss.ptr;
      out.row_loss = decltype(out.row_loss)(row_loss.ptr, R);
      out.lse = decltype(out.lse)(lse.ptr, R);
      xent::forward_backward(exec, logits, targets, options, up, out, g);
      out.loss = f_loss.ptr;
      out.row_loss = decltype(out.row_loss)(f_row_loss.ptr, R);
      out.lse = decltype(out.lse)(f_lse.ptr, R);
      xent::forward(exec, logits, targets, options, out);
    };
    if (pass == 0) {
      const xent::matrix_view<const float> logits(d_x.ptr, R, C);
      const xent::matrix_view<float> g(grad.ptr, R, C);
      if (soft)
        call(logits, xent::soft(xent::matrix_view<const float>(d_probs.ptr, R, C)), o,
             xent::forward_outputs{}, xent::upstream{}, g);
      else
        call(logits, xent::vector_view<const std::int64_t>(d_ids.ptr, R), o,
             xent::forward_outputs{}, xent::upstream{}, g);
    } else {
      using rows = xent::extent<R>;
      using shape = xent::extents<R, C>;
      const xent::matrix_view<const float, shape> logits(d_x.ptr);
      const xent::matrix_view<float, shape> g(grad.ptr);
      if (soft)
        call(logits, xent::soft(xent::matrix_view<const float, shape>(d_probs.ptr)), so,
             xent::basic_forward_outputs<float, rows>{}, xent::basic_upstream<float, rows>{}, g);
      else
        call(logits, xent::vector_view<const std::int64_t, rows>(d_ids.ptr), so,
             xent::basic_forward_outputs<float, rows>{}, xent::basic_upstream<float, rows>{}, g);
    }
    ok(cudaDeviceSynchronize());
    dbuf<float>* bufs[outputs] = {&loss, &row_loss, &lse, &grad, &f_loss, &f_row_loss, &f_lse};
    for (int k = 0; k < outputs; ++k) got[pass][k] = bufs[k]->download();
  }
  const char* names[outputs] = {"loss",         "row_loss",         "lse",        "grad",
                                "forward loss", "forward row_loss", "forward lse"};
  for (int k = 0; k < outputs; ++k)
    EXPECT_EQ(std::memcmp(got[0][k].data(), got[1][k].data(), got[0][k].size() * sizeof(float)), 0)
        << names[k] << " differs, " << R << " x " << C << " soft " << soft << " argmax " << argmax
        << " seed " << seed;
}

template <std::int64_t R, std::int64_t C>
void expect_static_bits_with_every_option(std::uint64_t seed) {
  for (auto red : {xent::reduction::mean, xent::reduction::sum, xent::reduction::none})
    for (int variant = 0; variant < 5; ++variant) {
      xent::options o;
      o.reduce = red;
      o.label_smoothing = variant == 1 || variant == 3 ? 0.1f : 0.0f;
      o.z_loss = variant == 2 ? 1e-3f : 0.0f;
      o.softcap = variant == 2 ? 30.0f : 0.0f;
      // Variant 4: plain class ids, the small-batch kernel's calls.
      expect_static_bits<R, C>(o, variant == 1 || variant == 3, variant == 3, variant != 4, ++seed);
    }
}

TEST(CudaStaticExtents, SeedShapesGiveTheBitsOfRunTimeSizedViews) {
  REQUIRE_GPU();
  expect_static_bits_with_every_option<32, 32000>(10);
  expect_static_bits_with_every_option<128, 32000>(20);
  expect_static_bits_with_every_option<32, 50257>(30);
}

}  // namespace
