// The CUDA backend's vocab-parallel calls (cuda/vocab_parallel.cuh): every rank's shard of the
// gradient and its forward outputs, against the float64 oracle and against the unsharded
// xent::cuda call on the full vocabulary, for every option, dtype, reduction, uneven and empty
// shards and shards out of class order; every rank's forward outputs bitwise identical.
//
// Three kinds of group (tests/cuda/groups.cuh) run the same cases:
//   - staged_group: R ranks as threads on ONE GPU, the all-gather staged through the host (a test
//     communicator: it synchronises the rank's stream first). It runs on any machine with a GPU
//     and checks everything but the stream ordering of a real collective.
//   - an NCCL group of one rank on GPU 0 (ncclCommInitAll), also under CUDA graph capture;
//   - an NCCL group over every visible GPU (ncclCommInitAll, one thread per GPU): needs >= 2 GPUs,
//     skipped with the reason otherwise.
// The NCCL tests are compiled where NCCL is (XENT_HAS_NCCL); without a GPU every test skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include <xent/xent.hpp>

#include "cpu/vocab_split.hpp"
#include "cuda/device_util.cuh"
#include "cuda/groups.cuh"
#include "oracle/oracle.hpp"

namespace {

using xent::reduction;
using xent_test::dbl;
using xent_test::dbuf;
using xent_test::ok;
using xent_test::staged_group;
using xt::even_split;
using xt::split;
using xt::splits;

struct vp_spec {
  std::int64_t rows = 7, cols = 1000;
  reduction reduce = reduction::mean;
  float smoothing = 0.0f, z_loss = 0.0f, softcap = 0.0f;
  bool weights = false, soft = false, some_ignored = false;
  std::uint64_t seed = 1;
  std::string name() const {
    return std::to_string(rows) + "x" + std::to_string(cols) + " red " +
           std::to_string(static_cast<int>(reduce)) + " eps " + std::to_string(smoothing) + " z " +
           std::to_string(z_loss) + " cap " + std::to_string(softcap) +
           (weights ? " weights" : "") + (soft ? " soft" : "") + (some_ignored ? " some-ign" : "");
  }
};

/// One case on the host: inputs in dtype T, and the oracle's answer on the same rounded inputs.
template <class T>
struct host_case {
  vp_spec s;
  std::vector<T> x;  ///< N x V
  std::vector<std::int64_t> y;
  std::vector<float> probs;  ///< N x V, soft targets
  std::vector<float> w;      ///< V, or empty
  std::vector<float> up_rows;
  oracle::result ref;

