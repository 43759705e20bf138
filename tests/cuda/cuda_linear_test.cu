// Fused linear cross-entropy on CUDA (cuda/linear.cuh), judged by the float64 linear oracle with
// the CPU tests' cases and error bounds (tests/cpu/linear_harness.hpp): every loss option, bias or
// not, ignored rows (some, all), per-row upstream gradients, odd V and D, float / bf16 / fp16 and
// mixed gradient dtypes, both d_weight accumulations, workspaces from the minimal one to one chunk
// and many chunks; CPU agreement; the workspace and handle errors; stream capture; determinism.
// Without a GPU every test skips with the reason.
//
// The tests every backend runs are cpu/linear_backend_tests.hpp's, instantiated here over
// xent_test::device_memory. The CUDA backend keeps a chunk's logits and their gradient in the
// inputs' dtype, so its bounds add one rounding of each to the CPU's (xtl::stored_in<T>).
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#include <xent/xent.hpp>

#include "cpu/linear_backend_tests.hpp"
#include "cpu/linear_harness.hpp"
#include "cpu/linear_sparse_harness.hpp"
#include "cuda/device_util.cuh"
#include "cuda/linear_device.cuh"

namespace {

using namespace xtl;  // NOLINT(google-build-using-namespace): the shared linear test vocabulary
// CUDA declares a global `half`; the test names Eigen's fp16 type this way.
using fp16 = xt::half;
using xent::cuda_detail::linear_panel_min_cols;
using xent::cuda_detail::linear_panel_tile;
using xent::cuda_detail::plan_low_memory;
using xent_test::dbuf;
using xent_test::device_gradients;
using xent_test::device_inputs;
using xent_test::device_memory;
using xent_test::device_outputs;
using xent_test::device_workspace;
using xent_test::ok;
using xent_test::result_bytes;

/// "N x D x V", a plan test's trace.
std::string shape_name(const xent::linear_shape& s) {
  return std::to_string(s.rows) + " x " + std::to_string(s.hidden) + " x " +
         std::to_string(s.vocab);
}

/// A cuBLAS handle per test (the caller's, as xent requires), bound to the default stream: the
/// backend of the shared tests (xent_test::device_memory) set up and torn down around each test.
class CudaLinearTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_.set_up(); }
  void TearDown() override { backend_.tear_down(); }
  xent::cuda exec(int* error_count = nullptr) const {
    xent::cuda e;
    e.error_count = error_count;
    e.cublas = backend_.handle;
    return e;
  }
  device_memory backend_;
};

// Host-only (runs without a GPU): chunk rows as the GEMMs tile them.
TEST(CudaLinearPlan, ChunksAreEqualWholeGemmTilesWhereTheyFit) {
  using xent::cuda_detail::gemm_friendly_rows;
  EXPECT_EQ(gemm_friendly_rows(8192, 1046), 1024);   // 8 x 1024, not 7 x 1046 + 870
  EXPECT_EQ(gemm_friendly_rows(16384, 524), 512);    // 32 x 512, not 31 x 524 + 140
  EXPECT_EQ(gemm_friendly_rows(16384, 2304), 2048);  // 8 x 2048, not 7 x 2304 + 256
  EXPECT_EQ(gemm_friendly_rows(1100, 280), 256);     // 4 x 275 rounds up past 280: 256 instead
  EXPECT_EQ(gemm_friendly_rows(1000, 1000), 1000);   // one chunk of every row
  EXPECT_EQ(gemm_friendly_rows(1000, 255), 255);     // under two tiles: as many as fit
  for (std::int64_t rows : {257, 1000, 4097, 8192, 16384, 100000})
    for (std::int64_t most : {256, 300, 511, 1046, 2304, 5000}) {
      const std::int64_t r = gemm_friendly_rows(rows, most);
      EXPECT_LE(r, most) << rows << " rows, " << most << " at most";
      if (most < rows) EXPECT_EQ(r % 128, 0) << rows << " rows, " << most << " at most";
    }
  // What a call plans: the default budget at 8192 x 4096 x 128256 in bf16 holds 1046 rows, taken
  // as eight chunks of 1024.
  const xent::cuda exec;
  const auto sizes =
      xent::linear_workspace_size<bf16>(exec, {8192, 4096, 128256}, xent::linear_pass::forward, {});
  EXPECT_EQ(sizes.chunk_rows, 1024);
}

