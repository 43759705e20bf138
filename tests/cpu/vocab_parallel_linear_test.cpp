// Vocab-parallel fused linear cross-entropy on the CPU (cpu/vocab_parallel_linear.hpp), ranks as
// threads of an in-process group: 1-4 ranks, Megatron's uneven split, an empty shard, shards out
// of class order, every loss option, bias or not, ignored rows (some, all), per-row upstream
// gradients, float / bf16 / fp16 and mixed gradient dtypes, workspaces from one-row chunks to one
// chunk, rows fewer than threads, both training orders and the automatic choice between them;
// argument errors. Each case runs forward, forward_backward and backward (from forward's LSE) on
// every rank and is held to the float64 linear oracle and to the unsharded linear calls in the
// fast order (vocab_parallel_linear_harness.hpp says how).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "harness.hpp"
#include "linear_harness.hpp"
#include "oracle/linear_oracle.hpp"
#include "vocab_parallel_linear_backend_tests.hpp"
#include "vocab_parallel_linear_harness.hpp"

namespace {

using namespace xtl;  // NOLINT(google-build-using-namespace): the shared linear test vocabulary
using xent::linear_pass;

/// The three calls on every rank of `sp`, ranks as threads: forward, forward_backward, and
/// backward from forward's LSE.
template <class T, class G>
std::vector<xvl::rank_result<G>> run_ranks(const ldata<T>& L, const xt::split& sp) {
  const std::vector<ldata<T>> shards = xvl::shards_of(L, sp);
  std::vector<xvl::rank_result<G>> res;
  for (const ldata<T>& in : shards) res.emplace_back(in.s);
  xent::inprocess_group group(sp.ranks());
  group.run([&](xent::inprocess_group::communicator comm) {
    const int r = comm.rank();
    const ldata<T>& in = shards[r];  // this rank's arguments
    xvl::rank_result<G>& out = res[r];
    const xent::cpu exec(L.s.ce.threads);
    const xent::linear_options opts = in.options();
    const xent::vocab_shard shard{sp.first(r), L.V()};
    const auto fq = xvl::workspace_for<T, T>(exec, L, in.V(), sp.ranks(), linear_pass::forward);
    workspace_buffer fws(fq.bytes, L.s.ce.seed + r);
    const auto tq = xvl::workspace_for<T, G>(exec, L, in.V(), sp.ranks(), linear_pass::training);
    workspace_buffer tws(tq.bytes, L.s.ce.seed + 7 * r + 1);
    in.d.with_targets([&](auto t) {
      xent::vocab_parallel_linear_forward(exec, comm, in.hidden(), in.weight(), in.bias(), shard, t,
                                          opts, out.fwd.all(L.s.ce), xvl::vp_workspace(fws.ws, fq));
      xent::vocab_parallel_linear_forward_backward(
          exec, comm, in.hidden(), in.weight(), in.bias(), shard, t, opts, in.d.upstream(),
          out.fb.all(L.s.ce), out.gfb.views(), xvl::vp_workspace(tws.ws, tq));
      xent::vocab_parallel_linear_backward(
          exec, comm, in.hidden(), in.weight(), in.bias(), shard, t, opts,
          xent::vector_view<const float>(out.fwd.lse.data(), L.N()), in.d.upstream(),
          out.gb.views(), xvl::vp_workspace(tws.ws, tq));
    });
  });
  return res;
}

/// The same three calls unsharded (linear.hpp).
template <class T, class G>
xvl::rank_result<G> run_unsharded(const ldata<T>& L) {
  xvl::rank_result<G> u(L.s);
  const xent::cpu exec(L.s.ce.threads);
  const xent::linear_options opts = L.options();
  workspace_buffer fws(workspace_bytes<T>(exec, L, linear_pass::forward), 0);
  workspace_buffer tws(workspace_bytes<T, G>(exec, L, linear_pass::training), 0);
  L.d.with_targets([&](auto t) {
    xent::linear_forward(exec, L.hidden(), L.weight(), L.bias(), t, opts, u.fwd.all(L.s.ce),
                         fws.ws);
    xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, opts, L.d.upstream(),
                                  u.fb.all(L.s.ce), u.gfb.views(), tws.ws);
    xent::linear_backward(exec, L.hidden(), L.weight(), L.bias(), t, opts,
                          xent::vector_view<const float>(u.fwd.lse.data(), L.N()), L.d.upstream(),
                          u.gb.views(), tws.ws);
  });
  return u;
}