  xent::options options(const float* device_weights) const {
    xent::options o;
    o.reduce = s.reduce;
    o.label_smoothing = s.smoothing;
    o.z_loss = s.z_loss;
    o.softcap = s.softcap;
    if (s.weights) o.class_weights = {device_weights, s.cols};
    return o;
  }
};

template <class T>
host_case<T> make_case(const vp_spec& s) {
  host_case<T> hc;
  hc.s = s;
  const std::int64_t N = s.rows, V = s.cols;
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  oracle::problem pb;
  pb.rows = N;
  pb.cols = V;
  for (std::int64_t i = 0; i < N * V; ++i) {
    hc.x.push_back(T(static_cast<float>(normal(rng))));
    pb.logits.push_back(dbl(hc.x.back()));
  }
  pb.soft = s.soft;
  if (s.soft) {
    hc.probs.resize(N * V);
    for (std::int64_t n = 0; n < N; ++n) {
      double sum = 0.0;
      std::vector<double> e(V);
      for (std::int64_t c = 0; c < V; ++c) sum += (e[c] = std::exp(normal(rng)));
      for (std::int64_t c = 0; c < V; ++c) hc.probs[n * V + c] = static_cast<float>(e[c] / sum);
    }
    pb.probs.assign(hc.probs.begin(), hc.probs.end());
  }
  std::uniform_int_distribution<std::int64_t> cls(0, V - 1);
  for (std::int64_t n = 0; n < N; ++n)
    hc.y.push_back(s.some_ignored && n % 3 == 1 ? std::int64_t{-100} : cls(rng));
  pb.targets = hc.y;
  if (s.weights) {
    std::uniform_real_distribution<double> u(0.25, 2.0);
    for (std::int64_t c = 0; c < V; ++c) hc.w.push_back(static_cast<float>(u(rng)));
    pb.weights.assign(hc.w.begin(), hc.w.end());
  }
  pb.reduce = static_cast<oracle::reduction>(static_cast<int>(s.reduce));
  pb.label_smoothing = s.smoothing;
  pb.z_loss = s.z_loss;
  pb.softcap = s.softcap;
  oracle::upstream up;
  up.scale = 0.75;
  if (s.reduce == reduction::none)
    for (std::int64_t n = 0; n < N; ++n) {
      hc.up_rows.push_back(0.5f + 0.25f * static_cast<float>(n % 5));
      up.rows.push_back(0.75 * hc.up_rows.back());
    }
  hc.ref = oracle::evaluate(pb, &up);
  return hc;
}

/// What one call (or one rank's calls) wrote, on the host. grad: N x cols of that call.
struct call_out {
  std::vector<float> row_loss, lse;
  std::vector<std::int64_t> argmax;
  float loss = 0.0f;
  std::int64_t correct = 0;
  std::vector<double> grad;
  int errors = 0;
};

template <class T>
std::vector<T> columns(const std::vector<T>& m, std::int64_t rows, std::int64_t ld,
                       std::int64_t first, std::int64_t cols) {
  std::vector<T> out(static_cast<std::size_t>(rows * cols));
  for (std::int64_t n = 0; n < rows; ++n)
    std::copy(m.begin() + n * ld + first, m.begin() + n * ld + first + cols,
              out.begin() + n * cols);
  return out;
}

/// `v` and one element more: a buffer is never empty, and a read past the last element would
/// land on it rather than outside the allocation (memcheck reports neither).
template <class T>
std::vector<T> padded(std::vector<T> v) {
  v.push_back(T(0.0f));
  return v;
}

/// Device copies of a rank's inputs and outputs (on the device current at construction).
template <class T>
struct rank_buffers {
  std::int64_t N, cols;
  dbuf<T> x, grad;
  dbuf<std::int64_t> y;
  dbuf<float> probs, w, up_rows, row_loss, lse, loss;
  dbuf<std::int64_t> argmax, correct;
  dbuf<int> errors;
  dbuf<char> ws;
  rank_buffers(const host_case<T>& hc, std::int64_t first, std::int64_t cols_, int ranks)
      : N(hc.s.rows),
        cols(cols_),
        x(padded(columns(hc.x, N, hc.s.cols, first, cols))),
        grad(static_cast<std::size_t>(N * cols) + 1),
        y(hc.y.empty() ? std::vector<std::int64_t>{0} : hc.y),
        probs(padded(hc.s.soft ? columns(hc.probs, N, hc.s.cols, first, cols)
                               : std::vector<float>{})),
        w(hc.w.empty() ? std::vector<float>{0} : hc.w),
        up_rows(hc.up_rows.empty() ? std::vector<float>{0} : hc.up_rows),
        row_loss(N + 1),
        lse(N + 1),
        loss(1),
        argmax(N + 1),
        correct(1),
        errors(1),
        ws(xent::cuda_vocab_parallel_workspace_size(N, ranks)) {}
};

/// Runs the case on this rank through `call(exec, logits, targets, opts, up, out, grad, lse)`,
/// once fused (forward_backward) and once as forward then backward, and returns both results.
template <class T, class Call>
std::vector<call_out> run_calls(const host_case<T>& hc, std::int64_t first, std::int64_t cols,
                                int ranks, cudaStream_t stream, const Call& call) {
  const vp_spec& s = hc.s;
  const std::int64_t N = s.rows;
  rank_buffers<T> b(hc, first, cols, ranks);
  xent::cuda exec{stream, b.ws.ptr, b.ws.n, b.errors.ptr};
  const xent::options opts = hc.options(b.w.ptr);
  xent::upstream up;
  up.scale = 0.75f;
  if (s.reduce == reduction::none) up.rows = {b.up_rows.ptr, N};
  xent::forward_outputs out;
  if (s.reduce != reduction::none) out.loss = b.loss.ptr;
  out.row_loss = {b.row_loss.ptr, N};
  out.lse = {b.lse.ptr, N};
  out.argmax = {b.argmax.ptr, N};
  if (!s.soft) out.num_correct = b.correct.ptr;
  const xent::matrix_view<const T> x(b.x.ptr, N, cols);
  const xent::matrix_view<T> g(b.grad.ptr, N, cols);
  std::vector<call_out> results;
  for (bool fused : {true, false}) {
    auto with_targets = [&](auto targets) {
      call(exec, x, targets, opts, up, out, g, fused, xent::vector_view<const float>(b.lse.ptr, N));
    };
    if (s.soft)
      with_targets(xent::soft(xent::matrix_view<const float>(b.probs.ptr, N, cols)));
    else
      with_targets(xent::vector_view<const std::int64_t>(b.y.ptr, N));
    ok(cudaStreamSynchronize(stream));
    call_out r;
    r.row_loss = b.row_loss.download();
    r.row_loss.resize(N);
    r.lse = b.lse.download();
    r.lse.resize(N);
    r.argmax = b.argmax.download();
    r.argmax.resize(N);
    r.loss = b.loss.download()[0];
    r.correct = b.correct.download()[0];
    for (const T& v : b.grad.download()) r.grad.push_back(dbl(v));
    r.grad.resize(N * cols);
    r.errors = b.errors.download()[0];
    results.push_back(std::move(r));
  }
  return results;
}

/// The unsharded xent::cuda calls on the current device: [fused, forward + backward].
template <class T>
std::vector<call_out> run_unsharded(const host_case<T>& hc) {
  return run_calls(hc, 0, hc.s.cols, 1, nullptr,
                   [](const xent::cuda& exec, auto x, auto targets, const xent::options& opts,
                      const xent::upstream& up, const xent::forward_outputs& out, auto g,
                      bool fused, xent::vector_view<const float> lse) {
                     if (fused) {
                       xent::forward_backward(exec, x, targets, opts, up, out, g);
                     } else {
                       xent::forward(exec, x, targets, opts, out);
                       xent::backward(exec, x, targets, opts, lse, up, g);
                     }
                   });
}

/// This rank's vocab-parallel calls on `group`: [fused, forward + backward].
template <class T, class Group>
std::vector<call_out> run_rank(const host_case<T>& hc, const split& sp, const Group& group) {
  const int r = group.rank();
  const xent::vocab_shard shard{sp.first(r), hc.s.cols};
  return run_calls(
      hc, sp.first(r), sp.cols(r), group.size(), group.stream(),
      [&](const xent::cuda& exec, auto x, auto targets, const xent::options& opts,
          const xent::upstream& up, const xent::forward_outputs& out, auto g, bool fused,
          xent::vector_view<const float> lse) {
        if (fused) {
          xent::vocab_parallel_forward_backward(exec, group, x, shard, targets, opts, up, out, g);
        } else {
          xent::vocab_parallel_forward(exec, group, x, shard, targets, opts, out);
          xent::vocab_parallel_backward(exec, group, x, shard, targets, opts, lse, up, g);
        }
      });
}

/// Every rank's results on `sp`, ranks as threads on the current GPU (staged_group).
template <class T>
std::vector<std::vector<call_out>> run_staged(const host_case<T>& hc, const split& sp) {
  std::vector<std::vector<call_out>> res(static_cast<std::size_t>(sp.ranks()));
  xent_test::on_staged_ranks(
      sp.ranks(), [&](const staged_group& group) { res[group.rank()] = run_rank(hc, sp, group); });
  return res;
}

/// The ranks' gradient shards side by side (N x V), and rank 0's forward outputs.
call_out assemble(const split& sp, const std::vector<call_out>& ranks, std::int64_t N,
                  std::int64_t V) {
  call_out all = ranks[0];
  all.grad.assign(N * V, 0.0);
  for (int r = 0; r < sp.ranks(); ++r)
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t c = 0; c < sp.cols(r); ++c)
        all.grad[n * V + sp.first(r) + c] = ranks[r].grad[n * sp.cols(r) + c];
  return all;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

/// Every rank's forward outputs equal rank 0's bit for bit, and each rank counted no error.
std::string check_ranks_agree(const std::vector<call_out>& ranks) {
  std::string e;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].errors != 0) e += "rank " + std::to_string(r) + " counted device errors; ";
    if (r == 0) continue;
    bool same = same_bits(ranks[r].loss, ranks[0].loss) && ranks[r].correct == ranks[0].correct &&
                ranks[r].argmax == ranks[0].argmax;
    for (std::size_t n = 0; n < ranks[0].lse.size(); ++n)
      same = same && same_bits(ranks[r].lse[n], ranks[0].lse[n]) &&
             same_bits(ranks[r].row_loss[n], ranks[0].row_loss[n]);
    if (!same) e += "rank " + std::to_string(r) + "'s forward outputs differ from rank 0's; ";
  }
  return e;
}