// Host-only (runs without a GPU): plans at the edges of the shapes a call accepts.
TEST(CudaLinearPlan, NoClassesAndMoreRowsThanCublasTakes) {
  using xent::cuda_detail::plan_linear;
  const auto fp32 = xent::dw_accumulation::fp32;
  // V = 0 (no rows, or a forward's size query): logits rows of no bytes divided the room by zero.
  for (std::int64_t rows : {0, 5}) {
    const auto p = plan_linear<bf16, bf16>({rows, 4, 0}, xent::linear_pass::forward, fp32,
                                           std::size_t{1} << 20, std::size_t{1} << 20);
    EXPECT_LE(p.chunk_rows, std::max<std::int64_t>(rows, 1)) << rows;
  }
  const auto t = plan_linear<bf16, bf16>({0, 4, 0}, xent::linear_pass::training, fp32,
                                         std::size_t{1} << 20, std::size_t{1} << 20);
  EXPECT_GE(t.chunk_rows, 0);
  // More rows than cuBLAS's int: chunks of at most INT_MAX rows, whole 128-row tiles.
  const std::int64_t rows = std::int64_t{3} << 30;
  const auto big = plan_linear<bf16, bf16>({rows, 8, 1}, xent::linear_pass::forward, fp32,
                                           std::size_t{200} << 30);
  EXPECT_LE(big.chunk_rows, std::int64_t{INT_MAX});
  EXPECT_EQ(big.chunk_rows % 128, 0);
  EXPECT_GE(big.chunk_rows, rows / 2);  // two chunks, not more
}

// Host-only (runs without a GPU): a low-memory call given the bytes its size query answered plans
// the chunk the query planned, though one sub-chunk of every row (no float panel of d_weight) can
// take fewer bytes than a split into slightly smaller sub-chunks.
TEST(CudaLinearPlan, LowMemoryCallsPlanWhatTheQueryAnswered) {
  using xent::cuda_detail::plan_low_memory;
  const xent::cuda exec;
  xent::linear_options opts;
  opts.order = xent::linear_order::low_memory;
  for (const xent::linear_shape& s :
       {xent::linear_shape{8192, 4096, 128256}, xent::linear_shape{16384, 2304, 256000},
        xent::linear_shape{1000, 512, 32000}, xent::linear_shape{4096, 64, 8192}})
    for (std::size_t budget :
         {std::size_t{64} << 20, xent::linear_default_budget, std::size_t{1} << 30}) {
      const auto sizes =
          xent::linear_workspace_size<bf16>(exec, s, xent::linear_pass::training, opts, budget);
      const auto plan = plan_low_memory<bf16, bf16>(s, sizes.bytes);
      EXPECT_EQ(std::min(plan.panel.chunk_rows, s.rows), sizes.chunk_rows)
          << s.rows << " x " << s.hidden << " x " << s.vocab << ", budget " << budget;
      EXPECT_LE(plan.bytes, sizes.bytes);
    }
  // Every row in one sub-chunk at the default budget, 8192 x 4096 x 128256 bf16.
  EXPECT_EQ(xent::linear_workspace_size<bf16>(exec, {8192, 4096, 128256},
                                              xent::linear_pass::training, opts)
                .chunk_rows,
            8192);
}

// Host-only (runs without a GPU): the order's memory bound. At 8192 x 4096 x 128256 and
// 16384 x 2304 x 256000 in bf16 the low-memory query answers at most 256 MiB (the N x D float sum
// of d_hidden included) with one sub-chunk of every row; a call given exactly those bytes plans
// that panel, one byte less a narrower panel of every row that still fits. Widths are whole
// 256-row tiles from 1024.
TEST(CudaLinearPlan, LowMemoryQueryHoldsEveryRowWithin256MiB) {
  const xent::cuda exec;
  xent::linear_options opts;
  opts.order = xent::linear_order::low_memory;
  for (const xent::linear_shape& s :
       {xent::linear_shape{8192, 4096, 128256}, xent::linear_shape{16384, 2304, 256000}}) {
    SCOPED_TRACE(shape_name(s));
    const auto sizes =
        xent::linear_workspace_size<bf16>(exec, s, xent::linear_pass::training, opts);
    EXPECT_LE(sizes.bytes, std::size_t{256} << 20);
    EXPECT_EQ(sizes.chunk_rows, s.rows);
    const auto plan = plan_low_memory<bf16, bf16>(s, sizes.bytes);
    EXPECT_EQ(plan.bytes, sizes.bytes);
    EXPECT_EQ(plan.panel.chunk_rows, s.rows);
    EXPECT_GE(plan.cols, linear_panel_min_cols);
    EXPECT_EQ(plan.cols % linear_panel_tile, 0);
    // The next tile would not fit: the widest panel within the budget.
    const auto wider = xent::cuda_detail::make_low_memory_plan<bf16, bf16>(
        s, s.rows, plan.cols + linear_panel_tile);
    EXPECT_GT(wider.bytes, std::size_t{256} << 20);
    const auto less = plan_low_memory<bf16, bf16>(s, sizes.bytes - 1);
    EXPECT_LE(less.bytes, sizes.bytes - 1);
    EXPECT_EQ(less.panel.chunk_rows, s.rows);
    EXPECT_EQ(less.cols, plan.cols - linear_panel_tile);
    // The automatic order given those bytes runs the low-memory order (they hold less than the
    // fast order's minimal).
    xent::linear_options automatic;
    EXPECT_LT(sizes.bytes,
              xent::linear_workspace_size<bf16>(exec, s, xent::linear_pass::training, automatic)
                  .fast_minimal);
  }
}