/// Chunks of a call of `rows` rows in chunks of `chunk_rows`.
std::int64_t chunks(std::int64_t rows, std::int64_t chunk_rows) {
  return (rows + chunk_rows - 1) / std::max<std::int64_t>(chunk_rows, 1);
}

/// One case on one split: the ranks agree; against the oracle; against the unsharded calls.
/// Returns whether everything passed.
template <class T, class G = T>
bool run_case(const lspec& s, const xt::split& sp) {
  const ldata<T> L = make_data<T>(s);
  const oracle::linear_problem pb = L.problem();
  const oracle::upstream up = L.d.oracle_upstream();
  const oracle::linear_result r = oracle::evaluate_linear(pb, &up);
  const xent::cpu exec(s.ce.threads);
  // d_weight rounded once per chunk (dw_accumulation::output, G narrow): the most chunks that the
  // sharded or the unsharded call makes.
  double chunk_rounding = 0.0;
  if (s.accumulate == xent::dw_accumulation::output && !std::is_same<G, float>::value) {
    const auto vp =
        xvl::workspace_for<T, G>(exec, L, sp.cols(0), sp.ranks(), linear_pass::training);
    const auto single = xent::cpu_detail::plan_linear<T, G>(
        exec, {L.N(), L.D(), L.V()}, linear_pass::training, s.accumulate,
        workspace_bytes<T, G>(exec, L, linear_pass::training));
    chunk_rounding = 2.0 * xt::unit_roundoff<G>() *
                     std::max(chunks(L.N(), vp.chunk_rows), chunks(L.N(), single.chunk_rows));
  }
  const bounds e = error_bounds(L, pb, r, chunk_rounding);
  const auto res = run_ranks<T, G>(L, sp);
  std::string errors;
  auto note = [&](const char* what, const std::string& m) {
    if (!m.empty()) errors += std::string(what) + ":\n" + m;
  };
  note("ranks", xvl::check_ranks_agree(res));
  note("vs oracle", xvl::check_results(L, sp, res, r, e));
  note("vs unsharded",
       xvl::check_results(L, sp, res,
                          xvl::from_unsharded(r, run_unsharded<T, G>(xvl::in_fast_order(L))),
                          xvl::twice(e)));
  if (!errors.empty()) {
    ADD_FAILURE() << "case " << xt::dtype_name<T>() << " -> " << xt::dtype_name<G>() << " grads, "
                  << s.describe() << ", " << sp.name() << "\n"
                  << errors;
    return false;
  }
  return true;
}

/// The CPU backend of the shared vocab-parallel linear tests
/// (vocab_parallel_linear_backend_tests.hpp): ranks as threads of an in-process group.
struct cpu_ranks {
  /// Every fourth every-option case in bf16 / fp16, whose CPU arithmetic is emulated (slow).
  static constexpr int narrow_stride = 4;
  void set_up() {}
  void tear_down() {}
  template <class T, class G = T>
  bool run(const lspec& s, const xt::split& sp) const {
    return run_case<T, G>(s, sp);
  }
};

TEST(CpuVocabParallelLinear, GradientDtypeMayDifferFromTheInputs) {
  // Float gradients of bf16 / fp16 inputs, bf16 gradients of float inputs (both d_weight
  // accumulations, every workspace size), on 3 ranks with an empty one and on 2.
  xt::case_budget b;
  int i = 0;
  for (const lspec& s : mixed_dtype_cases()) {
    const xt::split sp = xt::splits(s.ce.cols, 2 + i % 2)[static_cast<std::size_t>(i) % 2];
    ++i;
    if (!b.record(run_case<bf16, float>(s, sp) && run_case<half, float>(s, sp) &&
                  run_case<float, bf16>(s, sp)))
      return;
  }
}