/// The assembled result against the oracle (the backend tests' tolerances) and against the
/// unsharded call (twice those, plus a rounding of the dtype: both err; argmax exactly).
template <class T>
void check_against(const host_case<T>& hc, const call_out& got, const call_out& unsharded,
                   const char* what) {
  SCOPED_TRACE(what);
  const vp_spec& s = hc.s;
  const oracle::result& ref = hc.ref;
  const std::int64_t N = s.rows, V = s.cols;
  const double u = xent_test::unit_roundoff<T>();
  for (std::int64_t n = 0; n < N; ++n) {
    const double tol_row = 64 * std::ldexp(1.0, -24) * (ref.row_magnitude[n] + 1e-30) + 1e-30;
    EXPECT_NEAR(got.row_loss[n], ref.row_loss[n], tol_row) << "row " << n;
    EXPECT_NEAR(got.row_loss[n], unsharded.row_loss[n], 2 * tol_row) << "row " << n;
    const double tol_lse = 1e-5 * (std::fabs(ref.lse[n]) + 1);
    EXPECT_NEAR(got.lse[n], ref.lse[n], tol_lse) << "row " << n;
    EXPECT_NEAR(got.lse[n], unsharded.lse[n], 2 * tol_lse) << "row " << n;
    EXPECT_EQ(got.argmax[n], unsharded.argmax[n]) << "row " << n;
    if (got.argmax[n] != ref.argmax[n]) {  // a tie after rounding may pick an equal value
      ASSERT_GE(got.argmax[n], 0) << "row " << n;
      EXPECT_EQ(ref.z[n * V + got.argmax[n]], ref.z[n * V + ref.argmax[n]]) << "row " << n;
    }
  }
  if (s.reduce != reduction::none) {
    if (std::isnan(ref.loss)) {
      EXPECT_TRUE(std::isnan(got.loss));
    } else {
      EXPECT_NEAR(got.loss, ref.loss, 1e-5 * std::fabs(ref.loss) + 1e-6);
      EXPECT_NEAR(got.loss, unsharded.loss, 2e-5 * std::fabs(ref.loss) + 2e-6);
    }
  }
  if (!s.soft) {
    EXPECT_EQ(got.correct, ref.num_correct);
    EXPECT_EQ(got.correct, unsharded.correct);
  }
  for (std::int64_t i = 0; i < N * V; ++i) {
    const double want = ref.grad[i];
    const double tol = xent_test::gradient_tolerance<T>(want, ref.grad_magnitude[i]);
    if (!(std::fabs(got.grad[i] - want) <= tol) ||
        !(std::fabs(got.grad[i] - unsharded.grad[i]) <=
          2 * tol + 2 * u * std::fabs(unsharded.grad[i]))) {
      ADD_FAILURE() << "grad[" << i / V << "," << i % V << "] = " << got.grad[i] << ", oracle "
                    << want << ", unsharded " << unsharded.grad[i] << " (tol " << tol << ")";
      return;
    }
  }
}