// Host-only (runs without a GPU): more workspace gives panels as wide or wider (fewer passes over
// d_hidden's float sum), never narrower than 1024 weight rows unless V is; V = 50257 and 5000 are
// multiples of no panel width, their last panel partial; a budget below the narrowest plan of every
// row splits the rows of 1024-row panels.
TEST(CudaLinearPlan, LowMemoryPanelsWidenWithTheWorkspace) {
  const xent::cuda exec;
  xent::linear_options opts;
  opts.order = xent::linear_order::low_memory;
  for (const xent::linear_shape& s :
       {xent::linear_shape{8192, 4096, 128256}, xent::linear_shape{4096, 768, 50257},
        xent::linear_shape{9, 29, 5000}, xent::linear_shape{300, 64, 700}}) {
    SCOPED_TRACE(shape_name(s));
    const std::size_t least =
        xent::linear_workspace_size<bf16>(exec, s, xent::linear_pass::training, opts, 0).minimal;
    std::int64_t cols = 0;
    for (std::size_t bytes = least; bytes < (std::size_t{4} << 30); bytes += bytes / 3 + 1) {
      const auto p = plan_low_memory<bf16, bf16>(s, bytes);
      EXPECT_LE(p.bytes, bytes);
      EXPECT_GE(p.cols, cols) << bytes;
      cols = p.cols;
      EXPECT_GE(p.cols, std::min(s.vocab, linear_panel_min_cols)) << bytes;
      EXPECT_TRUE(p.cols == s.vocab || p.cols % linear_panel_tile == 0) << p.cols;
      // A partial last panel wherever V is not a multiple of the tile.
      if (p.cols < s.vocab && s.vocab % linear_panel_tile != 0) EXPECT_NE(s.vocab % p.cols, 0);
    }
    EXPECT_EQ(cols, s.vocab);  // 3 GiB and more hold one panel of every class
  }
  // 8192 x 4096 x 128256: the 1024-row panel of every row needs 144 MiB; less splits its rows.
  const xent::linear_shape s{8192, 4096, 128256};
  const auto narrowest = xent::cuda_detail::make_low_memory_plan<bf16, bf16>(s, s.rows, 1024);
  const auto split = plan_low_memory<bf16, bf16>(s, narrowest.bytes - (std::size_t{8} << 20));
  EXPECT_EQ(split.cols, 1024);
  EXPECT_LT(split.panel.chunk_rows, s.rows);
  EXPECT_GE(split.panel.chunk_rows, 1);
  // A query whose budget holds no plan of every row answers the 1024-row panel's plan within the
  // budget on top of its fixed buffers: here every row, as the minimal.
  const auto small = xent::linear_workspace_size<bf16>(exec, s, xent::linear_pass::training, opts,
                                                       std::size_t{64} << 20);
  EXPECT_EQ(small.bytes, narrowest.bytes);
  EXPECT_EQ(small.minimal, narrowest.bytes);
  EXPECT_EQ(small.chunk_rows, s.rows);
}

TEST_F(CudaLinearTest, GradientDtypeMayDifferFromTheInputs) {
  // Float gradients of bf16 / fp16 inputs (d_weight its own accumulator), bf16 gradients of float
  // inputs, and fp16 gradients of bf16 inputs (dw_accumulation::output stages weight blocks).
  xt::case_budget b;
  for (const lspec& s : mixed_dtype_cases())
    if (!b.record(run_case<bf16, float>(backend_, s) && run_case<fp16, float>(backend_, s) &&
                  run_case<float, bf16>(backend_, s) && run_case<bf16, fp16>(backend_, s)))
      return;
}

TEST_F(CudaLinearTest, OddSizesAndManyChunksMatchOracle) {
  // V around and past a 1024-row weight block (output mode stages blocks of 1024), D from 1 to a
  // tensor-core-unfriendly 21 and 67, more rows than several small chunks.
  xt::case_budget b;
  std::uint64_t seed = 500;
  for (std::int64_t vocab : {1, 2, 3, 255, 257, 1023, 1025})
    for (std::int64_t hidden : {1, 8, 21, 67})
      for (budget space : {budget::minimal, budget::few_rows}) {
        lspec s = make_spec(23, hidden, vocab);
        s.ce.ignore = ignore_mode::some;
        s.ce.label_smoothing = 0.05f;
        s.ce.seed = ++seed;
        s.space = space;
        s.pad = seed % 2;
        s.accumulate = seed % 3 == 0 ? xent::dw_accumulation::output : xent::dw_accumulation::fp32;
        if (!b.record(run_case<float>(backend_, s) && run_case<bf16>(backend_, s) &&
                      run_case<bf16, fp16>(backend_, s)))
          return;
      }
}