TEST(CpuVocabParallelLinear, MoreRanksThanClassesLeaveShardsEmpty) {
  // V = 1, 2, 3 on 4 ranks: Megatron's split leaves ranks without a class; with smoothing and
  // class weights every rank still needs the whole vocabulary's sums.
  std::uint64_t seed = 300;
  for (std::int64_t vocab : {1, 2, 3})
    for (target_kind kind : {target_kind::int64, target_kind::soft}) {
      lspec s = make_spec(6, 5, vocab);
      s.ce.kind = kind;
      s.ce.ignore = kind == target_kind::soft ? ignore_mode::none : ignore_mode::some;
      s.ce.label_smoothing = 0.2f;
      s.ce.weights = true;
      s.ce.seed = ++seed;
      s.space = budget::minimal;
      for (const xt::split& sp : xt::splits(vocab, 4)) EXPECT_TRUE(run_case<float>(s, sp));
    }
}

TEST(CpuVocabParallelLinear, ManyChunksWeightBlocksAndThreads) {
  // V past the 256-row weight block on some ranks, D not a packet multiple, one-row and few-row
  // chunks, 1 to 4 threads per rank.
  xt::case_budget b;
  std::uint64_t seed = 500;
  for (std::int64_t vocab : {257, 611})
    for (int threads : {1, 4})
      for (budget space : {budget::minimal, budget::few_rows}) {
        lspec s = make_spec(23, 21, vocab);
        s.ce.ignore = ignore_mode::some;
        s.ce.label_smoothing = 0.05f;
        s.ce.weights = seed % 2 == 0;
        s.ce.threads = threads;
        s.ce.seed = ++seed;
        s.space = space;
        s.pad = 1;
        for (const xt::split& sp : {xt::even_split(vocab, 2), xt::splits(vocab, 3)[1]})
          if (!b.record(run_case<float>(s, sp) && run_case<bf16>(s, sp))) return;
      }
}

TEST(CpuVocabParallelLinear, RowsFewerThanThreadsSplitEachRowOfAShard) {
  // One-row chunks of 70000-class shards on 4 threads: each row's shard is cut into slices,
  // merged per rank, then across ranks.
  for (target_kind kind : {target_kind::int64, target_kind::soft}) {
    lspec s = make_spec(2, 3, 140000);
    s.ce.kind = kind;
    s.ce.label_smoothing = 0.1f;
    s.ce.threads = 4;
    s.ce.seed = 77;
    s.space = budget::minimal;
    s.bias = kind == target_kind::soft;
    EXPECT_TRUE(run_case<float>(s, xt::even_split(140000, 2)));
  }
}

TEST(CpuVocabParallelLinear, PartialHiddenGradientsSumToTheUnshardedOne) {
  // The d_hidden decision made visible: each rank's d_hidden is G_shard · W_shard, not the whole
  // gradient, and the ranks' partials add up to the unsharded call's.
  lspec s = make_spec(5, 4, 12);
  s.ce.reduce = reduction::sum;
  const ldata<float> L = make_data<float>(s);
  const xt::split sp = xt::even_split(12, 3);
  const auto res = run_ranks<float, float>(L, sp);
  const auto u = run_unsharded<float, float>(L);
  double largest_gap = 0.0, scale = 0.0;
  for (std::int64_t i = 0; i < L.N() * L.D(); ++i) {
    const std::int64_t at = i / L.D() * s.ld() + i % L.D();
    double sum = 0.0;
    for (const auto& r : res) sum += r.gfb.dx[at];
    EXPECT_NEAR(sum, u.gfb.dx[at], 1e-5 * (1.0 + std::fabs(u.gfb.dx[at])));
    largest_gap =
        std::max(largest_gap, std::fabs(static_cast<double>(res[0].gfb.dx[at] - u.gfb.dx[at])));
    scale = std::max(scale, std::fabs(static_cast<double>(u.gfb.dx[at])));
  }
  EXPECT_GT(largest_gap, 1e-3 * scale) << "rank 0's d_hidden is the whole gradient, not a partial";
}

// ---------------------------------------------------------------------------------------------
// The size query
// ---------------------------------------------------------------------------------------------