/// One case on one split: every rank's fused and unfused results.
template <class T>
void check_ranks(const host_case<T>& hc, const split& sp,
                 const std::vector<std::vector<call_out>>& per_rank,
                 const std::vector<call_out>& unsharded) {
  SCOPED_TRACE(hc.s.name() + ", " + sp.name());
  for (int form = 0; form < 2; ++form) {
    std::vector<call_out> ranks;
    for (const auto& r : per_rank) ranks.push_back(r[form]);
    EXPECT_EQ(check_ranks_agree(ranks), "") << (form == 0 ? "forward_backward" : "fwd + bwd");
    check_against(hc, assemble(sp, ranks, hc.s.rows, hc.s.cols), unsharded[form],
                  form == 0 ? "forward_backward" : "forward + backward");
  }
}

/// The options of CudaBackend's sweep, cut to what ranks change: the six CPU variants (plain,
/// ignore + weights, smoothing, smoothing + weights, z-loss + softcap, soft targets + weights +
/// smoothing) under each reduction.
std::vector<vp_spec> option_specs(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::vector<vp_spec> out;
  for (reduction red : {reduction::mean, reduction::sum, reduction::none})
    for (int variant = 0; variant < 6; ++variant) {
      vp_spec s;
      s.rows = rows;
      s.cols = cols;
      s.reduce = red;
      s.seed = ++seed;
      s.soft = variant == 5;
      s.some_ignored = variant == 1;
      s.smoothing = variant >= 2 ? 0.1f : 0.0f;
      s.weights = variant == 1 || variant == 3 || variant == 5;
      s.z_loss = variant == 4 ? 1e-3f : 0.0f;
      s.softcap = variant == 4 ? 30.0f : 0.0f;
      out.push_back(s);
    }
  return out;
}