/// Shapes for the Hopper GEMM's paths: partial last row and column tiles, D below, at and past one
/// 64-column block. The last has 588 tiles of 128 x 256, more than any GPU has SMs: the GEMM's
/// persistent CTAs walk several tiles each, so its stage and staging barriers turn phase.
const std::int64_t hopper_shapes[][3] = {
    {200, 64, 300}, {129, 520, 1000}, {300, 8, 257}, {70, 136, 4100}, {300, 64, 50000}};

/// A case those paths take (bf16 with no bias), its options varied by `seed`: class weights,
/// z-loss, every reduction, int32 and int64 class ids, some rows ignored.
lspec hopper_spec(const std::int64_t (&shape)[3], budget space, std::uint64_t seed) {
  lspec s = make_spec(shape[0], shape[1], shape[2]);
  s.bias = false;
  s.space = space;
  s.ce.seed = seed;
  s.ce.ignore = ignore_mode::some;
  s.ce.weights = seed % 2 == 0;
  s.ce.z_loss = seed % 3 == 0 ? 1e-3f : 0.0f;
  s.ce.reduce = seed % 3 == 1 ? reduction::sum : seed % 3 == 2 ? reduction::none : reduction::mean;
  s.ce.kind = seed % 4 == 0 ? target_kind::int32 : target_kind::int64;
  return s;
}

/// f's outputs with no argmax or num_correct asked for (the Hopper paths take no argmax).
xent::forward_outputs without_argmax(device_outputs& f, const xt::spec& s) {
  xent::forward_outputs o = f.all(s);
  o.argmax = {};
  o.num_correct = nullptr;
  return o;
}

/// f's outputs after a call without argmax, with the argmax and num_correct the harness checks
/// taken from the oracle.
outputs fetch_with_oracle_argmax(device_outputs& f, const ldata<bf16>& L,
                                 const oracle::linear_result& r) {
  outputs got = f.fetch();
  std::int64_t correct = 0;
  for (std::int64_t n = 0; n < L.N(); ++n) {
    const bool ignored = L.d.target(n) == L.s.ce.ignore_index;
    got.argmax[n] = ignored ? -1 : r.ce.argmax[n];
    if (!ignored && r.ce.argmax[n] == L.d.target(n)) ++correct;
  }
  got.correct = correct;
  return got;
}

/// The forward by the sm_90a GEMM (cuda/stats_gemm.cuh) where a build and GPU have it: bf16, no
/// bias, smoothing, softcap or argmax / num_correct asked, D a multiple of 8. Partial last row and
/// column tiles, D below, at and past one 64-column block, class weights, ignored rows, z-loss,
/// every reduction, and a minimal workspace (one launch per few rows). The argmax the harness
/// checks is not asked for (it would take the cuBLAS path): it is filled from the oracle. Each
/// case runs twice and must give the same bits. Elsewhere the cuBLAS path answers the same cases.
TEST_F(CudaLinearTest, Bfloat16ForwardWithoutArgmaxMatchesOracle) {
  std::uint64_t seed = 900;
  for (const auto& shape : hopper_shapes)
    for (budget space : {budget::minimal, budget::all_rows}) {
      const lspec s = hopper_spec(shape, space, ++seed);
      SCOPED_TRACE(s.describe());
      const ldata<bf16> L = make_data<bf16>(s);
      const oracle::linear_problem pb = L.problem();
      const oracle::upstream up = L.d.oracle_upstream();
      const oracle::linear_result r = oracle::evaluate_linear(pb, &up);
      const bounds e = error_bounds(L, pb, r, 0.0, stored_in<bf16>());
      const device_inputs<bf16> in(L);
      dbuf<int> errors(std::vector<int>{0});
      const xent::cuda ex = exec(errors.ptr);
      auto run = [&](device_outputs& f) {
        device_workspace ws(workspace_bytes<bf16>(ex, L, xent::linear_pass::forward), seed * 16);
        in.with_targets([&](auto t) {
          xent::linear_forward(ex, in.hidden(), in.weight(), in.bias(), t, in.options(),
                               without_argmax(f, s.ce), ws.ws);
        });
        ok(cudaDeviceSynchronize());
        return fetch_with_oracle_argmax(f, L, r);
      };
      device_outputs f1(L.N()), f2(L.N());
      const outputs a = run(f1), b = run(f2);
      EXPECT_EQ("", check_outputs(L, r, e, a));
      EXPECT_EQ(std::memcmp(a.row_loss.data(), b.row_loss.data(), a.row_loss.size() * 4), 0);
      EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4), 0);
      EXPECT_TRUE(xt::same_bits(a.loss, b.loss));
      EXPECT_EQ(errors.download()[0], 0);
    }
}