TEST(CpuVocabParallelLinearWorkspace, ChunkRowsAreTheSameOnEveryRankAndBytesFollowTheShard) {
  const xent::cpu exec(2);
  const std::int64_t V = 50257, N = 1000, D = 64;
  const int R = 3;
  const xt::split sp = xt::splits(V, R)[1];  // an empty rank 0, rank 1 with two ranks' classes
  for (auto pass : {linear_pass::forward, linear_pass::training})
    for (std::size_t budget : {std::size_t{1} << 16, std::size_t{8} << 20, std::size_t{1} << 40}) {
      std::vector<xent::linear_workspace_sizes> q;
      for (int r = 0; r < R; ++r)
        q.push_back(xent::vocab_parallel_linear_workspace_size<bf16>(exec, {N, D, sp.cols(r)}, V, R,
                                                                     pass, {}, budget));
      for (int r = 0; r < R; ++r) {
        EXPECT_EQ(q[r].chunk_rows, q[0].chunk_rows) << "rank " << r;
        EXPECT_GE(q[r].bytes, q[r].minimal);
      }
      EXPECT_LT(q[0].bytes, q[2].bytes);  // an empty shard needs less than a full one
      EXPECT_LT(q[2].bytes, q[1].bytes);  // and a double one more
      // The chunk is planned for ceil(V / R) classes: a full rank's bytes fit the budget's room.
      const auto one = xent::vocab_parallel_linear_workspace_size<bf16>(
          exec, {N, D, (V + R - 1) / R}, V, R, pass, {}, budget);
      EXPECT_EQ(one.chunk_rows, q[0].chunk_rows);
      EXPECT_GE(q[0].chunk_rows, 1);
      if (budget == std::size_t{1} << 40) {
        EXPECT_EQ(q[0].chunk_rows, N);
      }
    }
  // A rank's bytes hold the single-device call's plus its exchange: more than linear's.
  const auto vp = xent::vocab_parallel_linear_workspace_size<float>(exec, {N, D, 100}, 100, 1,
                                                                    linear_pass::training, {}, 0);
  const auto single =
      xent::linear_workspace_size<float>(exec, {N, D, 100}, linear_pass::training, {}, 0);
  EXPECT_EQ(vp.chunk_rows, single.chunk_rows);
  EXPECT_GT(vp.minimal, single.minimal);
  EXPECT_THROW(xent::vocab_parallel_linear_workspace_size<float>(exec, {N, D, 100}, 99, 1,
                                                                 linear_pass::forward),
               xent::error);
  EXPECT_THROW(xent::vocab_parallel_linear_workspace_size<float>(exec, {N, D, 100}, 100, 0,
                                                                 linear_pass::forward),
               xent::error);
}

/// forward_backward on every rank of `sp` in bf16 with bf16 gradients, rank r with options `o[r]`
/// and bytes[r] of workspace at one-row chunks; each rank's outputs and gradients.
std::vector<xvl::rank_result<bf16>> train_ranks(const ldata<bf16>& L, const xt::split& sp,
                                                const std::vector<xent::linear_options>& o,
                                                const std::vector<std::size_t>& bytes) {
  const std::vector<ldata<bf16>> shards = xvl::shards_of(L, sp);
  std::vector<xvl::rank_result<bf16>> res;
  for (const ldata<bf16>& in : shards) res.emplace_back(in.s);
  std::vector<workspace_buffer> buffers;
  for (int r = 0; r < sp.ranks(); ++r) buffers.emplace_back(bytes[r], 8 + r);
  xent::inprocess_group group(sp.ranks());
  group.run([&](xent::inprocess_group::communicator comm) {
    const int r = comm.rank();
    const ldata<bf16>& in = shards[r];
    xent::vocab_parallel_linear_workspace ws;
    ws.data = buffers[r].ws.data;
    ws.bytes = bytes[r];
    ws.chunk_rows = 1;
    in.d.with_targets([&](auto t) {
      xent::vocab_parallel_linear_forward_backward(
          xent::cpu(2), comm, in.hidden(), in.weight(), in.bias(), {sp.first(r), L.V()}, t, o[r],
          in.d.upstream(), res[r].fb.all(L.s.ce), res[r].gfb.views(), ws);
    });
  });
  return res;
}

/// The gradients of two runs of the ranks, bit for bit.
bool same_gradients(const std::vector<xvl::rank_result<bf16>>& a,
                    const std::vector<xvl::rank_result<bf16>>& b) {
  for (std::size_t r = 0; r < a.size(); ++r)
    if (!xt::same_vector_bits(a[r].gfb.dx, b[r].gfb.dx) ||
        !xt::same_vector_bits(a[r].gfb.dw, b[r].gfb.dw) ||
        !xt::same_vector_bits(a[r].gfb.db, b[r].gfb.db))
      return false;
  return true;
}