template <class T>
void staged_sweep(std::int64_t rows, std::int64_t cols, std::uint64_t seed,
                  std::vector<int> rank_counts) {
  for (const vp_spec& s : option_specs(rows, cols, seed)) {
    const host_case<T> hc = make_case<T>(s);
    const auto unsharded = run_unsharded(hc);
    for (int ranks : rank_counts)
      for (const split& sp : splits(cols, ranks)) {
        check_ranks(hc, sp, run_staged(hc, sp), unsharded);
        if (::testing::Test::HasFailure()) return;  // one failing case says enough
      }
  }
}

template <class T>
class CudaVocabParallel : public ::testing::Test {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};
using dtypes = ::testing::Types<float, Eigen::bfloat16, Eigen::half>;
TYPED_TEST_SUITE(CudaVocabParallel, dtypes);

TYPED_TEST(CudaVocabParallel, MatchesUnshardedAndOracleForEveryOptionOnOneToFourRanks) {
  staged_sweep<TypeParam>(19, 3001, 100, {1, 2, 3, 4});
}

TYPED_TEST(CudaVocabParallel, MatchesUnshardedAndOracleAcrossEdgeVocabularySizes) {
  // V = 1 and 2 on 3 ranks leave shards empty; 4097 and 50257 split unevenly.
  std::uint64_t seed = 500;
  for (std::int64_t V : {1, 2, 3, 4097, 50257}) {
    vp_spec s;
    s.rows = 5;
    s.cols = V;
    s.smoothing = 0.1f;
    s.some_ignored = true;
    s.seed = ++seed;
    const host_case<TypeParam> hc = make_case<TypeParam>(s);
    const auto unsharded = run_unsharded(hc);
    for (int ranks : {2, 3})
      for (const split& sp : splits(V, ranks)) check_ranks(hc, sp, run_staged(hc, sp), unsharded);
  }
}