/// Training by the scaled-probabilities path (cuda/scaled_probs.cuh) where a build and GPU have
/// it (bf16, no bias, smoothing, softcap or argmax asked, D a multiple of 8), the cases of the
/// forward test above with every reduction (none with per-row upstream gradients), and rows whose
/// loss passes the path's range (every third row's hidden values 24 times larger: losses of
/// hundreds of nats), which the second pass takes, or whose logits differ from the target's by more
/// than fp16's range (10^4 times larger), which the second pass takes too. The bounds add the
/// scaled hidden rows' rounding. Each case runs twice and must give the same bits. Elsewhere the
/// cross-entropy pass answers the same cases.
TEST_F(CudaLinearTest, Bfloat16TrainingWithoutArgmaxMatchesOracle) {
  std::uint64_t seed = 1900;
  for (const auto& shape : hopper_shapes)
    for (budget space : {budget::minimal, budget::all_rows})
      for (double far : {1.0, 24.0, 1e4}) {
        lspec s = hopper_spec(shape, space, ++seed);
        s.ce.up = seed % 5 < 2 ? upstream_mode::pointer_or_rows : upstream_mode::scale;
        s.accumulate = seed % 5 == 4 ? xent::dw_accumulation::output : xent::dw_accumulation::fp32;
        SCOPED_TRACE(s.describe() + " far rows x" + std::to_string(far));
        ldata<bf16> L = make_data<bf16>(s);
        for (std::int64_t n = 0; far != 1.0 && n < L.N(); n += 3)
          for (std::int64_t k = 0; k < L.D(); ++k)
            L.x[n * s.ld() + k] = xt::from_double<bf16>(far * xt::to_double(L.x[n * s.ld() + k]));
        const oracle::linear_problem pb = L.problem();
        const oracle::upstream up = L.d.oracle_upstream();
        const oracle::linear_result r = oracle::evaluate_linear(pb, &up);
        rounding stored = stored_in<bf16>();
        stored.hidden = xt::unit_roundoff<bf16>();
        double chunk_rounding = 0.0;
        const std::size_t bytes = workspace_bytes<bf16>(exec(), L, xent::linear_pass::training);
        if (s.accumulate == xent::dw_accumulation::output) {
          const auto rows =
              xent::cuda_detail::plan_linear<bf16, bf16>(
                  {L.N(), L.D(), L.V()}, xent::linear_pass::training, s.accumulate, bytes)
                  .chunk_rows;
          chunk_rounding = 2.0 * xt::unit_roundoff<bf16>() * ((L.N() + rows - 1) / rows);
        }
        const bounds e = error_bounds(L, pb, r, chunk_rounding, stored);
        const device_inputs<bf16> in(L);
        dbuf<int> errors(std::vector<int>{0});
        const xent::cuda ex = exec(errors.ptr);
        auto run = [&](device_outputs& f, device_gradients<bf16>& g) {
          device_workspace ws(bytes, seed * 16);
          in.with_targets([&](auto t) {
            xent::linear_forward_backward(ex, in.hidden(), in.weight(), in.bias(), t, in.options(),
                                          in.upstream(), without_argmax(f, s.ce), g.views(), ws.ws);
          });
          ok(cudaDeviceSynchronize());
          return fetch_with_oracle_argmax(f, L, r);
        };
        device_outputs f1(L.N()), f2(L.N());
        device_gradients<bf16> g1(s), g2(s);
        const outputs a = run(f1, g1), b = run(f2, g2);
        EXPECT_EQ("", check_outputs(L, r, e, a));
        EXPECT_EQ("", check_gradients(L, r, e, g1.fetch()));
        EXPECT_TRUE(result_bytes(a.loss, g1.fetch()) == result_bytes(b.loss, g2.fetch()));
        EXPECT_EQ(std::memcmp(a.row_loss.data(), b.row_loss.data(), a.row_loss.size() * 4), 0);
        EXPECT_EQ(errors.download()[0], 0);
      }
}

TEST_F(CudaLinearTest, RealisticVocabularyMatchesOracle) {
  // A vocabulary of the size of GPT-2's in a few chunks, bf16, mean with label smoothing.
  lspec s = make_spec(40, 96, 50257);
  s.ce.ignore = ignore_mode::some;
  s.ce.label_smoothing = 0.1f;
  s.space = budget::few_rows;
  EXPECT_TRUE(run_case<bf16>(backend_, s));
  s.ce.reduce = reduction::none;
  s.ce.up = upstream_mode::pointer_or_rows;
  s.space = budget::all_rows;
  EXPECT_TRUE(run_case<float>(backend_, s));
}