// linear_order::automatic runs, on each rank, the fast order in a training workspace of the fast
// order's bytes for its chunk_rows (fast_minimal at one-row chunks) and the low-memory order in
// one byte less, down to the low-memory minimal; one byte less than that throws naming it. The
// ranks decide each from its own bytes (one rank in each order, or an empty shard, where the fast
// order needs less), and the results are those of the order each chose, bit for bit.
TEST(CpuVocabParallelLinearWorkspace, AutomaticOrderSwitchesAtTheFastOrdersBytesOnEachRank) {
  // Shards past the CPU's 1024-row panels: the V x D float accumulator outgrows a panel's sums.
  lspec s = make_spec(9, 6, 20000);
  s.ce.ignore = ignore_mode::some;
  s.ce.label_smoothing = 0.1f;
  const ldata<bf16> L = make_data<bf16>(s);
  const xent::cpu exec(2);
  xent::linear_options automatic = L.options(), fast = automatic, low = automatic;
  automatic.order = xent::linear_order::automatic;
  fast.order = xent::linear_order::fast;
  low.order = xent::linear_order::low_memory;
  const oracle::linear_problem pb = L.problem();
  const oracle::upstream up = L.d.oracle_upstream();
  const oracle::linear_result r = oracle::evaluate_linear(pb, &up);
  auto judge = [&](const xt::split& sp, const std::vector<xvl::rank_result<bf16>>& res) {
    std::vector<const gradients<bf16>*> grads;
    for (const auto& x : res) grads.push_back(&x.gfb);
    return xvl::check_gradients(L, sp, grads, r, error_bounds(L, pb, r, 0.0));
  };
  auto less = [](std::vector<std::size_t> v) {
    for (std::size_t& b : v) --b;
    return v;
  };
  // Each rank's minimal in each order at one-row chunks.
  auto minimal = [&](const xt::split& sp, std::vector<std::size_t>& fast_min,
                     std::vector<std::size_t>& low_min, std::vector<std::size_t>& auto_min) {
    for (int k = 0; k < sp.ranks(); ++k) {
      auto query = [&](const xent::linear_options& o) {
        return xent::vocab_parallel_linear_workspace_size<bf16>(
            exec, {L.N(), L.D(), sp.cols(k)}, L.V(), sp.ranks(), linear_pass::training, o, 0);
      };
      const auto sizes = query(automatic);
      fast_min.push_back(query(fast).minimal);
      low_min.push_back(query(low).minimal);
      auto_min.push_back(sizes.minimal);
      EXPECT_EQ(sizes.chunk_rows, 1);
      EXPECT_EQ(query(low).chunk_rows, 1);
      EXPECT_EQ(sizes.fast_minimal, fast_min.back());
      EXPECT_EQ(query(low).fast_minimal, fast_min.back());
      EXPECT_EQ(sizes.minimal, std::min(fast_min.back(), low_min.back()));
    }
  };

  const xt::split sp = xt::splits(20000, 3)[2];  // uneven shards, out of class order
  const int R = sp.ranks();
  std::vector<std::size_t> fast_min, low_min, auto_min;
  minimal(sp, fast_min, low_min, auto_min);
  for (int k = 0; k < R; ++k) EXPECT_LT(low_min[k], fast_min[k]) << "rank " << k;
  const std::vector<xent::linear_options> autos(R, automatic), fasts(R, fast), lows(R, low);
  EXPECT_TRUE(
      same_gradients(train_ranks(L, sp, autos, fast_min), train_ranks(L, sp, fasts, fast_min)));
  EXPECT_TRUE(same_gradients(train_ranks(L, sp, autos, less(fast_min)),
                             train_ranks(L, sp, lows, less(fast_min))));
  EXPECT_TRUE(
      same_gradients(train_ranks(L, sp, autos, low_min), train_ranks(L, sp, lows, low_min)));
  EXPECT_EQ(judge(sp, train_ranks(L, sp, autos, low_min)), "");
  // Rank 1 in the low-memory order, the others in the fast order: the same exchanges, and the
  // ranks' gradients together are the whole call's.
  std::vector<std::size_t> mixed = fast_min;
  mixed[1] = fast_min[1] - 1;
  const auto res = train_ranks(L, sp, autos, mixed);
  std::vector<xent::linear_options> chosen = fasts;
  chosen[1] = low;
  EXPECT_TRUE(same_gradients(res, train_ranks(L, sp, chosen, mixed)));
  EXPECT_EQ(judge(sp, res), "");

  // An empty shard's fast order needs less (no panels, no N x D sum): at each rank's automatic
  // minimal the empty rank 0 runs the fast order, the others the low-memory order.
  const xt::split holes = xt::splits(20000, 3)[1];
  std::vector<std::size_t> hole_fast, hole_low, hole_auto;
  minimal(holes, hole_fast, hole_low, hole_auto);
  EXPECT_LT(hole_fast[0], hole_low[0]);
  std::vector<xent::linear_options> hole_chosen(3, low);
  hole_chosen[0] = fast;
  const auto hole_res = train_ranks(L, holes, autos, hole_auto);
  EXPECT_TRUE(same_gradients(hole_res, train_ranks(L, holes, hole_chosen, hole_auto)));
  EXPECT_EQ(judge(holes, hole_res), "");

  // One byte short of the least in each order: the call throws naming the workspace and the bytes
  // it needs (rank 0's error, inprocess_group's rethrow).
  for (const auto& [o, need] :
       {std::pair{automatic, low_min}, std::pair{fast, fast_min}, std::pair{low, low_min}}) {
    std::string named;
    const std::vector<xent::linear_options> opts(R, o);
    try {
      train_ranks(L, sp, opts, less(need));
    } catch (const xent::error& e) {
      named = e.argument();
      EXPECT_NE(std::string(e.what()).find(std::to_string(need[0])), std::string::npos) << e.what();
    }
    EXPECT_EQ(named, "workspace");
  }
}