TYPED_TEST(CudaVocabParallel, MatchesUnshardedOnLongShardsAndManyRows) {
  // Shards of 65537 classes stream through a cluster in chunks; 733 rows take the forward's
  // whole-row path on an H100 / H200 (>= 396 rows).
  for (auto shape : {std::pair<std::int64_t, std::int64_t>{3, 131073}, {733, 2048}}) {
    vp_spec s;
    s.rows = shape.first;
    s.cols = shape.second;
    s.smoothing = 0.1f;
    s.weights = true;
    s.some_ignored = true;
    const host_case<TypeParam> hc = make_case<TypeParam>(s);
    const auto unsharded = run_unsharded(hc);
    for (const split& sp : splits(s.cols, 2)) check_ranks(hc, sp, run_staged(hc, sp), unsharded);
  }
}

TEST(CudaVocabParallelSemantics, AllRowsIgnoredAndNoRows) {
  REQUIRE_GPU();
  for (reduction red : {reduction::mean, reduction::sum}) {
    for (std::int64_t rows : {0, 4}) {
      vp_spec s;
      s.rows = rows;
      s.cols = 37;
      s.reduce = red;
      s.smoothing = 0.1f;
      s.weights = true;
      host_case<float> hc = make_case<float>(s);
      for (auto& y : hc.y) y = -100;
      oracle::problem pb;  // re-evaluate with every row ignored
      pb.rows = rows;
      pb.cols = 37;
      for (float v : hc.x) pb.logits.push_back(v);
      pb.targets = hc.y;
      pb.weights.assign(hc.w.begin(), hc.w.end());
      pb.label_smoothing = 0.1;
      pb.reduce = static_cast<oracle::reduction>(static_cast<int>(red));
      oracle::upstream up;
      up.scale = 0.75;
      hc.ref = oracle::evaluate(pb, &up);
      const auto unsharded = run_unsharded(hc);
      check_ranks(hc, even_split(37, 3), run_staged(hc, even_split(37, 3)), unsharded);
    }
  }
}

/// A forward_backward on 2 staged ranks whose shards are given, returning each rank's outputs.
std::vector<call_out> two_ranks(const host_case<float>& hc, std::int64_t first0, std::int64_t cols0,
                                std::int64_t first1, std::int64_t cols1) {
  std::vector<call_out> out(2);
  xent_test::on_staged_ranks(2, [&](const staged_group& g) {
    const std::int64_t first = g.rank() == 0 ? first0 : first1;
    const std::int64_t cols = g.rank() == 0 ? cols0 : cols1;
    const xent::vocab_shard shard{first, hc.s.cols};
    out[g.rank()] = run_calls(
        hc, first, cols, 2, g.stream(),
        [&](const xent::cuda& exec, auto x, auto targets, const xent::options& opts,
            const xent::upstream& up, const xent::forward_outputs& o, auto grad, bool fused,
            xent::vector_view<const float>) {
          if (fused)
            xent::vocab_parallel_forward_backward(exec, g, x, shard, targets, opts, up, o, grad);
        })[0];
  });
  return out;
}

TEST(CudaVocabParallelErrors, ShardsThatDoNotTileGiveNanOutputsAndOneErrorOnEveryRank) {
  REQUIRE_GPU();
  vp_spec s;
  s.rows = 5;
  s.cols = 20;
  const host_case<float> hc = make_case<float>(s);
  // Overlapping shards [0, 12) and [8, 20); then a gap: [0, 8) and [12, 20).
  for (const auto& shards :
       {std::vector<std::int64_t>{0, 12, 8, 12}, std::vector<std::int64_t>{0, 8, 12, 8}}) {
    const auto out = two_ranks(hc, shards[0], shards[1], shards[2], shards[3]);
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_EQ(out[r].errors, 1);
      EXPECT_TRUE(std::isnan(out[r].loss));
      for (std::int64_t n = 0; n < s.rows; ++n) {
        EXPECT_TRUE(std::isnan(out[r].row_loss[n]));
        EXPECT_TRUE(std::isnan(out[r].lse[n]));
        EXPECT_EQ(out[r].argmax[n], -1);
      }
      EXPECT_EQ(out[r].correct, 0);
    }
  }
}