TEST_F(CudaLinearTest, ExactlyMinimalWorkspaceIsCorrectForEveryPass) {
  // One row per chunk, the workspace not one byte larger, at an odd offset from 256 bytes. With
  // the float accumulator and an unpadded 16-bit d_weight the logits go in d_weight (larger
  // chunks); a padded d_weight keeps them in the workspace, one row at a time.
  std::uint64_t seed = 40;
  for (auto mode : {xent::dw_accumulation::fp32, xent::dw_accumulation::output})
    for (reduction red : {reduction::none, reduction::mean, reduction::sum}) {
      lspec s = make_spec(9, 17, 45);
      s.pad = seed % 2 == 0;
      s.ce.reduce = red;
      s.ce.ignore = ignore_mode::some;
      s.ce.up = upstream_mode::pointer_or_rows;
      s.ce.weights = true;
      s.ce.seed = ++seed;
      s.space = budget::minimal;
      s.accumulate = mode;
      EXPECT_TRUE(run_case<bf16>(backend_, s));
      EXPECT_TRUE(run_case<float>(backend_, s));
    }
}

TEST_F(CudaLinearTest, AgreesWithTheCpuBackend) {
  // The same bf16 inputs on both backends: each within its bounds of the oracle (run_case and the
  // CPU tests), and within the sum of both bounds of each other.
  lspec s = make_spec(33, 40, 517);
  s.ce.ignore = ignore_mode::some;
  s.ce.label_smoothing = 0.1f;
  s.ce.z_loss = 1e-3f;
  s.ce.weights = true;
  s.space = budget::few_rows;
  const ldata<bf16> L = make_data<bf16>(s);
  const oracle::linear_problem pb = L.problem();
  const oracle::upstream up = L.d.oracle_upstream();
  const oracle::linear_result r = oracle::evaluate_linear(pb, &up);
  const bounds e_cpu = error_bounds(L, pb, r, 0.0);
  const bounds e_cuda = error_bounds(L, pb, r, 0.0, stored_in<bf16>());

  const xent::cpu cpu;
  std::vector<unsigned char> host_ws(workspace_bytes<bf16>(cpu, L, xent::linear_pass::training));
  outputs fc(L.N());
  gradients<bf16> gc(s);
  L.d.with_targets([&](auto t) {
    xent::linear_forward_backward(cpu, L.hidden(), L.weight(), L.bias(), t, L.options(),
                                  L.d.upstream(), fc.all(s.ce), gc.views(),
                                  {host_ws.data(), host_ws.size()});
  });

  const device_inputs<bf16> in(L);
  const xent::cuda gpu = exec();
  device_workspace ws(workspace_bytes<bf16>(gpu, L, xent::linear_pass::training), 0);
  device_outputs fg(L.N());
  device_gradients<bf16> gg(s);
  in.with_targets([&](auto t) {
    xent::linear_forward_backward(gpu, in.hidden(), in.weight(), in.bias(), t, in.options(),
                                  in.upstream(), fg.all(s.ce), gg.views(), ws.ws);
  });
  ok(cudaDeviceSynchronize());
  const outputs& f = fg.fetch();
  const gradients<bf16>& g = gg.fetch();
  EXPECT_TRUE(xt::close(f.loss, fc.loss, e_cpu.loss + e_cuda.loss)) << f.loss << " vs " << fc.loss;
  for (std::int64_t n = 0; n < L.N(); ++n)
    EXPECT_TRUE(xt::close(f.row_loss[n], fc.row_loss[n], e_cpu.row_loss[n] + e_cuda.row_loss[n]))
        << "row " << n;
  // Each gradient against the CPU's, the bound the sum of both backends' bounds.
  auto both = [](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> t(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) t[i] = a[i] + b[i];
    return t;
  };
  auto as_ref = [&](const std::vector<bf16>& v, std::int64_t rows, std::int64_t cols,
                    std::int64_t ld) {
    std::vector<double> d(rows * cols);
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) d[i * cols + j] = xt::to_double(v[i * ld + j]);
    return d;
  };
  EXPECT_EQ("", check_array("d_hidden", g.dx.data(), L.N(), L.D(), s.ld(),
                            as_ref(gc.dx, L.N(), L.D(), s.ld()), both(e_cpu.dx, e_cuda.dx)));
  EXPECT_EQ("", check_array("d_weight", g.dw.data(), L.V(), L.D(), s.ld(),
                            as_ref(gc.dw, L.V(), L.D(), s.ld()), both(e_cpu.dw, e_cuda.dw)));
  EXPECT_EQ("", check_array("d_bias", g.db.data(), 1, L.V(), L.V(), as_ref(gc.db, 1, L.V(), L.V()),
                            both(e_cpu.db, e_cuda.db)));
}

