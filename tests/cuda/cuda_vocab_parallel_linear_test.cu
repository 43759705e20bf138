// Vocab-parallel fused linear cross-entropy on CUDA (cuda/vocab_parallel_linear.cuh), with the CPU
// test's cases and checks (tests/cpu/vocab_parallel_linear_harness.hpp): forward, forward_backward
// and backward from forward's LSE on every rank, every rank's forward outputs bitwise equal, the
// d_weight / d_bias shards and the sum of the partial d_hidden held to the float64 linear oracle
// and to the unsharded CUDA linear calls in the fast order (the training calls run either order).
// Ranks run as threads on one GPU through the host-staged group (tests/cuda/groups.cuh), and over
// NCCL: one rank (also under stream capture) and every visible GPU when there are two or more.
// Device errors (a bad tiling), the workspace, handle and stream errors. Without a GPU every test
// skips with the reason.
//
// The CUDA backend keeps a chunk's logits and their gradient in the inputs' dtype, so its bounds
// add one rounding of each to the CPU's (xtl::stored_in<T>), as the CUDA linear tests do.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>
#include <xent/xent.hpp>

#include "cpu/linear_harness.hpp"
#include "cpu/vocab_parallel_linear_backend_tests.hpp"
#include "cpu/vocab_parallel_linear_harness.hpp"
#include "cpu/vocab_split.hpp"
#include "cuda/device_util.cuh"
#include "cuda/groups.cuh"
#include "cuda/linear_device.cuh"

namespace {

using namespace xtl;  // NOLINT(google-build-using-namespace): the shared linear test vocabulary
using xent::linear_pass;
// CUDA declares a global `half`; the test names Eigen's fp16 type this way.
using fp16 = xt::half;
using xent_test::dbuf;
using xent_test::device_gradients;
using xent_test::device_inputs;
using xent_test::device_outputs;
using xent_test::device_workspace;
using xent_test::ok;
using xent_test::result_bytes;
using xent_test::staged_group;

/// A cuBLAS handle on the current device, bound to `stream`, destroyed at the end.
struct blas_handle {
  cublasHandle_t h = nullptr;
  explicit blas_handle(cudaStream_t stream) {
    EXPECT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasSetStream(h, stream), CUBLAS_STATUS_SUCCESS);
  }
  ~blas_handle() { cublasDestroy(h); }
  blas_handle(const blas_handle&) = delete;
};

/// One rank's three calls on the device and stream of `group`, with a handle of its own; its
/// results copied back into `out`, its device error count into `errors`. `in` is the rank's case
/// (xvl::shard_of).
template <class T, class G, class Group>
void run_rank(const ldata<T>& L, const ldata<T>& in, const xt::split& sp, const Group& group,
              xvl::rank_result<G>& out, int& errors) {
  const int r = group.rank();
  const blas_handle blas(group.stream());
  const device_inputs<T> d(in);
  dbuf<int> count(std::vector<int>{0});
  xent::cuda exec;
  exec.stream = group.stream();
  exec.error_count = count.ptr;
  exec.cublas = blas.h;
  const xent::linear_options opts = d.options();
  const xent::vocab_shard shard{sp.first(r), L.V()};
  const auto fq = xvl::workspace_for<T, T>(exec, L, in.V(), sp.ranks(), linear_pass::forward);
  const auto tq = xvl::workspace_for<T, G>(exec, L, in.V(), sp.ranks(), linear_pass::training);
  device_workspace fws(fq.bytes, L.s.ce.seed * 16 + r);
  device_workspace tws(tq.bytes, L.s.ce.seed * 16 + 8 + r);
  device_outputs fwd(L.N()), fb(L.N());
  device_gradients<G> gfb(in.s), gb(in.s);
  ok(cudaDeviceSynchronize());  // the buffers' fills, made on the default stream, are done
  d.with_targets([&](auto t) {
    xent::vocab_parallel_linear_forward(exec, group, d.hidden(), d.weight(), d.bias(), shard, t,
                                        opts, fwd.all(L.s.ce), xvl::vp_workspace(fws.ws, fq));
    xent::vocab_parallel_linear_forward_backward(exec, group, d.hidden(), d.weight(), d.bias(),
                                                 shard, t, opts, d.upstream(), fb.all(L.s.ce),
                                                 gfb.views(), xvl::vp_workspace(tws.ws, tq));
    xent::vocab_parallel_linear_backward(exec, group, d.hidden(), d.weight(), d.bias(), shard, t,
                                         opts, xent::vector_view<const float>(fwd.lse.ptr, L.N()),
                                         d.upstream(), gb.views(), xvl::vp_workspace(tws.ws, tq));
  });
  ok(cudaStreamSynchronize(group.stream()));
  out.fwd = fwd.fetch();
  out.fb = fb.fetch();
  out.gfb = gfb.fetch();
  out.gb = gb.fetch();
  errors = count.download()[0];
}