TEST(CudaVocabParallelErrors, OutOfRangeTargetIsNanWithZeroGradientCountedOncePerRank) {
  REQUIRE_GPU();
  vp_spec s;
  s.rows = 4;
  s.cols = 20;
  s.reduce = reduction::sum;
  host_case<float> hc = make_case<float>(s);
  hc.y[1] = 20;  // V: outside [0, V) although rank 1's columns end there
  hc.y[2] = -3;
  const auto out = two_ranks(hc, 0, 10, 10, 10);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(out[r].errors, 2);
    EXPECT_TRUE(std::isnan(out[r].row_loss[1]));
    EXPECT_TRUE(std::isnan(out[r].row_loss[2]));
    EXPECT_FALSE(std::isnan(out[r].row_loss[0]));
    EXPECT_NEAR(out[r].row_loss[0], hc.ref.row_loss[0], 1e-5 * (1 + hc.ref.row_loss[0]));
    for (std::int64_t c = 0; c < 10; ++c) {
      EXPECT_EQ(out[r].grad[1 * 10 + c], 0.0);
      EXPECT_EQ(out[r].grad[2 * 10 + c], 0.0);
    }
  }
}

TEST(CudaVocabParallelErrors, SmallWorkspaceAndForeignStreamAreClearErrors) {
  REQUIRE_GPU();
  dbuf<float> x(std::vector<float>(30, 1.0f)), loss(1);
  dbuf<std::int64_t> y(std::vector<std::int64_t>{0, 1, 2});
  dbuf<char> ws(xent::cuda_vocab_parallel_workspace_size(3, 1) - 1);
  xent::inprocess_group group(1);
  cudaStream_t other;
  ok(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  auto argument = [&](cudaStream_t group_stream, std::size_t bytes) -> std::string {
    std::string arg = "(no error)";
    group.run([&](xent::inprocess_group::communicator comm) {
      try {
        xent::vocab_parallel_forward(
            xent::cuda{nullptr, ws.ptr, bytes, nullptr}, staged_group(comm, group_stream),
            xent::matrix_view<const float>(x.ptr, 3, 10), xent::vocab_shard{0, 10},
            xent::vector_view<const std::int64_t>(y.ptr, 3), xent::options{},
            xent::forward_outputs{loss.ptr});
      } catch (const xent::error& e) {
        arg = e.argument();
      }
    });
    return arg;
  };
  EXPECT_EQ(argument(nullptr, ws.n), "exec.workspace");
  EXPECT_EQ(argument(other, ws.n + 1), "group");
  cudaStreamDestroy(other);
}

#if defined(XENT_HAS_NCCL)

using xent_test::nccl_comms;
using xent_test::visible_gpus;

/// Every rank's results on `sp` over NCCL, rank r on device r, one thread per rank.
template <class T>
std::vector<std::vector<call_out>> run_nccl(const host_case<T>& hc, const split& sp,
                                            const nccl_comms& nc) {
  std::vector<std::vector<call_out>> res(static_cast<std::size_t>(sp.ranks()));
  xent_test::on_nccl_ranks(
      nc, [&](const xent::nccl_group& group) { res[group.rank()] = run_rank(hc, sp, group); });
  return res;
}

TEST(NcclVocabParallel, OneRankGroupMatchesTheUnshardedCall) {
  REQUIRE_GPU();
  nccl_comms nc(1);
  ASSERT_EQ(nc.comms.size(), 1u);
  for (const vp_spec& s : option_specs(7, 1000, 700)) {
    const host_case<Eigen::bfloat16> hc = make_case<Eigen::bfloat16>(s);
    const split sp = even_split(s.cols, 1);
    check_ranks(hc, sp, run_nccl(hc, sp, nc), run_unsharded(hc));
  }
}

TEST(NcclVocabParallel, GroupOverEveryVisibleGpuMatchesUnshardedAndOracle) {
  REQUIRE_GPU();
  const int gpus = std::min(visible_gpus(), 8);
  if (gpus < 2)
    GTEST_SKIP() << "needs at least 2 GPUs for a multi-rank NCCL group; " << gpus
                 << " visible (the one-rank and staged tests cover the rest)";
  nccl_comms nc(gpus);
  ASSERT_EQ(nc.comms.size(), static_cast<std::size_t>(gpus));
  std::uint64_t seed = 900;
  auto sweep = [&](auto dtype_tag, std::int64_t rows, std::int64_t cols) {
    using T = decltype(dtype_tag);
    for (const vp_spec& s : option_specs(rows, cols, seed += 50)) {
      const host_case<T> hc = make_case<T>(s);
      const auto unsharded = run_unsharded(hc);  // on device 0
      for (const split& sp : splits(cols, gpus)) {
        check_ranks(hc, sp, run_nccl(hc, sp, nc), unsharded);
        if (::testing::Test::HasFailure()) return;
      }
    }
  };
  sweep(float{}, 19, 3001);
  sweep(Eigen::bfloat16{}, 19, 32003);
  sweep(Eigen::half{}, 7, 50257);
}

/// The one-rank NCCL path in a CUDA graph: captured, replayed, equal to the direct call bit for bit
/// (NCCL collectives are capturable; nothing in the call waits for the host).
TEST(NcclVocabParallel, ForwardBackwardUnderStreamCaptureMatchesTheDirectCall) {
  REQUIRE_GPU();
  nccl_comms nc(1);
  ASSERT_EQ(nc.comms.size(), 1u);
  vp_spec s;
  s.rows = 64;
  s.cols = 32000;
  s.smoothing = 0.1f;
  const host_case<Eigen::bfloat16> hc = make_case<Eigen::bfloat16>(s);
  cudaStream_t stream;
  ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const xent::nccl_group group(nc.comms[0], stream);
  rank_buffers<Eigen::bfloat16> b(hc, 0, s.cols, 1);
  const xent::cuda exec{stream, b.ws.ptr, b.ws.n, b.errors.ptr};
  xent::forward_outputs out;
  out.loss = b.loss.ptr;
  out.lse = {b.lse.ptr, s.rows};
  const xent::vector_view<const std::int64_t> y(b.y.ptr, s.rows);
  const xent::matrix_view<const Eigen::bfloat16> x(b.x.ptr, s.rows, s.cols);
  const xent::matrix_view<Eigen::bfloat16> g(b.grad.ptr, s.rows, s.cols);
  const xent::options opts = hc.options(nullptr);
  xent::vocab_parallel_forward_backward(exec, group, x, {0, s.cols}, y, opts, {}, out, g);
  ok(cudaStreamSynchronize(stream));
  const auto direct = b.grad.download();
  const float direct_loss = b.loss.download()[0];
  ok(cudaMemset(b.grad.ptr, 0, b.grad.n * sizeof(Eigen::bfloat16)));
  ok(cudaMemset(b.loss.ptr, 0, sizeof(float)));

  cudaGraph_t graph;
  cudaGraphExec_t inst;
  ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  xent::vocab_parallel_forward_backward(exec, group, x, {0, s.cols}, y, opts, {}, out, g);
  ok(cudaStreamEndCapture(stream, &graph));
  ok(cudaGraphInstantiate(&inst, graph, 0));
  for (int replay = 0; replay < 2; ++replay) ok(cudaGraphLaunch(inst, stream));
  ok(cudaStreamSynchronize(stream));
  EXPECT_EQ(b.loss.download()[0], direct_loss);
  const auto captured = b.grad.download();
  EXPECT_EQ(std::memcmp(captured.data(), direct.data(), direct.size() * sizeof(Eigen::bfloat16)),
            0);
  EXPECT_EQ(b.errors.download()[0], 0);
  cudaGraphExecDestroy(inst);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

#else

TEST(NcclVocabParallel, SkippedWithoutNccl) {
  GTEST_SKIP() << "built without NCCL (XENT_HAS_NCCL undefined): the NCCL group tests are not "
                  "compiled; the staged-group tests cover the CUDA path";
}

#endif

}  // namespace
