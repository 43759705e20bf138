// Fused linear cross-entropy on the CPU, judged by the float64 linear oracle
// (tests/oracle/linear_oracle.hpp): every loss option, bias or not, ignored rows, per-row upstream
// gradients, odd V and D, float / bf16 / fp16, workspaces from the minimal one to one chunk, the
// workspace and argument errors, and finite differences.
//
// The cases, data and error bounds are shared with the CUDA tests (linear_harness.hpp, which
// explains the tolerances), and so are the tests every backend runs (linear_backend_tests.hpp,
// instantiated here over cpu_memory); the CPU keeps logits and their gradient in float.
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
#include "linear_backend_tests.hpp"
#include "linear_harness.hpp"
#include "linear_host_backend.hpp"
#include "oracle/linear_oracle.hpp"

namespace {

using namespace xtl;  // NOLINT(google-build-using-namespace): the shared linear test vocabulary

/// The bytes a case's workspace gets on the CPU (see xtl::workspace_bytes).
template <class T, class G = T>
std::size_t workspace_bytes(const ldata<T>& L, xent::linear_pass pass) {
  return xtl::workspace_bytes<T, G>(xent::cpu(L.s.ce.threads), L, pass);
}

const cpu_memory host{};

TEST(CpuLinear, Float64MatchesFloat64OracleToDoublePrecisionWithEveryOption) {
  // double hidden / weight / bias: logits, GEMMs and the d_weight / d_bias sums all in double.
  xt::case_budget b;
  for (const lspec& s : every_option(19, 13, 37))
    if (!b.record(run_case<double>(host, s))) return;
  EXPECT_EQ(b.cases(), 288);
}

TEST(CpuLinear, Float64LowMemoryOrderMatchesFloat64OracleToDoublePrecisionWithEveryOption) {
  xt::case_budget b;
  for (lspec s : every_option(19, 13, 37)) {
    s.order = xent::linear_order::low_memory;
    if (!b.record(run_case<double>(host, s))) return;
  }
  EXPECT_EQ(b.cases(), 288);
}

TEST(CpuLinear, LowMemoryOrderTakesEveryGradientDtype) {
  // Each sum is in the inputs' accumulator whatever G is: d_weight panels and d_hidden's N x D sum
  // in float for bf16 gradients, the caller's float d_weight and d_hidden as their own sums.
  xt::case_budget b;
  for (lspec s : mixed_dtype_cases()) {
    s.order = xent::linear_order::low_memory;
    if (!b.record(run_case<bf16, float>(host, s) && run_case<half, float>(host, s) &&
                  run_case<float, bf16>(host, s) && run_case<double, float>(host, s) &&
                  run_case<float, double>(host, s) && run_case<bf16, half>(host, s)))
      return;
  }
}

TEST(CpuLinear, GradientDtypeMayDifferFromTheInputs) {
  // bf16 / fp16 hidden and weight with float gradients (d_weight its own accumulator), and float
  // inputs with bf16 gradients (converted rows of d_hidden, the fp32 or output d_weight).
  xt::case_budget b;
  for (const lspec& s : mixed_dtype_cases())
    if (!b.record(run_case<bf16, float>(host, s) && run_case<half, float>(host, s) &&
                  run_case<float, bf16>(host, s) && run_case<double, float>(host, s) &&
                  run_case<float, double>(host, s)))
      return;
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
        if (!b.record(run_case<float>(host, s) && run_case<bf16>(host, s))) return;
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
    EXPECT_TRUE(run_case<bf16>(host, s));
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
  xent::linear_options fast;  // the fast order's plans
  fast.order = xent::linear_order::fast;
  const auto all =
      xent::linear_workspace_size<float>(exec, shape, train, fast, std::size_t{1} << 40);
  EXPECT_EQ(all.chunk_rows, 1000);
  EXPECT_GE(all.bytes, 1000u * 5003u * 4u);  // the whole logits matrix in float
  const auto least = xent::linear_workspace_size<float>(exec, shape, train, fast, 0);
  EXPECT_EQ(least.chunk_rows, 1);
  EXPECT_EQ(least.bytes, least.minimal);
  EXPECT_EQ(least.minimal, all.minimal);
  // The budget is for the chunk's buffers; the fixed ones (here the bias block and per-thread
  // weight blocks of a float call: none grow with the chunk) come on top.
  const auto fixed = xent::cpu_detail::make_linear_plan<float, float>(
      exec, shape, train, xent::dw_accumulation::fp32, 0);
  for (std::size_t budget : {std::size_t{1}, std::size_t{1} << 20, std::size_t{4} << 20}) {
    const auto s = xent::linear_workspace_size<float>(exec, shape, train, fast, budget);
    EXPECT_GE(s.chunk_rows, 1);
    if (s.chunk_rows > 1) {
      EXPECT_LE(s.bytes, fixed.bytes + budget);
    }
    // One more row would not fit.
    const auto more = xent::cpu_detail::make_linear_plan<float, float>(
        exec, shape, train, xent::dw_accumulation::fp32, s.chunk_rows + 1);
    EXPECT_GT(more.bytes, fixed.bytes + budget);
  }
  // The fp32 d_weight accumulator of a bf16 d_weight costs 4 V D bytes; a float d_weight is its
  // own accumulator; the lower-memory mode needs none.
  xent::linear_options lo = fast;
  lo.accumulate = xent::dw_accumulation::output;
  const auto bf_fp32 = xent::linear_workspace_size<bf16>(exec, shape, train, fast, 0);
  const auto bf_out = xent::linear_workspace_size<bf16>(exec, shape, train, lo, 0);
  EXPECT_GE(bf_fp32.minimal - bf_out.minimal, 5003u * 64u * 4u - 2u * 256u * 64u * 4u);
  EXPECT_LT(least.minimal, 5003u * 64u * 4u);
  // Forward needs no gradient buffers.
  EXPECT_LT(xent::linear_workspace_size<bf16>(exec, shape, xent::linear_pass::forward).minimal,
            bf_out.minimal);
}

TEST(CpuLinearWorkspace, FrozenHeadNeedsNoWeightAccumulator) {
  // No d_weight: the fp32 accumulator (4 V D bytes) is neither planned nor required, so the
  // lower-memory mode's minimum is enough, and the gradients are those of a large workspace.
  lspec s = make_spec(8, 64, 5003);
  const ldata<bf16> L = make_data<bf16>(s);
  const xent::cpu exec;
  xent::linear_options out_mode = L.options();
  out_mode.accumulate = xent::dw_accumulation::output;
  const auto train = xent::linear_pass::training;
  const auto fp32 = xent::linear_workspace_size<bf16>(exec, {8, 64, 5003}, train, L.options(), 0);
  const auto least = xent::linear_workspace_size<bf16>(exec, {8, 64, 5003}, train, out_mode, 0);
  ASSERT_GT(fp32.minimal, least.minimal);  // the accumulator
  std::vector<bf16> dx[2];
  for (int big = 0; big < 2; ++big) {
    workspace_buffer ws(big ? std::size_t{1} << 24 : least.minimal, 0);
    gradients<bf16> g(s);
    xent::linear_grads<bf16> views = g.views();
    views.d_weight = {};
    L.d.with_targets([&](auto t) {
      xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, L.options(),
                                    L.d.upstream(), xent::forward_outputs{}, views, ws.ws);
    });
    EXPECT_TRUE(xt::same_bits(g.dw[0], xt::sentinel<bf16>())) << "d_weight was not asked for";
    dx[big] = g.dx;
  }
  for (std::size_t i = 0; i < dx[0].size(); ++i)
    EXPECT_NEAR(static_cast<float>(dx[0][i]), static_cast<float>(dx[1][i]),
                1e-2f * (1.0f + std::fabs(static_cast<float>(dx[1][i]))))
        << i;
  // One byte fewer than that minimum still names the workspace.
  workspace_buffer small(least.minimal - 1, 0);
  gradients<bf16> g(s);
  xent::linear_grads<bf16> views = g.views();
  views.d_weight = {};
  L.d.with_targets([&](auto t) {
    expect_error("workspace", std::to_string(least.minimal), [&] {
      xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, L.options(),
                                    L.d.upstream(), xent::forward_outputs{}, views, small.ws);
    });
  });
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
  // d_hidden inside the workspace (a workspace claimed from d_hidden's address onwards would
  // also cover whatever the heap put after it, the outputs among them).
  auto in_ws = G;
  in_ws.d_hidden.data = static_cast<float*>(ws.ws.data) + 16;
  expect_error("grads.d_hidden", "overlaps workspace", fb(X, W, B, t, opts, up, in_ws, ws.ws));
  expect_error("workspace", "null data", fb(X, W, B, t, opts, up, G, {nullptr, 64}));
  // A gradient with a size and no data is a mistake, not a gradient nobody asked for.
  for (int k = 0; k < 3; ++k) {
    auto null_grad = G;
    if (k == 0) null_grad.d_hidden.data = nullptr;
    if (k == 1) null_grad.d_weight.data = nullptr;
    if (k == 2) null_grad.d_bias.data = nullptr;
    const char* names[] = {"grads.d_hidden", "grads.d_weight", "grads.d_bias"};
    expect_error(names[k], "null data", fb(X, W, B, t, opts, up, null_grad, ws.ws));
  }
  // Class ids, outputs, a saved LSE and upstream gradients are read again after the call has
  // started writing: none may lie in what it writes.
  const auto* ids_in_ws = static_cast<const std::int64_t*>(ws.ws.data);
  expect_error("workspace", "overlaps targets", fb(X, W, B, {ids_in_ws, 4}, opts, up, G, ws.ws));
  auto none_opts = opts;
  none_opts.reduce = reduction::none;
  auto none_spec = s.ce;
  none_spec.reduce = reduction::none;
  xent::upstream rows_in_dw;
  rows_in_dw.rows = {G.d_weight.data + 1, 4};
  expect_error("grads.d_weight", "overlaps upstream.rows", [&] {
    xent::linear_forward_backward(exec, X, W, B, t, none_opts, rows_in_dw, f.all(none_spec), G,
                                  ws.ws);
  });
  expect_error("grads.d_weight", "overlaps lse", [&] {
    xent::linear_backward(exec, X, W, B, t, opts, {G.d_weight.data, 4}, up, G, ws.ws);
  });
  expect_error("outputs.lse", "overlaps workspace", [&] {
    auto o = f.all(s.ce);
    o.lse = {static_cast<float*>(ws.ws.data) + 2, 4};
    xent::linear_forward(exec, X, W, B, t, opts, o, ws.ws);
  });
  // Shapes whose sizes the plans could not compute: a 2^62-row weight of no columns is a valid
  // view, but its N x V logits are not.
  expect_error("weight", "at most 2^59", [&] {
    xent::linear_forward(exec, xent::matrix_view<const float>(nullptr, 1, 0),
                         xent::matrix_view<const float>(nullptr, std::int64_t{1} << 62, 0),
                         xent::vector_view<const float>{},
                         xent::vector_view<const std::int64_t>(t.data, 1), opts, f.all(s.ce),
                         ws.ws);
  });
  expect_error("shape", "at most 2^59", [&] {
    xent::linear_workspace_size<Eigen::bfloat16>(
        exec, {1, std::int64_t{1} << 31, std::int64_t{1} << 31}, xent::linear_pass::training);
  });
  auto bad_accumulate = opts;
  bad_accumulate.accumulate = static_cast<xent::dw_accumulation>(9);
  expect_error("options.accumulate", "fp32, output", [&] {
    xent::linear_workspace_size<float>(exec, {4, 3, 5}, xent::linear_pass::training,
                                       bad_accumulate);
  });
  auto bad_order = opts;
  bad_order.order = static_cast<xent::linear_order>(7);
  expect_error("options.order", "automatic, fast, low_memory", [&] {
    xent::linear_workspace_size<float>(exec, {4, 3, 5}, xent::linear_pass::training, bad_order);
  });
  expect_error("options.order", "automatic, fast, low_memory",
               [&] { xent::linear_forward(exec, X, W, B, t, bad_order, f.all(s.ce), ws.ws); });
  expect_error("options.order", "automatic, fast, low_memory", [&] {
    xent::vocab_parallel_linear_workspace_size<float>(exec, {4, 3, 5}, 5, 1,
                                                      xent::linear_pass::training, bad_order);
  });
  expect_error("pass", "forward, training", [&] {
    xent::linear_workspace_size<float>(exec, {4, 3, 5}, static_cast<xent::linear_pass>(5));
  });
  expect_error("pass", "forward, training", [&] {
    xent::vocab_parallel_linear_workspace_size<float>(exec, {4, 3, 5}, 5, 1,
                                                      static_cast<xent::linear_pass>(5));
  });

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