TEST_F(CudaLinearTest, MissingCublasHandleThrowsNamingIt) {
  lspec s = make_spec(4, 3, 5);
  const ldata<float> L = make_data<float>(s);
  const device_inputs<float> in(L);
  xent::cuda gpu = exec();
  gpu.cublas = nullptr;
  device_workspace ws(workspace_bytes<float>(gpu, L, xent::linear_pass::training), 0);
  device_outputs f(4);
  device_gradients<float> g(s);
  in.with_targets([&](auto t) {
    expect_error("exec.cublas", "cuBLAS handle", [&] {
      xent::linear_forward(gpu, in.hidden(), in.weight(), in.bias(), t, in.options(), f.all(s.ce),
                           ws.ws);
    });
    expect_error("exec.cublas", "cuBLAS handle", [&] {
      xent::linear_forward_backward(gpu, in.hidden(), in.weight(), in.bias(), t, in.options(),
                                    in.upstream(), f.all(s.ce), g.views(), ws.ws);
    });
  });
  ok(cudaDeviceSynchronize());
  EXPECT_EQ(f.fetch().loss, 12345.0f);
  EXPECT_TRUE(xt::same_bits(g.fetch().dw[0], xt::sentinel<float>()));
}

/// The sparse cases the CUDA kernels take: every_option's at N = 150, D = 72 (not a multiple of
/// the 32-wide k-steps), V = 600 (a part-filled 256-class block) with class-id targets and no label
/// smoothing or softcap, leading dimensions padded by 8 where every_option pads by 3, every
/// panel's rows in one sub-chunk.
std::vector<lspec> cuda_sparse_cases() {
  std::vector<lspec> out;
  for (lspec s : every_option(150, 72, 600)) {
    if (s.ce.kind == target_kind::soft || s.ce.softcap > 0 || s.ce.label_smoothing > 0) continue;
    s.ce.sigma = 1.0;
    if (s.pad) s.pad = 8;
    s.space = budget::all_rows;
    out.push_back(s);
  }
  return out;
}

TEST_F(CudaLinearTest, SparseGradientsStayWithinTheSkippedProbabilitiesBound) {
  // bf16 and fp16 by turns, with their own gradients or float ones (d_weight and d_hidden then
  // written by the tile GEMM in float).
  xt::case_budget b;
  int i = 0;
  for (const lspec& s : cuda_sparse_cases()) {
    const bool passed = i % 4 == 0   ? run_sparse_case<bf16>(backend_, s)
                        : i % 4 == 1 ? run_sparse_case<fp16>(backend_, s)
                        : i % 4 == 2 ? run_sparse_case<bf16, float>(backend_, s)
                                     : run_sparse_case<fp16, float>(backend_, s);
    ++i;
    if (!b.record(passed)) return;
  }
  EXPECT_EQ(b.cases(), 48);
}

TEST_F(CudaLinearTest, SparsePanelsAndSubChunksStayWithinTheBound) {
  // Several panels (the narrowest 1024 classes of 2600) and the fewest bytes (sub-chunks of a
  // few rows, whose tiles cut the global ones), bias and ignored rows.
  for (budget space : {budget::minimal, budget::few_rows, budget::all_rows}) {
    lspec s = make_spec(200, 64, 2600);
    s.ce.sigma = 1.0;
    s.ce.ignore = ignore_mode::some;
    s.ce.seed = 7 + static_cast<int>(space);
    s.space = space;
    EXPECT_TRUE(run_sparse_case<bf16>(backend_, s)) << static_cast<int>(space);
  }
  // No hidden columns (D = 0): every logit is its bias, and the hot tiles' gradient is formed
  // with no k-step.
  for (bool bias : {true, false}) {
    lspec s = make_spec(200, 0, 2600);
    s.ce.sigma = 1.0;
    s.bias = bias;
    EXPECT_TRUE(run_sparse_case<bf16>(backend_, s)) << "D = 0, bias " << bias;
  }
}

TEST_F(CudaLinearTest, SparseCallsTheKernelsDoNotTakeThrowNamingTheArgument) {
  auto refused = [&](auto* type, lspec s, auto&& edit, const char* argument,
                     const std::string& fragment) {
    using T = std::remove_pointer_t<decltype(type)>;
    s.order = xent::linear_order::low_memory;
    s.sparse_threshold = sparse_tau;
    const ldata<T> L = make_data<T>(s);
    const device_inputs<T> in(L);
    const xent::cuda gpu = exec();
    device_workspace ws(workspace_bytes<T>(gpu, L, xent::linear_pass::training), 0);
    device_outputs f(L.N());
    device_gradients<T> g(s);
    xent::linear_options opts = in.options();
    edit(opts);
    in.with_targets([&](auto t) {
      expect_error(argument, fragment, [&] {
        xent::linear_forward_backward(gpu, in.hidden(), in.weight(), in.bias(), t, opts,
                                      in.upstream(), f.all(s.ce), g.views(), ws.ws);
      });
      expect_error(argument, fragment, [&] {
        xent::linear_backward(gpu, in.hidden(), in.weight(), in.bias(), t, opts, f.lse_view(),
                              in.upstream(), g.views(), ws.ws);
      });
    });
    ok(cudaDeviceSynchronize());
    EXPECT_EQ(f.fetch().loss, 12345.0f);
    EXPECT_TRUE(xt::same_bits(g.fetch().dw[0], xt::sentinel<T>()));
  };
  const auto none = [](xent::linear_options&) {};
  const lspec plain = make_spec(4, 8, 5);
  refused(static_cast<float*>(nullptr), plain, none, "options.sparse_threshold", "bf16 or fp16");
  lspec soft = plain;
  soft.ce.kind = target_kind::soft;
  refused(static_cast<bf16*>(nullptr), soft, none, "options.sparse_threshold", "class-id");
  refused(
      static_cast<bf16*>(nullptr), plain, [](xent::linear_options& o) { o.label_smoothing = 0.1f; },
      "options.sparse_threshold", "label_smoothing");
  refused(
      static_cast<fp16*>(nullptr), plain, [](xent::linear_options& o) { o.softcap = 5.0f; },
      "options.sparse_threshold", "softcap");
  refused(static_cast<bf16*>(nullptr), make_spec(4, 6, 5), none, "hidden", "multiples of 8");
  lspec padded = plain;
  padded.pad = 3;
  refused(static_cast<bf16*>(nullptr), padded, none, "hidden", "multiples of 8");
}

