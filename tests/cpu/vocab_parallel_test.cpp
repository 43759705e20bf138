// Vocab-parallel calls on an in-process group of 1-4 ranks (threads), the vocabulary cut into
// uneven shards (in some cases one of them empty, or the shards out of class order). Each case runs
// forward_backward, and forward then backward from the saved LSE, on every rank; checks that every
// rank wrote the same forward outputs, bit for bit; assembles the gradient shards into one N x V
// gradient; and holds the result to the float64 oracle and to the unsharded CPU call with the
// harness's checks and tolerances (doubled for the comparison with the unsharded call: both err).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "harness.hpp"
#include "vocab_split.hpp"

namespace {

using xent::reduction;
using xt::ignore_mode;
using xt::spec;
using xt::target_kind;

using xt::even_split;
using xt::split;

/// One rank's copy of its columns of a case's logits (and soft targets), ld = cols + pad.
template <class T>
struct shard_data {
  std::int64_t first = 0, cols = 0, ld = 0;
  std::vector<T> logits, probs;
};

template <class T>
shard_data<T> cut(const xt::dataset<T>& d, std::int64_t first, std::int64_t last) {
  const spec& s = d.s;
  shard_data<T> sd;
  sd.first = first;
  sd.cols = last - first;
  sd.ld = sd.cols + s.pad;
  sd.logits.assign(s.rows * sd.ld, xt::sentinel<T>());
  if (s.kind == target_kind::soft) sd.probs.assign(s.rows * sd.ld, xt::sentinel<T>());
  for (std::int64_t n = 0; n < s.rows; ++n)
    for (std::int64_t c = 0; c < sd.cols; ++c) {
      sd.logits[n * sd.ld + c] = d.x(n, first + c);
      if (s.kind == target_kind::soft) sd.probs[n * sd.ld + c] = d.probs[n * s.ld() + first + c];
    }
  return sd;
}

/// Calls f(targets) with the case's global targets, or the shard's soft targets.
template <class T, class F>
void with_shard_targets(const xt::dataset<T>& d, const shard_data<T>& sd, F&& f) {
  if (d.s.kind == target_kind::soft)
    f(xent::soft_targets<T>{xent::matrix_view<const T>(sd.probs.data(), d.s.rows, sd.cols, sd.ld)});
  else
    d.with_targets(f);
}

/// Runs one vocab-parallel call per rank (fused: forward_backward; else forward, then backward
/// from the LSE) into per-rank call_results, whose grad holds the rank's shard (rows x shard ld).
template <class T, class G>
std::vector<xt::call_result<G>> run_ranks(const xt::dataset<T>& d, const split& b, bool fused,
                                          const xent::options& opts) {
  const spec& s = d.s;
  const int ranks = b.ranks();
  const bool has_loss = s.reduce != reduction::none;
  const bool soft = s.kind == target_kind::soft;
  std::vector<xt::call_result<G>> res(ranks);
  std::vector<shard_data<T>> shards;
  for (int r = 0; r < ranks; ++r) shards.push_back(cut(d, b.first(r), b.first(r) + b.cols(r)));
  xent::inprocess_group group(ranks);
  group.run([&](xent::inprocess_group::communicator comm) {
    const int r = comm.rank();
    const shard_data<T>& sd = shards[r];
    xt::call_result<G>& out = res[r];
    out.row_loss.assign(s.rows, 12345.0f);
    out.lse.assign(s.rows, 12345.0f);
    out.argmax.assign(s.rows, -777);
    out.grad.assign(s.rows * sd.ld, xt::sentinel<G>());
    xent::forward_outputs o;
    if (has_loss) o.loss = &out.loss;
    o.row_loss = {out.row_loss.data(), s.rows};
    o.lse = {out.lse.data(), s.rows};
    o.argmax = {out.argmax.data(), s.rows};
    if (!soft) o.num_correct = &out.correct;
    const xent::matrix_view<const T> x(sd.logits.data(), s.rows, sd.cols, sd.ld);
    const xent::matrix_view<G> g(out.grad.data(), s.rows, sd.cols, sd.ld);
    const xent::vocab_shard shard{sd.first, s.cols};
    with_shard_targets(d, sd, [&](auto targets) {
      if (fused) {
        xent::vocab_parallel_forward_backward(d.exec(), comm, x, shard, targets, opts, d.upstream(),
                                              o, g);
      } else {
        xent::vocab_parallel_forward(d.exec(), comm, x, shard, targets, opts, o);
        xent::vocab_parallel_backward(d.exec(), comm, x, shard, targets, opts,
                                      xent::vector_view<const float>(out.lse.data(), s.rows),
                                      d.upstream(), g);
      }
    });
  });
  return res;
}

/// The ranks' results as one unsharded result: rank 0's forward outputs, the gradient shards
/// side by side (rows x ld of the case, padding holding the sentinel).
template <class T, class G>
xt::call_result<G> assemble(const xt::dataset<T>& d, const split& b,
                            const std::vector<xt::call_result<G>>& res) {
  const spec& s = d.s;
  xt::call_result<G> all = res[0];
  all.grad.assign(s.rows * s.ld(), xt::sentinel<G>());
  for (int r = 0; r < b.ranks(); ++r) {
    const std::int64_t cols = b.cols(r), ld = cols + s.pad;
    for (std::int64_t n = 0; n < s.rows; ++n) {
      for (std::int64_t c = 0; c < cols; ++c)
        all.grad[n * s.ld() + b.first(r) + c] = res[r].grad[n * ld + c];
      for (std::int64_t c = cols; c < ld; ++c)
        if (!xt::same_bits(res[r].grad[n * ld + c], xt::sentinel<G>()))
          ADD_FAILURE() << "rank " << r << " wrote padding column " << c << " of row " << n;
    }
  }
  return all;
}

/// Every rank's forward outputs equal rank 0's, bit for bit.
template <class G>
std::string check_ranks_agree(const std::vector<xt::call_result<G>>& res) {
  std::string e;
  for (std::size_t r = 1; r < res.size(); ++r) {
    const bool same =
        xt::same_bits(res[r].loss, res[0].loss) && res[r].correct == res[0].correct &&
        res[r].argmax == res[0].argmax &&
        std::equal(res[r].row_loss.begin(), res[r].row_loss.end(), res[0].row_loss.begin(),
                   xt::same_bits<float>) &&
        std::equal(res[r].lse.begin(), res[r].lse.end(), res[0].lse.begin(), xt::same_bits<float>);
    if (!same) e += "  rank " + std::to_string(r) + "'s forward outputs differ from rank 0's\n";
  }
  return e;
}

/// A call_result's forward outputs in the harness's guarded form, for check_forward.
template <class G>
xt::forward_result as_forward(const xt::call_result<G>& c) {
  xt::forward_result f(static_cast<std::int64_t>(c.lse.size()));
  std::copy(c.row_loss.begin(), c.row_loss.end(), f.row_loss.data());
  std::copy(c.lse.begin(), c.lse.end(), f.lse.data());
  std::copy(c.argmax.begin(), c.argmax.end(), f.argmax.data());
  f.loss.data()[0] = c.loss;
  f.correct.data()[0] = c.correct;
  return f;
}

/// The oracle's result with the unsharded xent call's values in place of the float64 ones (its
/// magnitudes, which size the tolerances, kept).
template <class G>
oracle::result as_reference(oracle::result r, const spec& s, const xt::call_result<G>& u) {
  for (std::int64_t n = 0; n < s.rows; ++n) {
    r.row_loss[n] = u.row_loss[n];
    r.lse[n] = u.lse[n];
    r.argmax[n] = u.argmax[n];
    for (std::int64_t c = 0; c < s.cols; ++c)
      r.grad[n * s.cols + c] = xt::to_double(u.grad[n * s.ld() + c]);
  }
  r.loss = u.loss;
  return r;
}

/// The sharded call against the unsharded one, both with float gradients: a bf16 / fp16 gradient
/// element from each may round to neighbouring values (a float difference far below the
/// tolerance can straddle a rounding boundary), which the oracle checks judge separately.
template <class T>
std::string compare_with_unsharded(const xt::dataset<T>& d, const split& b, bool fused,
                                   const oracle::result& r) {
  xt::dataset<T> loose = d;  // the unsharded call errs too: twice the tolerances
  loose.s.forward_tol = 2 * d.s.fwd_tol();
  loose.s.grad_tol = 2 * d.s.bwd_tol();
  const xt::call_result<float> all = assemble(d, b, run_ranks<T, float>(d, b, fused, d.options()));
  const xt::call_result<float> u = xt::call<T, float>(d, fused);
  const oracle::result ur = as_reference(r, d.s, u);
  xt::forward_result f = as_forward(all);
  std::string e = xt::check_forward(loose, ur, f, d.s.reduce != reduction::none) +
                  xt::check_gradient<T, float>(loose, ur, all.grad.data());
  if (all.correct != u.correct || all.argmax != u.argmax) e += "  argmax / num_correct differ\n";
  return e;
}

/// One case: both call forms, every rank, against the oracle and the unsharded call.
template <class T, class G = T>
bool run_vp_case(const xt::dataset<T>& d, const split& b) {
  const spec& s = d.s;
  const oracle::upstream oup = d.oracle_upstream();
  const oracle::result r = oracle::evaluate(d.problem(), &oup);
  std::string errors;
  auto note = [&](const std::string& what, const std::string& e) {
    if (!e.empty()) errors += what + ":\n" + e;
  };
  for (bool fused : {true, false}) {
    const std::string form = fused ? "forward_backward" : "forward + backward";
    const auto res = run_ranks<T, G>(d, b, fused, d.options());
    note(form + ", ranks", check_ranks_agree(res));
    const xt::call_result<G> all = assemble(d, b, res);
    xt::forward_result f = as_forward(all);
    note(form + " vs oracle", xt::check_forward(d, r, f, s.reduce != reduction::none));
    note(form + " gradient vs oracle", xt::check_gradient<T, G>(d, r, all.grad.data()));
    note(form + " vs unsharded (float gradients)", compare_with_unsharded(d, b, fused, r));
  }
  if (!errors.empty()) {
    ADD_FAILURE() << "case " << xt::dtype_name<T>() << " -> " << xt::dtype_name<G>() << ", "
                  << s.describe() << ", " << b.name() << "\n"
                  << errors;
    return false;
  }
  return true;
}

template <class T>
void sweep_options(std::int64_t rows, std::int64_t vocab, int threads, std::uint64_t seed0) {
  xt::case_budget budget;
  std::uint64_t seed = seed0;
  for (int ranks = 1; ranks <= 4; ++ranks)
    for (const split& b : xt::splits(vocab, ranks))
      for (reduction red : {reduction::mean, reduction::sum, reduction::none})
        for (int variant = 0; variant < 6; ++variant) {
          spec s;
          s.rows = rows;
          s.cols = vocab;
          s.pad = variant % 2;
          s.threads = threads;
          s.reduce = red;
          s.seed = ++seed;
          s.kind = variant == 5 ? target_kind::soft
                                : (variant % 2 ? target_kind::int32 : target_kind::int64);
          s.ignore = variant == 1 ? ignore_mode::some : ignore_mode::none;
          s.label_smoothing = variant >= 2 ? 0.1f : 0.0f;
          s.weights = variant == 3 || variant == 5 || variant == 1;
          s.z_loss = variant == 4 ? 1e-3f : 0.0f;
          s.softcap = variant == 4 ? 5.0f : 0.0f;
          s.up = variant % 3 == 0 ? xt::upstream_mode::pointer_or_rows : xt::upstream_mode::scale;
          if (!budget.record(run_vp_case<T>(xt::make_dataset<T>(s), b))) return;
        }
}

TEST(CpuVocabParallel, MatchesUnshardedAndOracleFloat32) { sweep_options<float>(7, 37, 1, 100); }

TEST(CpuVocabParallel, MatchesUnshardedAndOracleBfloat16) {
  sweep_options<xt::bf16>(7, 37, 1, 200);
}

TEST(CpuVocabParallel, MatchesUnshardedAndOracleHalf) { sweep_options<xt::half>(7, 37, 1, 300); }

TEST(CpuVocabParallel, MatchesUnshardedAndOracleWithChunksAndThreads) {
  // Shards longer than a chunk and a thread split within a rank's shard (rows < threads).
  xt::case_budget budget;
  std::uint64_t seed = 400;
  for (std::int64_t rows : {1, 5})
    for (int ranks : {2, 3})
      for (int variant = 0; variant < 3; ++variant) {
        spec s;
        s.rows = rows;
        s.cols = 20011;
        s.threads = 4;
        s.chunk = 512;
        s.seed = ++seed;
        s.label_smoothing = variant >= 1 ? 0.2f : 0.0f;
        s.weights = variant == 2;
        s.kind = variant == 2 ? target_kind::soft : target_kind::int64;
        if (!budget.record(
                run_vp_case<float>(xt::make_dataset<float>(s), even_split(s.cols, ranks))))
          return;
      }
}

TEST(CpuVocabParallel, Float32LogitsBfloat16Gradient) {
  spec s;
  s.rows = 9;
  s.cols = 37;
  s.label_smoothing = 0.1f;
  s.weights = true;
  s.ignore = ignore_mode::some;
  run_vp_case<float, xt::bf16>(xt::make_dataset<float>(s), even_split(37, 4));
}

TEST(CpuVocabParallel, AllRowsIgnoredAndNoRows) {
  for (reduction red : {reduction::mean, reduction::sum, reduction::none}) {
    spec s;
    s.rows = 4;
    s.cols = 37;
    s.reduce = red;
    s.ignore = ignore_mode::all;
    s.label_smoothing = 0.1f;
    s.weights = true;
    run_vp_case<float>(xt::make_dataset<float>(s), even_split(37, 3));
    s.rows = 0;
    run_vp_case<float>(xt::make_dataset<float>(s), even_split(37, 3));
  }
}

TEST(CpuVocabParallel, MoreRanksThanClasses) {
  spec s;
  s.rows = 5;
  s.cols = 3;
  s.label_smoothing = 0.3f;
  s.ignore = ignore_mode::some;
  run_vp_case<float>(xt::make_dataset<float>(s), even_split(3, 4));  // one shard empty
}

// The comparison can fail: Megatron-Core's vocab-parallel label smoothing spreads eps over each
// rank's V_local classes; a result computed that way must fail the check that this backend passes.
TEST(CpuVocabParallel, PerShardSmoothingWouldFailTheCheck) {
  spec s;
  s.rows = 6;
  s.cols = 37;
  s.label_smoothing = 0.2f;
  const auto d = xt::make_dataset<float>(s);
  const split b = even_split(s.cols, 4);
  const oracle::result r = oracle::evaluate(d.problem());
  const auto res = run_ranks<float, float>(d, b, true, d.options());
  xt::forward_result good = as_forward(assemble(d, b, res));
  EXPECT_EQ(xt::check_forward(d, r, good, true), "");

  // Per-shard smoothing: each rank's eps / R spread over its own V_local classes.
  xt::call_result<float> megatron = res[0];
  const double eps = s.label_smoothing;
  double total = 0.0;
  for (std::int64_t n = 0; n < s.rows; ++n) {
    double smooth = 0.0;
    for (int k = 0; k < b.ranks(); ++k)
      for (std::int64_t c = b.first(k); c < b.first(k) + b.cols(k); ++c)
        smooth += (r.lse[n] - r.z[n * s.cols + c]) / static_cast<double>(b.cols(k));
    const double nll = r.lse[n] - r.z[n * s.cols + d.target(n)];
    megatron.row_loss[n] = static_cast<float>((1 - eps) * nll + eps / b.ranks() * smooth);
    total += megatron.row_loss[n];
  }
  megatron.loss = static_cast<float>(total / static_cast<double>(s.rows));
  xt::forward_result bad = as_forward(megatron);
  EXPECT_NE(xt::check_forward(d, r, bad, true), "")
      << "per-shard smoothing passed the check: the test could not tell it from eps / V";
}

// ---------------------------------------------------------------------------------------------
// Bad arguments: xent::error naming the argument; errors in shared arguments on every rank
// ---------------------------------------------------------------------------------------------

struct vp_args {
  std::vector<float> logits = std::vector<float>(3 * 10, 0.5f);
  std::vector<std::int64_t> targets{1, 9, 4};
  std::vector<float> weights = std::vector<float>(37, 1.0f);
  float loss = 0.0f;