/// The objective of xent's own float64 linear forward (the reduced loss times the scalar upstream,
/// or sum_n g_n l_n under none).
double xent_linear_objective(const ldata<double>& L, const oracle::upstream& up) {
  basic_outputs<double> o(L.N());
  workspace_buffer ws(workspace_bytes(L, xent::linear_pass::forward), 0);
  L.d.with_targets([&](auto t) {
    xent::linear_forward(xent::cpu{}, L.hidden(), L.weight(), L.bias(), t, L.options(),
                         o.all(L.s.ce), ws.ws);
  });
  if (L.s.ce.reduce != reduction::none) return up.scale * o.loss;
  double sum = 0.0;
  for (std::int64_t n = 0; n < L.N(); ++n)
    sum += (up.rows.empty() ? up.scale : up.rows[n]) * o.row_loss[n];
  return sum;
}

TEST(CpuLinearGradientCheck, Float64GradientsMatchCentralDifferencesOfTheirOwnLoss) {
  // d_hidden, d_weight and d_bias in double against central differences (step 1e-6) of xent's
  // own float64 loss: ~1e-10 of the terms apart, so 1e-8 holds and float arithmetic fails it.
  for (const lspec& s : gradient_check_cases()) {
    ldata<double> L = make_data<double>(s);
    const oracle::upstream up = L.d.oracle_upstream();
    workspace_buffer ws(workspace_bytes(L, xent::linear_pass::training), 3);
    gradients<double> g(s);
    L.d.with_targets([&](auto t) {
      xent::linear_forward_backward(xent::cpu{}, L.hidden(), L.weight(), L.bias(), t, L.options(),
                                    L.d.upstream(), xent::basic_forward_outputs<double>{},
                                    g.views(), ws.ws);
    });
    struct part {
      const char* name;
      std::vector<double> ldata<double>::*input;
      const std::vector<double>* got;
    };
    const part parts[] = {{"dx", &ldata<double>::x, &g.dx},
                          {"dw", &ldata<double>::w, &g.dw},
                          {"db", &ldata<double>::b, &g.db}};
    for (const part& p : parts) {
      std::vector<double>& v = L.*p.input;
      std::vector<double> fd(v.size());
      double scale = 0;
      for (std::size_t i = 0; i < v.size(); ++i) {
        const double x = v[i], h = 1e-6 * (1.0 + std::fabs(x));
        v[i] = x + h;
        const double plus = xent_linear_objective(L, up);
        v[i] = x - h;
        const double minus = xent_linear_objective(L, up);
        v[i] = x;
        fd[i] = (plus - minus) / (2 * h);
        scale = std::max(scale, std::fabs(fd[i]));
      }
      for (std::size_t i = 0; i < fd.size(); ++i)
        ASSERT_NEAR((*p.got)[i], fd[i], 1e-8 * (1.0 + scale))
            << "xent " << p.name << "[" << i << "], " << s.describe();
    }
  }
}

}  // namespace

namespace xtl {
INSTANTIATE_TYPED_TEST_SUITE_P(Cpu, LinearBackend, cpu_memory);
}  // namespace xtl