// Rows that hold no element (an empty shard, D = 0) are bounded by the exchange alone: at 2^57
// rows or so the workspace sizes wrapped to a few bytes, which passed the call's workspace check
// before it wrote its exchange header 2^60 bytes into the buffer.
TEST(CpuVocabParallelLinearWorkspace, RowsBeyondWhatAWorkspaceSizeCountsAreRefused) {
  const xent::cpu exec(1);
  const std::int64_t rows = std::int64_t{1} << 53;  // x (1 + 3) units: 2^55, the most allowed
  const auto fits = xent::vocab_parallel_linear_workspace_size<float>(
      exec, {rows, 0, 0}, 1, 1, linear_pass::forward, {}, SIZE_MAX);
  EXPECT_EQ(fits.chunk_rows, rows);
  EXPECT_GT(fits.bytes, static_cast<std::size_t>(rows) * 80);  // no wrap at the bound
  expect_error("shape", "exceeds 2^55", [&] {
    xent::vocab_parallel_linear_workspace_size<float>(exec, {rows + 1, 0, 0}, 1, 1,
                                                      linear_pass::forward);
  });
  expect_error("shape", "exceeds 2^55", [&] {
    xent::vocab_parallel_linear_workspace_size<float>(exec, {std::int64_t{1} << 57, 0, 0}, 1, 1,
                                                      linear_pass::training);
  });
  // The plan's reference shard, ceil(V / R) classes, is wider than this rank's empty one.
  expect_error("vocab", "more than 2^59", [&] {
    xent::vocab_parallel_linear_workspace_size<float>(
        exec, {std::int64_t{1} << 24, 1, 0}, std::int64_t{1} << 41, 2, linear_pass::forward);
  });
  expect_error("vocab", "more than 2^59", [&] {
    xent::vocab_parallel_linear_workspace_size<float>(
        exec, {1, std::int64_t{1} << 40, 1}, std::int64_t{1} << 40, 1, linear_pass::forward);
  });
  // The call itself, with a workspace the wrapped size would have let through.
  std::vector<unsigned char> buffer(4096);
  xent::inprocess_group group(1);
  std::string named;
  try {
    group.run([&](xent::inprocess_group::communicator comm) {
      float loss = 0.0f;
      xent::forward_outputs out;
      out.loss = &loss;
      const std::int64_t n = std::int64_t{1} << 57;
      xent::vocab_parallel_linear_workspace ws;
      ws.data = buffer.data();
      ws.bytes = buffer.size();
      ws.chunk_rows = n;
      xent::vocab_parallel_linear_forward(
          exec, comm, xent::matrix_view<const float>(nullptr, n, 0),
          xent::matrix_view<const float>(nullptr, 0, 0), xent::vector_view<const float>{},
          xent::vocab_shard{0, 1},
          xent::soft_targets<float>{xent::matrix_view<const float>(nullptr, n, 0)},
          xent::linear_options{}, out, ws);
    });
  } catch (const xent::error& e) {
    named = e.argument();
  }
  EXPECT_EQ(named, "hidden");
}