/// The same three calls unsharded (linear.hpp) on the current device's default stream.
template <class T, class G>
xvl::rank_result<G> run_unsharded(const ldata<T>& L) {
  xvl::rank_result<G> u(L.s);
  const blas_handle blas(nullptr);
  const device_inputs<T> d(L);
  xent::cuda exec;
  exec.cublas = blas.h;
  device_workspace fws(workspace_bytes<T>(exec, L, linear_pass::forward), 0);
  device_workspace tws(workspace_bytes<T, G>(exec, L, linear_pass::training), 0);
  device_outputs fwd(L.N()), fb(L.N());
  device_gradients<G> gfb(L.s), gb(L.s);
  d.with_targets([&](auto t) {
    xent::linear_forward(exec, d.hidden(), d.weight(), d.bias(), t, d.options(), fwd.all(L.s.ce),
                         fws.ws);
    xent::linear_forward_backward(exec, d.hidden(), d.weight(), d.bias(), t, d.options(),
                                  d.upstream(), fb.all(L.s.ce), gfb.views(), tws.ws);
    xent::linear_backward(exec, d.hidden(), d.weight(), d.bias(), t, d.options(),
                          xent::vector_view<const float>(fwd.lse.ptr, L.N()), d.upstream(),
                          gb.views(), tws.ws);
  });
  ok(cudaDeviceSynchronize());
  u.fwd = fwd.fetch();
  u.fb = fb.fetch();
  u.gfb = gfb.fetch();
  u.gb = gb.fetch();
  return u;
}

/// Every rank's results on `sp`, ranks as threads on the current GPU (staged_group).
template <class T, class G>
std::vector<xvl::rank_result<G>> run_staged(const ldata<T>& L, const xt::split& sp,
                                            std::vector<int>& errors) {
  const std::vector<ldata<T>> shards = xvl::shards_of(L, sp);
  std::vector<xvl::rank_result<G>> res;
  for (const ldata<T>& in : shards) res.emplace_back(in.s);
  errors.assign(static_cast<std::size_t>(sp.ranks()), 0);
  xent_test::on_staged_ranks(sp.ranks(), [&](const staged_group& g) {
    run_rank(L, shards[g.rank()], sp, g, res[g.rank()], errors[g.rank()]);
  });
  return res;
}

std::int64_t chunks(std::int64_t rows, std::int64_t chunk_rows) {
  return (rows + chunk_rows - 1) / std::max<std::int64_t>(chunk_rows, 1);
}

