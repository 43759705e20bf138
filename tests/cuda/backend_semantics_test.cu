// The CUDA backend's semantics and errors: ignored rows and targets out of range, zero rows, one
// workspace for batches of every size in turn, where a fused call keeps each row's LSE, float
// gradients of bfloat16 logits, the arguments it rejects (a missing or overlapping workspace);
// stream capture (a CUDA graph replayed against the direct calls) and determinism (the same bits
// run after run and on every visible GPU). Without a GPU every test that needs one skips with the
// reason.
//
// The calls go through xent_test::calls (backend_check.cuh), so this file instantiates no kernel.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>
#include <xent/cuda/cuda.cuh>
#include <xent/error.hpp>
#include <xent/options.hpp>
#include <xent/views.hpp>

#include "cuda/backend_check.cuh"
#include "cuda/device_util.cuh"
#include "oracle/oracle.hpp"

namespace {

namespace calls = xent_test::calls;
using xent_test::check_spec;
using xent_test::dbl;
using xent_test::dbuf;
using xent_test::ok;
using xent_test::sm_count;
using xent_test::spec;

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
  calls::forward_backward(exec, xent::matrix_view<float>(dx.ptr, N, V),
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
            calls::forward(exec, L, Y, opts, out);
          else
            calls::forward_backward(exec, L, Y, opts, xent::upstream{}, out,
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
      calls::forward_backward(exec, L, xent::vector_view<const std::int64_t>(dy.ptr, N), opts,
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
    calls::forward_backward(exec, xent::matrix_view<Eigen::bfloat16>(d_logits.ptr, N, V), targets,
                            xent::options{}, xent::upstream{}, out,
                            xent::matrix_view<float>(d_grad.ptr, N, V));
    out.loss = d_loss_in_place.ptr;
    const xent::matrix_view<Eigen::bfloat16> in_place(d_in_place.ptr, N, V);
    calls::forward_backward(exec, in_place, targets, xent::options{}, xent::upstream{}, out,
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
  calls::forward(exec, xent::matrix_view<const float>(&dummy, 0, 10),
                 xent::vector_view<const std::int64_t>(nullptr, 0), opts, out);
  ok(cudaDeviceSynchronize());
  EXPECT_TRUE(std::isnan(dl.download()[0]));
  opts.reduce = xent::reduction::sum;
  calls::forward(exec, xent::matrix_view<const float>(&dummy, 0, 10),
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
    calls::forward(xent::cuda{}, xent::matrix_view<const float>(dx.ptr, 3, 10),
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
        calls::forward_backward(exec, logits, targets, xent::options{}, xent::upstream{}, out,
                                xent::matrix_view<float>(g.data(), 3, 10));
      else
        calls::forward(exec, logits, targets, xent::options{}, out);
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
  const std::vector<Eigen::bfloat16> x = xent_test::normal_bf16(N * V, 3);
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
  calls::forward_backward(exec, xent::matrix_view<Eigen::bfloat16>(a.ptr, N, V), T, opts,
                          xent::upstream{}, out, xent::matrix_view<Eigen::bfloat16>(a.ptr, N, V));
  ok(cudaStreamSynchronize(stream));
  const auto direct = a.download();
  const float direct_loss = la.download()[0];

  cudaGraph_t graph;
  cudaGraphExec_t inst;
  out.loss = lb.ptr;
  ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  calls::forward_backward(exec, xent::matrix_view<Eigen::bfloat16>(b.ptr, N, V), T, opts,
                          xent::upstream{}, out, xent::matrix_view<Eigen::bfloat16>(g.ptr, N, V));
  calls::backward(exec, xent::matrix_view<Eigen::bfloat16>(b.ptr, N, V), T, opts,
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
  calls::forward_backward(exec, xent::matrix_view<const float>(dx.ptr, p.N, p.V),
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

}  // namespace