/// Runs linear_forward_backward on one bf16 case into fresh buffers; returns loss, d_hidden and
/// d_weight as bytes. With `graph`, the call is captured on a stream and replayed twice.
std::vector<unsigned char> fused_bytes(cublasHandle_t handle, const lspec& s, bool graph) {
  const ldata<bf16> L = make_data<bf16>(s);
  const device_inputs<bf16> in(L);
  cudaStream_t stream;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // cuBLAS allocates nothing during capture when the handle has a workspace of its own.
  dbuf<unsigned char> blas_ws(std::size_t{32} << 20);
  EXPECT_EQ(cublasSetStream(handle, stream), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasSetWorkspace(handle, blas_ws.ptr, blas_ws.n), CUBLAS_STATUS_SUCCESS);
  xent::cuda gpu;
  gpu.stream = stream;
  gpu.cublas = handle;
  device_workspace ws(workspace_bytes<bf16>(gpu, L, xent::linear_pass::training), 16);
  device_outputs f(L.N());
  device_gradients<bf16> g(s);
  auto call = [&] {
    in.with_targets([&](auto t) {
      xent::linear_forward_backward(gpu, in.hidden(), in.weight(), in.bias(), t, in.options(),
                                    in.upstream(), f.all(s.ce), g.views(), ws.ws);
    });
  };
  if (graph) {
    cudaGraph_t g_;
    cudaGraphExec_t inst;
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    call();
    EXPECT_EQ(cudaStreamEndCapture(stream, &g_), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&inst, g_, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(inst, stream), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(inst, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraphExecDestroy(inst);
    cudaGraphDestroy(g_);
  } else {
    call();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  cublasSetStream(handle, nullptr);  // also drops the workspace freed below
  cudaStreamDestroy(stream);
  return result_bytes(f.fetch().loss, g.fetch());
}

TEST_F(CudaLinearTest, StreamCaptureMatchesTheDirectCallBitwise) {
  lspec s = make_spec(37, 64, 3001);
  s.ce.ignore = ignore_mode::some;
  s.ce.label_smoothing = 0.1f;
  s.space = budget::few_rows;
  const auto direct = fused_bytes(backend_.handle, s, false);
  const auto captured = fused_bytes(backend_.handle, s, true);
  EXPECT_TRUE(direct == captured);
}

TEST_F(CudaLinearTest, SameInputsGiveBitwiseSameResults) {
  lspec s = make_spec(50, 48, 2049);
  s.ce.reduce = reduction::sum;
  s.space = budget::few_rows;
  EXPECT_TRUE(fused_bytes(backend_.handle, s, false) == fused_bytes(backend_.handle, s, false));
}

/// Small cases that compute-sanitizer memcheck / racecheck run (bench/gpu/run.sh sanitize).
TEST_F(CudaLinearTest, SanitizerSmallCasesOfEveryPath) {
  lspec s = make_spec(5, 7, 300);
  s.ce.ignore = ignore_mode::some;
  s.ce.label_smoothing = 0.1f;
  s.space = budget::minimal;
  s.pad = 1;
  EXPECT_TRUE(run_case<bf16>(backend_, s));
  s.ce.kind = target_kind::soft;
  s.ce.ignore = ignore_mode::none;
  s.accumulate = xent::dw_accumulation::output;
  s.space = budget::few_rows;
  EXPECT_TRUE((run_case<float, bf16>(backend_, s)));
  EXPECT_TRUE((run_case<bf16, fp16>(backend_, s)));
}

}  // namespace

namespace xtl {
INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, LinearBackend, xent_test::device_memory);
}  // namespace xtl