/// The results of every rank (`run(L, sp, errors)`) of one case on one split: the ranks agree and
/// count no device error; against the oracle; against the unsharded CUDA calls. Returns whether
/// everything passed.
template <class T, class G = T, class Run>
bool check_case(const lspec& s, const xt::split& sp, const Run& run) {
  const ldata<T> L = make_data<T>(s);
  const oracle::linear_problem pb = L.problem();
  const oracle::upstream up = L.d.oracle_upstream();
  const oracle::linear_result r = oracle::evaluate_linear(pb, &up);
  double chunk_rounding = 0.0;  // d_weight rounded per chunk (dw_accumulation::output, G narrow)
  if (s.accumulate == xent::dw_accumulation::output && !std::is_same<G, float>::value) {
    const xent::cuda exec;
    const auto vp =
        xvl::workspace_for<T, G>(exec, L, sp.cols(0), sp.ranks(), linear_pass::training);
    const auto single = xent::cuda_detail::plan_linear<T, G>(
        {L.N(), L.D(), L.V()}, linear_pass::training, s.accumulate,
        workspace_bytes<T, G>(exec, L, linear_pass::training));
    chunk_rounding = 2.0 * xt::unit_roundoff<G>() *
                     std::max(chunks(L.N(), vp.chunk_rows), chunks(L.N(), single.chunk_rows));
  }
  const bounds e = error_bounds(L, pb, r, chunk_rounding, stored_in<T>());
  std::vector<int> errors;
  const std::vector<xvl::rank_result<G>> res = run(L, sp, errors);
  std::string out;
  auto note = [&](const char* what, const std::string& m) {
    if (!m.empty()) out += std::string(what) + ":\n" + m;
  };
  for (std::size_t k = 0; k < errors.size(); ++k)
    if (errors[k] != 0)
      note("error_count", "  rank " + std::to_string(k) + " counted " + std::to_string(errors[k]));
  note("ranks", xvl::check_ranks_agree(res));
  note("vs oracle", xvl::check_results(L, sp, res, r, e));
  note("vs unsharded",
       xvl::check_results(L, sp, res,
                          xvl::from_unsharded(r, run_unsharded<T, G>(xvl::in_fast_order(L))),
                          xvl::twice(e)));
  if (!out.empty()) {
    ADD_FAILURE() << "case " << xt::dtype_name<T>() << " -> " << xt::dtype_name<G>() << " grads, "
                  << s.describe() << ", " << sp.name() << "\n"
                  << out;
    return false;
  }
  return true;
}

template <class T, class G = T>
bool run_case(const lspec& s, const xt::split& sp) {
  return check_case<T, G>(s, sp, [](const ldata<T>& L, const xt::split& p, std::vector<int>& e) {
    return run_staged<T, G>(L, p, e);
  });
}