// ---------------------------------------------------------------------------------------------
// Arguments
// ---------------------------------------------------------------------------------------------

/// A small case on 2 ranks ([0, 5) and [5, 12)) whose per-rank arguments a test may spoil
/// (`spoil(rank, args)`); returns the argument every rank's xent::error named ("" for none, the
/// ranks' names joined by '|' when they differ) and whether any output or gradient was written.
struct bad_call {
  lspec s = make_spec(4, 3, 12);
  ldata<float> L;
  bad_call() {
    s.ce.reduce = reduction::mean;
    s.ce.ignore = ignore_mode::some;
    L = make_data<float>(s);
  }

  struct args {
    xent::matrix_view<const float> hidden, weight;
    xent::vector_view<const float> bias;
    xent::vocab_shard shard;
    xent::vector_view<const std::int64_t> targets;
    xent::linear_options opts;
    xent::upstream up;
    xent::forward_outputs out;
    xent::linear_grads<float> grads;
    xent::vocab_parallel_linear_workspace ws;
  };

  template <class Spoil>
  std::pair<std::string, bool> run(Spoil&& spoil) {
    const xt::split sp = xt::even_split(12, 2);
    const std::vector<ldata<float>> shards = xvl::shards_of(L, sp);
    std::vector<xvl::rank_result<float>> res;
    for (const ldata<float>& in : shards) res.emplace_back(in.s);
    std::vector<std::string> named(2);
    std::vector<workspace_buffer> buffers;
    std::vector<xent::linear_workspace_sizes> q;
    for (int r = 0; r < 2; ++r) {
      q.push_back(
          xvl::workspace_for<float, float>(xent::cpu{}, L, sp.cols(r), 2, linear_pass::training));
      buffers.emplace_back(q.back().bytes, 0);
    }
    xent::inprocess_group group(2);
    try {
      group.run([&](xent::inprocess_group::communicator comm) {
        const int r = comm.rank();
        args a{L.hidden(),
               shards[r].weight(),
               shards[r].bias(),
               {sp.first(r), 12},
               {L.d.t64.data(), L.N()},
               L.options(),
               L.d.upstream(),
               res[r].fb.all(s.ce),
               res[r].gfb.views(),
               xvl::vp_workspace(buffers[r].ws, q[r])};
        spoil(r, a);
        try {
          xent::vocab_parallel_linear_forward_backward(xent::cpu{}, comm, a.hidden, a.weight,
                                                       a.bias, a.shard, a.targets, a.opts, a.up,
                                                       a.out, a.grads, a.ws);
        } catch (const xent::error& e) {
          named[r] = e.argument();
          throw;
        }
      });
    } catch (const xent::error&) {
    } catch (const xent::group_aborted&) {
    }
    bool written = false;
    for (const auto& r : res) {
      written = written || r.fb.loss != 12345.0f || r.fb.lse[0] != 12345.0f;
      for (const auto* v : {&r.gfb.dx, &r.gfb.dw, &r.gfb.db})
        for (float x : *v) written = written || !xt::same_bits(x, xt::sentinel<float>());
    }
    return {named[0] == named[1] ? named[0] : named[0] + "|" + named[1], written};
  }
};