  xent::matrix_view<const float> view(std::int64_t cols = 10) const {
    return {logits.data(), 3, cols};
  }
  xent::vector_view<const std::int64_t> ids() const { return {targets.data(), 3}; }
  xent::forward_outputs out() {
    xent::forward_outputs o;
    o.loss = &loss;
    return o;
  }
};

/// The argument named by the xent::error that a one-rank forward throws.
std::string error_argument(const xent::vocab_shard& shard, const xent::options& opts,
                           std::int64_t cols = 10, std::vector<std::int64_t> targets = {1, 9, 4}) {
  vp_args a;
  a.targets = targets;
  xent::inprocess_group group(1);
  try {
    group.run([&](xent::inprocess_group::communicator comm) {
      xent::vocab_parallel_forward(xent::cpu{}, comm, a.view(cols), shard, a.ids(), opts, a.out());
    });
  } catch (const xent::error& e) {
    return e.argument();
  }
  return "(no error)";
}

TEST(CpuVocabParallelValidation, ShardOutsideTheVocabulary) {
  EXPECT_EQ(error_argument({30, 37}, {}), "shard.first");  // [30, 40) past V = 37
  EXPECT_EQ(error_argument({-1, 37}, {}), "shard.first");
  EXPECT_EQ(error_argument({0, 0}, {}), "shard.vocab");
}

TEST(CpuVocabParallelValidation, NegativeVocabularyWithNoRows) {
  // No rows need no class, but a vocabulary below 0 is still an error, named as such, checked
  // before anything subtracts from it (shard.vocab - cols overflowed at INT64_MIN + 5: undefined
  // behaviour, then reported as a tiling error, "shard").
  std::vector<float> x(10, 0.5f);
  float loss = 0.0f;
  xent::forward_outputs out;
  out.loss = &loss;
  for (std::int64_t vocab : {std::int64_t{-1}, std::numeric_limits<std::int64_t>::min() + 5}) {
    std::string argument = "(no error)";
    xent::inprocess_group group(1);
    try {
      group.run([&](xent::inprocess_group::communicator comm) {
        xent::vocab_parallel_forward(xent::cpu{}, comm,
                                     xent::matrix_view<const float>(x.data(), 0, 10),
                                     xent::vocab_shard{0, vocab},
                                     xent::vector_view<const std::int64_t>(nullptr, 0), {}, out);
      });
    } catch (const xent::error& e) {
      argument = e.argument();
    }
    EXPECT_EQ(argument, "shard.vocab") << vocab;
  }
}

TEST(CpuVocabParallelValidation, TargetsAreGlobalClassIds) {
  // A target in another rank's shard is valid; one outside [0, V) is not.
  EXPECT_EQ(error_argument({0, 37}, {}, 10, {1, 36, -100}), "shard");  // tiling: only 10 of 37
  EXPECT_EQ(error_argument({0, 37}, {}, 10, {1, 37, 4}), "targets");
  EXPECT_EQ(error_argument({0, 37}, {}, 10, {-1, 3, 4}), "targets");
}

TEST(CpuVocabParallelValidation, ClassWeightsHoldTheWholeVocabulary) {
  vp_args a;
  xent::options opts;
  opts.class_weights = {a.weights.data(), 10};  // the shard's weights only
  EXPECT_EQ(error_argument({0, 37}, opts), "options.class_weights");
}

TEST(CpuVocabParallelValidation, ShardsThatDoNotTileTheVocabularyThrowOnEveryRank) {
  // Two ranks: the shards overlap, leave a gap, or declare different vocabularies.
  struct bad {
    xent::vocab_shard s0, s1;
    const char* argument;
  };
  for (const bad& c : {bad{{0, 20}, {5, 20}, "shard"}, bad{{0, 22}, {12, 22}, "shard"},
                       bad{{0, 20}, {10, 21}, "shard.vocab"}}) {
    vp_args a;
    std::vector<std::string> thrown(2);
    xent::inprocess_group group(2);
    EXPECT_THROW(group.run([&](xent::inprocess_group::communicator comm) {
      const xent::vocab_shard shard = comm.rank() == 0 ? c.s0 : c.s1;
      try {
        xent::vocab_parallel_forward(xent::cpu{}, comm, a.view(), shard, a.ids(), {}, a.out());
      } catch (const xent::error& e) {
        thrown[comm.rank()] = e.argument();
        throw;
      }
    }),
                 xent::error);
    EXPECT_EQ(thrown[0], c.argument);
    EXPECT_EQ(thrown[1], c.argument);
    EXPECT_EQ(a.loss, 0.0f) << "an output was written before the error";
  }
}

TEST(CpuVocabParallelValidation, RanksWithDifferentRowCountsThrow) {
  vp_args a;
  xent::inprocess_group group(2);
  try {
    group.run([&](xent::inprocess_group::communicator comm) {
      const std::int64_t rows = comm.rank() == 0 ? 3 : 2;
      xent::vocab_parallel_forward(xent::cpu{}, comm,
                                   xent::matrix_view<const float>(a.logits.data(), rows, 10),
                                   xent::vocab_shard{comm.rank() * 10, 20},
                                   xent::vector_view<const std::int64_t>(a.targets.data(), rows),
                                   {}, xent::forward_outputs{&a.loss});
    });
    ADD_FAILURE() << "no error";
  } catch (const xent::error& e) {
    EXPECT_EQ(e.argument(), "bytes");
  }
}

TEST(CpuVocabParallelValidation, OneRankFailingDoesNotHangTheOthers) {
  // Rank 1's bad logits view throws before the collective; run() aborts the group, so rank 0
  // leaves its wait and the rank's own error comes out.
  vp_args a;
  xent::inprocess_group group(2);
  try {
    group.run([&](xent::inprocess_group::communicator comm) {
      const std::int64_t ld = comm.rank() == 1 ? 5 : 10;  // ld < cols on rank 1
      xent::vocab_parallel_forward(xent::cpu{}, comm,
                                   xent::matrix_view<const float>(a.logits.data(), 3, 10, ld),
                                   xent::vocab_shard{comm.rank() * 10, 20}, a.ids(), {}, a.out());
    });
    ADD_FAILURE() << "no error";
  } catch (const xent::error& e) {
    EXPECT_EQ(e.argument(), "logits");
  }
}

TEST(CpuVocabParallelValidation, GradientShardAndSoftTargetShapes) {
  vp_args a;
  std::vector<float> g(3 * 37);
  std::vector<float> probs(3 * 37, 1.0f / 37);
  xent::inprocess_group group(1);
  auto argument = [&](auto&& f) -> std::string {
    try {
      group.run([&](xent::inprocess_group::communicator comm) { f(comm); });
    } catch (const xent::error& e) {
      return e.argument();
    }
    return "(no error)";
  };
  const xent::vocab_shard shard{0, 37};
  const xent::matrix_view<const float> x(a.logits.data(), 3, 10);
  EXPECT_EQ(argument([&](auto comm) {
              xent::vocab_parallel_forward_backward(xent::cpu{}, comm, x, shard, a.ids(), {}, {},
                                                    {}, xent::matrix_view<float>(g.data(), 3, 37));
            }),
            "grad");  // the gradient is the shard's, N x V_local
  EXPECT_EQ(argument([&](auto comm) {
              xent::vocab_parallel_forward(
                  xent::cpu{}, comm, x, shard,
                  xent::soft(xent::matrix_view<const float>(probs.data(), 3, 37)), {}, a.out());
            }),
            "targets");  // soft targets are the shard's, N x V_local
}

TEST(CpuVocabParallelValidation, RowsOfAnEmptyShardBeyondWhatAWorkspaceSizeCountsAreRefused) {
  // An empty shard's N x 0 logits hold no element whatever N; the exchange holds (R + 1) records
  // a row, so rows x (R + 3) is bounded by itself (2^55), before any buffer is sized.
  xent::inprocess_group group(1);
  std::string named;
  float loss = 0.0f;
  try {
    group.run([&](xent::inprocess_group::communicator comm) {
      const std::int64_t n = std::int64_t{1} << 57;
      xent::vocab_parallel_forward(xent::cpu{}, comm, xent::matrix_view<const float>(nullptr, n, 0),
                                   xent::vocab_shard{0, 1},
                                   xent::soft(xent::matrix_view<const float>(nullptr, n, 0)), {},
                                   xent::forward_outputs{&loss});
    });
  } catch (const xent::error& e) {
    named = e.argument();
    EXPECT_NE(std::string(e.what()).find("exceeds 2^55"), std::string::npos) << e.what();
  }
  EXPECT_EQ(named, "logits");
}

// ---------------------------------------------------------------------------------------------
// The in-process group itself
// ---------------------------------------------------------------------------------------------

TEST(InprocessGroup, AllGatherPlacesEachRankInRankOrderRepeatedly) {
  xent::inprocess_group group(3);
  std::vector<std::vector<int>> got(3);
  group.run([&](xent::inprocess_group::communicator comm) {
    EXPECT_EQ(comm.size(), 3);
    for (int round = 0; round < 50; ++round) {
      const std::vector<int> mine{comm.rank(), round};
      std::vector<int> all(6);
      comm.all_gather(mine.data(), all.data(), 2 * sizeof(int));
      for (int r = 0; r < 3; ++r) {
        ASSERT_EQ(all[2 * r], r);
        ASSERT_EQ(all[2 * r + 1], round);
      }
    }
  });
}

TEST(InprocessGroup, RejectsBadSizesAndRanks) {
  EXPECT_THROW(xent::inprocess_group(0), xent::error);
  xent::inprocess_group group(2);
  EXPECT_THROW(group.member(2), xent::error);
  EXPECT_THROW(group.member(-1), xent::error);
}

}  // namespace