class CudaVocabParallelLinear : public ::testing::Test {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

/// The CUDA backend of the shared vocab-parallel linear tests
/// (cpu/vocab_parallel_linear_backend_tests.hpp): ranks as staged threads on one GPU.
struct staged_ranks {
  /// Every other every-option case in bf16 / fp16.
  static constexpr int narrow_stride = 2;
  void set_up() { REQUIRE_GPU(); }
  void tear_down() {}
  template <class T, class G = T>
  bool run(const lspec& s, const xt::split& sp) const {
    return run_case<T, G>(s, sp);
  }
};

TEST_F(CudaVocabParallelLinear, GradientDtypeMayDifferFromTheInputs) {
  // Float gradients of bf16 / fp16 inputs, bf16 gradients of float inputs, fp16 gradients of
  // bf16 inputs (dw_accumulation::output stages weight blocks), both accumulations, every
  // workspace size, on 2 and 3 ranks.
  xt::case_budget b;
  int i = 0;
  for (const lspec& s : mixed_dtype_cases()) {
    const xt::split sp = xt::splits(s.ce.cols, 2 + i % 2)[static_cast<std::size_t>(i) % 2];
    ++i;
    if (!b.record(run_case<bf16, float>(s, sp) && run_case<fp16, float>(s, sp) &&
                  run_case<float, bf16>(s, sp) && run_case<bf16, fp16>(s, sp)))
      return;
  }
}

TEST_F(CudaVocabParallelLinear, MoreRanksThanClassesAndEdgeVocabularies) {
  // V = 1, 2, 3 on 4 ranks leave shards empty; 2047 and 2049 on 2 ranks give shards of 1023 to
  // 1025 rows, around the output mode's staged block of 1024 weight rows; D = 1 and 67
  // (tensor-core-unfriendly).
  std::uint64_t seed = 300;
  for (std::int64_t vocab : {1, 2, 3, 2047, 2049})
    for (std::int64_t hidden : {1, 67}) {
      lspec s = make_spec(9, hidden, vocab);
      s.ce.ignore = ignore_mode::some;
      s.ce.label_smoothing = 0.2f;
      s.ce.weights = true;
      s.ce.seed = ++seed;
      s.space = seed % 2 ? budget::minimal : budget::few_rows;
      s.accumulate = seed % 3 ? xent::dw_accumulation::fp32 : xent::dw_accumulation::output;
      for (const xt::split& sp : xt::splits(vocab, vocab < 4 ? 4 : 2)) {
        EXPECT_TRUE(run_case<float>(s, sp));
        EXPECT_TRUE((run_case<bf16, fp16>(s, sp)));
      }
    }
}

TEST_F(CudaVocabParallelLinear, RealisticVocabularyInFewRowChunks) {
  // GPT-2's vocabulary split over 2 and 3 ranks, bf16, mean with label smoothing; then float with
  // reduction none and per-row upstream gradients in one chunk.
  lspec s = make_spec(40, 96, 50257);
  s.ce.ignore = ignore_mode::some;
  s.ce.label_smoothing = 0.1f;
  s.space = budget::few_rows;
  EXPECT_TRUE(run_case<bf16>(s, xt::even_split(50257, 2)));
  s.ce.reduce = reduction::none;
  s.ce.up = upstream_mode::pointer_or_rows;
  s.space = budget::all_rows;
  EXPECT_TRUE(run_case<float>(s, xt::splits(50257, 3)[1]));
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// A forward on 2 staged ranks of a small float case (4 rows in one-row chunks) whose arguments
/// `spoil(rank, shard, exec, workspace sizes, group's stream, another stream)` may change; returns
/// each rank's forward outputs, device error count and the argument of the xent::error it threw
/// ("" for none).
struct rank_outcome {
  outputs out{4};
  int errors = 0;
  std::string thrown;
};

template <class Spoil>
std::vector<rank_outcome> two_rank_forward(const Spoil& spoil) {
  lspec s = make_spec(4, 3, 12);
  s.space = budget::minimal;  // one-row chunks: four exchanges
  const ldata<float> L = make_data<float>(s);
  const xt::split sp = xt::even_split(12, 2);
  const std::vector<ldata<float>> shards = xvl::shards_of(L, sp);
  std::vector<rank_outcome> res(2);
  cudaStream_t other;
  ok(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  xent_test::on_staged_ranks(2, [&](const staged_group& g) {
    const int r = g.rank();
    const blas_handle blas(g.stream());
    const device_inputs<float> d(shards[r]);
    dbuf<int> count(std::vector<int>{0});
    xent::cuda exec;
    exec.stream = g.stream();
    exec.error_count = count.ptr;
    exec.cublas = blas.h;
    xent::vocab_shard shard{sp.first(r), 12};
    auto q = xvl::workspace_for<float, float>(exec, L, sp.cols(r), 2, linear_pass::forward);
    cudaStream_t group_stream = g.stream();
    spoil(r, shard, exec, q, group_stream, other);
    device_workspace ws(q.bytes, 0);
    device_outputs o(4);
    ok(cudaDeviceSynchronize());
    try {
      d.with_targets([&](auto t) {
        xent::vocab_parallel_linear_forward(exec, g.on(group_stream), d.hidden(), d.weight(),
                                            d.bias(), shard, t, d.options(), o.all(s.ce),
                                            xvl::vp_workspace(ws.ws, q));
      });
    } catch (const xent::error& e) {
      res[r].thrown = e.argument();
    }
    ok(cudaStreamSynchronize(g.stream()));
    res[r].out = o.fetch();
    res[r].errors = count.download()[0];
  });
  cudaStreamDestroy(other);
  return res;
}

// Host-only (runs without a GPU): the single-device rule per rank. At 8192 x 4096 x 128256 bf16
// on 1, 2 and 8 ranks the low-memory query answers at most 256 MiB a rank, its exchange chunks
// giving a panel of every row in whole 256-row tiles from 1024; a larger budget gives larger
// chunks and panels as wide or wider; a budget that holds no plan of every row answers the
// chunks from which the 1024-row panel takes every row.
TEST(CudaVocabParallelLinearPlan, LowMemoryQueryHoldsEveryRowWithinTheBudgetPerRank) {
  const xent::cuda exec;
  xent::linear_options opts;
  opts.order = xent::linear_order::low_memory;
  const std::int64_t N = 8192, D = 4096, V = 128256;
  for (int ranks : {1, 2, 8}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    const xent::linear_shape local{N, D, (V + ranks - 1) / ranks};
    auto plan_at = [&](std::size_t budget) {
      const auto sizes = xent::vocab_parallel_linear_workspace_size<bf16>(
          exec, local, V, ranks, linear_pass::training, opts, budget);
      const auto p = xent::cuda_detail::make_vp_linear_plan<bf16, bf16>(
          local, ranks, linear_pass::training, opts.accumulate, opts.order, sizes.chunk_rows);
      EXPECT_EQ(p.bytes, sizes.bytes);
      return std::make_pair(sizes, p.low);
    };
    const auto [sizes, low] = plan_at(xent::linear_default_budget);
    EXPECT_LE(sizes.bytes, xent::linear_default_budget);
    EXPECT_EQ(low.panel.chunk_rows, N);
    EXPECT_GE(low.cols, xent::cuda_detail::linear_panel_min_cols);
    EXPECT_TRUE(low.cols == local.vocab || low.cols % xent::cuda_detail::linear_panel_tile == 0);
    const auto [more, wide] = plan_at(std::size_t{1} << 30);
    EXPECT_GE(more.chunk_rows, sizes.chunk_rows);
    EXPECT_GE(wide.cols, low.cols);
    EXPECT_EQ(wide.panel.chunk_rows, N);
    const auto [tight, narrow] = plan_at(std::size_t{64} << 20);
    EXPECT_EQ(tight.chunk_rows, xent::cuda_detail::vp_every_row_chunk(local));
    EXPECT_EQ(narrow.cols, xent::cuda_detail::linear_panel_min_cols);
    EXPECT_EQ(narrow.panel.chunk_rows, N);
  }
}

TEST(CudaVocabParallelLinearErrors, ShardsThatDoNotTileGiveNanRowsAndAnErrorPerChunkOnEveryRank) {
  REQUIRE_GPU();
  // Rank 1 claims [4, 10) instead of [6, 12): classes 4 and 5 in two shards, 10 and 11 in none.
  const auto res = two_rank_forward([](int r, xent::vocab_shard& shard, xent::cuda&,
                                       xent::linear_workspace_sizes&, cudaStream_t&, cudaStream_t) {
    if (r == 1) shard.first = 4;
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(res[r].thrown, "");
    EXPECT_EQ(res[r].errors, 4);  // one per chunk of one row
    EXPECT_TRUE(std::isnan(res[r].out.loss));
    for (std::int64_t n = 0; n < 4; ++n) {
      EXPECT_TRUE(std::isnan(res[r].out.row_loss[n]));
      EXPECT_TRUE(std::isnan(res[r].out.lse[n]));
      EXPECT_EQ(res[r].out.argmax[n], -1);
    }
  }
}

TEST(CudaVocabParallelLinearErrors, WorkspaceHandleAndStreamAreClearErrorsBeforeAnythingIsWritten) {
  REQUIRE_GPU();
  struct expectation {
    const char* argument;
    void (*spoil)(int, xent::vocab_shard&, xent::cuda&, xent::linear_workspace_sizes&,
                  cudaStream_t&, cudaStream_t);
  };
  const expectation cases[] = {
      {"workspace", [](int, xent::vocab_shard&, xent::cuda&, xent::linear_workspace_sizes& q,
                       cudaStream_t&, cudaStream_t) { q.bytes -= 1; }},
      {"workspace.chunk_rows",
       [](int, xent::vocab_shard&, xent::cuda&, xent::linear_workspace_sizes& q, cudaStream_t&,
          cudaStream_t) { q.chunk_rows = 0; }},
      {"exec.cublas", [](int, xent::vocab_shard&, xent::cuda& exec, xent::linear_workspace_sizes&,
                         cudaStream_t&, cudaStream_t) { exec.cublas = nullptr; }},
      {"group", [](int, xent::vocab_shard&, xent::cuda&, xent::linear_workspace_sizes&,
                   cudaStream_t& gs, cudaStream_t other) { gs = other; }},
  };
  for (const expectation& c : cases) {
    SCOPED_TRACE(c.argument);
    const auto res = two_rank_forward(c.spoil);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(res[r].thrown, c.argument) << "rank " << r;
      EXPECT_EQ(res[r].out.loss, 12345.0f) << "rank " << r << ": the loss was written";
      EXPECT_EQ(res[r].out.lse[0], 12345.0f) << "rank " << r << ": an LSE was written";
    }
  }
}

#if defined(XENT_HAS_NCCL)

using xent_test::nccl_comms;

/// Every rank's results on `sp` over NCCL, rank r on device r.
template <class T, class G>
std::vector<xvl::rank_result<G>> run_nccl(const ldata<T>& L, const xt::split& sp,
                                          const nccl_comms& nc, std::vector<int>& errors) {
  const std::vector<ldata<T>> shards = xvl::shards_of(L, sp);
  std::vector<xvl::rank_result<G>> res;
  for (const ldata<T>& in : shards) res.emplace_back(in.s);
  errors.assign(static_cast<std::size_t>(sp.ranks()), 0);
  xent_test::on_nccl_ranks(nc, [&](const xent::nccl_group& g) {
    run_rank(L, shards[g.rank()], sp, g, res[g.rank()], errors[g.rank()]);
  });
  return res;
}

TEST(NcclVocabParallelLinear, OneRankGroupMatchesOracleAndUnsharded) {
  REQUIRE_GPU();
  nccl_comms nc(1);
  ASSERT_EQ(nc.comms.size(), 1u);
  int i = 0;
  for (const lspec& s : every_option(11, 16, 300)) {
    if (i++ % 24 != 0) continue;  // a dozen cases: each target kind and reduction
    EXPECT_TRUE(
        (check_case<bf16>(s, xt::even_split(300, 1),
                          [&](const ldata<bf16>& L, const xt::split& sp, std::vector<int>& e) {
                            return run_nccl<bf16, bf16>(L, sp, nc, e);
                          })));
  }
}

TEST(NcclVocabParallelLinear, GroupOverEveryVisibleGpuMatchesOracleAndUnsharded) {
  REQUIRE_GPU();
  const int gpus = std::min(xent_test::visible_gpus(), 8);
  if (gpus < 2)
    GTEST_SKIP() << "needs at least 2 GPUs for a multi-rank NCCL group; " << gpus
                 << " visible (the one-rank and staged tests cover the rest)";
  nccl_comms nc(gpus);
  ASSERT_EQ(nc.comms.size(), static_cast<std::size_t>(gpus));
  xt::case_budget b;
  auto on_nccl = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    return [&](const ldata<T>& L, const xt::split& sp, std::vector<int>& e) {
      return run_nccl<T, T>(L, sp, nc, e);
    };
  };
  int i = 0;
  for (const lspec& s : every_option(19, 24, 3001)) {
    if (i++ % 6 != 0) continue;  // 48 cases
    for (const xt::split& sp : xt::splits(3001, gpus))
      if (!b.record(i % 12 == 1 ? check_case<float>(s, sp, on_nccl(float{}))
                                : check_case<bf16>(s, sp, on_nccl(bf16{}))))
        return;
  }
}

/// forward_backward of one rank over NCCL into fresh buffers, bf16, directly or captured in a CUDA
/// graph and replayed twice; returns the loss and the gradients as bytes.
std::vector<unsigned char> one_rank_fused_bytes(const nccl_comms& nc, bool graph) {
  lspec s = make_spec(37, 64, 3001);
  s.ce.ignore = ignore_mode::some;
  s.ce.label_smoothing = 0.1f;
  s.space = budget::few_rows;
  const ldata<bf16> L = make_data<bf16>(s);
  std::vector<unsigned char> bytes;
  xent_test::on_nccl_ranks(nc, [&](const xent::nccl_group& g) {
    // cuBLAS allocates nothing during capture when the handle has a workspace of its own (freed
    // after the handle: declared first).
    dbuf<unsigned char> blas_ws(std::size_t{32} << 20);
    const blas_handle blas(g.stream());
    EXPECT_EQ(cublasSetWorkspace(blas.h, blas_ws.ptr, blas_ws.n), CUBLAS_STATUS_SUCCESS);
    const device_inputs<bf16> d(L);
    xent::cuda exec;
    exec.stream = g.stream();
    exec.cublas = blas.h;
    const auto q = xvl::workspace_for<bf16, bf16>(exec, L, L.V(), 1, linear_pass::training);
    device_workspace ws(q.bytes, 16);
    device_outputs o(L.N());
    device_gradients<bf16> grads(L.s);
    ok(cudaDeviceSynchronize());
    auto call = [&] {
      d.with_targets([&](auto t) {
        xent::vocab_parallel_linear_forward_backward(
            exec, g, d.hidden(), d.weight(), d.bias(), {0, L.V()}, t, d.options(), d.upstream(),
            o.all(s.ce), grads.views(), xvl::vp_workspace(ws.ws, q));
      });
    };
    if (graph) {
      cudaGraph_t captured;
      cudaGraphExec_t inst;
      ok(cudaStreamBeginCapture(g.stream(), cudaStreamCaptureModeGlobal));
      call();
      ok(cudaStreamEndCapture(g.stream(), &captured));
      ok(cudaGraphInstantiate(&inst, captured, 0));
      for (int replay = 0; replay < 2; ++replay) ok(cudaGraphLaunch(inst, g.stream()));
      ok(cudaStreamSynchronize(g.stream()));
      cudaGraphExecDestroy(inst);
      cudaGraphDestroy(captured);
    } else {
      call();
      ok(cudaStreamSynchronize(g.stream()));
    }
    bytes = result_bytes(o.fetch().loss, grads.fetch());
  });
  return bytes;
}

TEST(NcclVocabParallelLinear, ForwardBackwardUnderStreamCaptureMatchesTheDirectCall) {
  REQUIRE_GPU();
  nccl_comms nc(1);
  ASSERT_EQ(nc.comms.size(), 1u);
  const auto direct = one_rank_fused_bytes(nc, false);
  const auto captured = one_rank_fused_bytes(nc, true);
  EXPECT_TRUE(direct == captured);
}

#else

TEST(NcclVocabParallelLinear, SkippedWithoutNccl) {
  GTEST_SKIP() << "built without NCCL (XENT_HAS_NCCL undefined): the NCCL group tests are not "
                  "compiled; the staged-group tests cover the CUDA path";
}

#endif

}  // namespace

namespace xtl {
INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, VocabParallelLinearBackend, staged_ranks);
}  // namespace xtl