TEST(CpuVocabParallelLinearValidation, BadArgumentsThrowNamingThemBeforeAnythingIsWritten) {
  struct expectation {
    const char* argument;
    std::function<void(int, bad_call::args&)> spoil;
  };
  std::vector<float> weights(12, 1.0f), probs(4 * 12, 1.0f / 12);
  const std::vector<expectation> cases = {
      // Arguments the same on every rank: every rank names them.
      {"targets",
       [](int, bad_call::args& a) {
         static std::int64_t bad[4] = {0, 12, 3, 4};  // 12 is outside [0, V)
         a.targets = {bad, 4};
       }},
      {"options.class_weights",
       [&](int r, bad_call::args& a) {
         a.opts.class_weights = {weights.data(), r == 0 ? 5 : 7};
       }},
      {"options.label_smoothing", [](int, bad_call::args& a) { a.opts.label_smoothing = -1.0f; }},
      {"options.order",
       [](int, bad_call::args& a) { a.opts.order = static_cast<xent::linear_order>(7); }},
      {"upstream.rows",
       [&](int, bad_call::args& a) {
         a.up.rows = {weights.data(), 4};
       }},  // needs reduction none
      {"workspace.chunk_rows", [](int, bad_call::args& a) { a.ws.chunk_rows = 0; }},
      {"workspace", [](int, bad_call::args& a) { a.ws.bytes = 64; }},
      {"workspace", [](int, bad_call::args& a) { a.ws.bytes -= 1; }},  // the query's, less 1
      // The shards after the first exchange: every rank names them.
      {"shard", [](int r, bad_call::args& a) { a.shard.first = r == 0 ? 0 : 4; }},
      {"shard.vocab", [](int r, bad_call::args& a) { a.shard.vocab = r == 0 ? 12 : 13; }},
      {"hidden",
       [](int r, bad_call::args& a) {
         a.hidden.rows = r == 0 ? 4 : 3;  // different rows, the same first chunk of one row
         a.targets.size = a.out.row_loss.size = a.out.lse.size = a.out.argmax.size = a.hidden.rows;
         a.grads.d_hidden.rows = a.hidden.rows;
         a.ws.chunk_rows = 1;
       }},
      // Ranks whose chunk_rows differ move different byte counts: inprocess_group's error.
      {"bytes", [](int r, bad_call::args& a) { a.ws.chunk_rows = r == 0 ? 1 : 2; }},
      // This rank's own arguments.
      {"shard.first", [](int, bad_call::args& a) { a.shard.first = 9; }},
      {"weight",
       [](int r, bad_call::args& a) {
         if (r == 1) a.weight.cols = 2;
       }},
      {"grads.d_weight", [](int, bad_call::args& a) { a.grads.d_weight.rows += 1; }},
      {"grads.d_bias", [](int, bad_call::args& a) { a.bias = {}; }},
      // The hidden rows are checked before the outputs sized by them.
      {"hidden", [](int, bad_call::args& a) { a.hidden.rows = -1; }},
  };
  for (const expectation& c : cases) {
    bad_call call;
    const auto [named, written] = call.run(c.spoil);
    // A rank-local error leaves the other rank aborted (group_aborted), naming nothing.
    const bool rank_local = std::string(c.argument) == "weight";
    EXPECT_EQ(named, rank_local ? std::string("|") + c.argument : std::string(c.argument));
    EXPECT_FALSE(written) << c.argument << ": an output or gradient was written before the error";
  }
  // Soft targets are the shard's columns: the whole vocabulary's are refused.
  bad_call call;
  std::string named;
  xent::inprocess_group group(1);
  try {
    group.run([&](xent::inprocess_group::communicator comm) {
      float loss;
      xent::forward_outputs o;
      o.loss = &loss;
      xent::vocab_parallel_linear_forward(
          xent::cpu{}, comm, call.L.hidden(), call.L.weight(), call.L.bias(), {0, 12},
          xent::soft_targets<float>{xent::matrix_view<const float>(probs.data(), 4, 11)},
          call.L.options(), o, {});
    });
  } catch (const xent::error& e) {
    named = e.argument();
  }
  EXPECT_EQ(named, "targets");
}

}  // namespace

namespace xtl {
// Named CpuVocabParallel*: the tsan preset picks its threaded tests by that ctest name prefix.
INSTANTIATE_TYPED_TEST_SUITE_P(CpuVocabParallelLinear, VocabParallelLinearBackend, cpu_ranks);
}  // namespace xtl
