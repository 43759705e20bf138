// Vocab-parallel calls on the CPU, ranks as threads of an in-process group: the shared
// vocab-parallel tests (vocab_parallel_backend_tests.hpp: every option and dtype on 1-4 ranks,
// uneven, empty and reordered shards, edge vocabularies, shards longer than a chunk, ignored and
// absent rows, each case held to the ranks' agreement, the float64 oracle and the unsharded call);
// that the checks catch Megatron-Core's per-shard smoothing; argument errors; the in-process group
// itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "harness.hpp"
#include "vocab_parallel_backend_tests.hpp"
#include "vocab_parallel_harness.hpp"
#include "vocab_split.hpp"

namespace {

using xt::spec;
using xt::split;

/// What the CPU backends of the shared vocab-parallel tests (vocab_parallel_backend_tests.hpp)
/// share: the unsharded reference and a case's run; Self provides ranks().
template <class Self>
struct cpu_backend {
  static constexpr bool narrower_gradient = true;
  void set_up() {}
  void tear_down() {}

  template <class T>
  xt::call_result<float> unsharded(const xt::dataset<T>& d, bool fused) const {
    return xt::call<T, float>(d, fused);
  }

  template <class T, class G = T>
  bool run(const spec& s, const split& sp) const {
    return xvp::run_case<T, G>(static_cast<const Self&>(*this), xt::make_dataset<T>(s), sp);
  }
};

/// The CPU backend of the shared vocab-parallel tests: ranks as threads of an in-process group,
/// each on its shard (xvp::shard_of) with the case's xent::cpu.
struct cpu_ranks : cpu_backend<cpu_ranks> {
  template <class T, class G>
  xvp::ranks_result<G> ranks(const xt::dataset<T>& d, const split& sp, bool fused) const {
    const std::vector<xt::dataset<T>> shards = xvp::shards_of(d, sp);
    xvp::ranks_result<G> res;
    for (const auto& in : shards) res.ranks.push_back(xvp::poisoned<G>(d.s.rows, in.s.ld()));
    xent::inprocess_group group(sp.ranks());
    group.run([&](xent::inprocess_group::communicator comm) {
      const int r = comm.rank();
      const xt::dataset<T>& in = shards[r];  // this rank's arguments
      xt::call_result<G>& out = res.ranks[r];
      const std::int64_t N = d.s.rows;
      const xent::forward_outputs o = xvp::all_outputs(
          d.s, N, &out.loss, out.row_loss.data(), out.lse.data(), out.argmax.data(), &out.correct);
      const xent::matrix_view<G> g(out.grad.data(), N, in.s.cols, in.s.ld());
      in.with_targets([&](auto t) {
        xvp::rank_calls(in.exec(), comm, in.view(), {sp.first(r), d.s.cols}, t, in.options(),
                        in.upstream(), o, g, fused);
      });
    });
    return res;
  }
};

/// The split phases (parallel/vocab_parallel_phases.hpp) with a hand-made gather, as the shared
/// tests' backend: every rank's records phase in turn on one thread, their blocks copied side by
/// side in rank order, then every rank's finish; the unfused form's backward takes the LSE and the
/// rows' target mass that its forward finish wrote. Each case also runs the group calls
/// (cpu_ranks) and must match them bit for bit: forward outputs and gradient shards.
struct cpu_split_ranks : cpu_backend<cpu_split_ranks> {
  template <class T, class G>
  xvp::ranks_result<G> ranks(const xt::dataset<T>& d, const split& sp, bool fused) const {
    const std::vector<xt::dataset<T>> shards = xvp::shards_of(d, sp);
    const int R = sp.ranks();
    const std::int64_t N = d.s.rows;
    xvp::ranks_result<G> res;
    for (const auto& in : shards) res.ranks.push_back(xvp::poisoned<G>(N, in.s.ld()));
    const bool argmax = true;  // all_outputs asks for argmax
    const std::size_t block = xent::vocab_parallel_exchange_bytes(
        shards[0].exec(), N, d.s.kind == xt::target_kind::soft, shards[0].options(), argmax);
    std::vector<unsigned char> recv(block * static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r)
      shards[r].with_targets([&](auto t) {
        const xt::dataset<T>& in = shards[r];
        std::vector<unsigned char> send(block);
        xent::vocab_parallel_records(in.exec(), in.view(), {sp.first(r), d.s.cols}, t, in.options(),
                                     argmax, {send.data(), std::int64_t(block)});
        std::copy(send.begin(), send.end(), recv.begin() + static_cast<std::ptrdiff_t>(r * block));
      });
    const xent::vector_view<const unsigned char> gathered(recv.data(),
                                                          static_cast<std::int64_t>(recv.size()));
    for (int r = 0; r < R; ++r) {
      const xt::dataset<T>& in = shards[r];
      xt::call_result<G>& out = res.ranks[r];
      const xent::forward_outputs o = xvp::all_outputs(
          d.s, N, &out.loss, out.row_loss.data(), out.lse.data(), out.argmax.data(), &out.correct);
      const xent::matrix_view<G> g(out.grad.data(), N, in.s.cols, in.s.ld());
      const xent::vocab_shard shard{sp.first(r), d.s.cols};
      in.with_targets([&](auto t) {
        if (fused) {
          xent::vocab_parallel_finish(in.exec(), R, in.view(), shard, t, in.options(), gathered, o,
                                      in.upstream(), g);
          return;
        }
        std::vector<float> mass(static_cast<std::size_t>(N));
        xent::vocab_parallel_finish(in.exec(), R, in.view(), shard, t, in.options(), gathered, o,
                                    xent::vector_view<float>(mass.data(), N));
        xent::vocab_parallel_backward(in.exec(), in.view(), shard, t, in.options(),
                                      xent::vector_view<const float>(o.lse.data, N),
                                      xent::vector_view<const float>(mass.data(), N), in.upstream(),
                                      g);
      });
    }
    const xvp::ranks_result<G> group = cpu_ranks{}.ranks<T, G>(d, sp, fused);
    for (int r = 0; r < R; ++r) {
      if (xvp::forward_bytes(res.ranks[r]) != xvp::forward_bytes(group.ranks[r]))
        res.errors += "  rank " + std::to_string(r) + ": forward outputs differ from the group's\n";
      const auto& a = res.ranks[r].grad;
      const auto& b = group.ranks[r].grad;
      if (!xt::same_vector_bits(a, b))
        res.errors += "  rank " + std::to_string(r) + ": gradient differs from the group's\n";
    }
    return res;
  }
};

// The comparison can fail: Megatron-Core's vocab-parallel label smoothing spreads eps over each
// rank's V_local classes; a result computed that way must fail the check that this backend passes.
TEST(CpuVocabParallel, PerShardSmoothingWouldFailTheCheck) {
  spec s;
  s.rows = 6;
  s.cols = 37;
  s.label_smoothing = 0.2f;
  const auto d = xt::make_dataset<float>(s);
  const split b = xt::even_split(s.cols, 4);
  const oracle::result r = oracle::evaluate(d.problem());
  std::string padding;
  const xt::call_result<float> all =
      xvp::assemble(d, b, cpu_ranks{}.ranks<float, float>(d, b, true).ranks, padding);
  EXPECT_EQ(padding, "");
  xt::forward_result good = xvp::as_forward(all);
  EXPECT_EQ(xt::check_forward(d, r, good, true), "");

  // Per-shard smoothing: each rank's eps / R spread over its own V_local classes.
  xt::call_result<float> megatron = all;
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
  xt::forward_result bad = xvp::as_forward(megatron);
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
  return xt::thrown_argument([&] {
    group.run([&](xent::inprocess_group::communicator comm) {
      xent::vocab_parallel_forward(xent::cpu{}, comm, a.view(cols), shard, a.ids(), opts, a.out());
    });
  });
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
    xent::inprocess_group group(1);
    const std::string argument = xt::thrown_argument([&] {
      group.run([&](xent::inprocess_group::communicator comm) {
        xent::vocab_parallel_forward(xent::cpu{}, comm,
                                     xent::matrix_view<const float>(x.data(), 0, 10),
                                     xent::vocab_shard{0, vocab},
                                     xent::vector_view<const std::int64_t>(nullptr, 0), {}, out);
      });
    });
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
  auto argument = [&](auto&& f) {
    return xt::thrown_argument(
        [&] { group.run([&](xent::inprocess_group::communicator comm) { f(comm); }); });
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
// The split phases' own arguments: the buffers, the gathered headers, the ranks, the row mass
// ---------------------------------------------------------------------------------------------

/// Two ranks' blocks of vp_args' rows, shards {0, 10} and {10, 10} of V = 20 unless `second`
/// says otherwise for rank 1, gathered by hand in rank order.
std::vector<unsigned char> gathered_blocks(vp_args& a, xent::vocab_shard second = {10, 20}) {
  const std::size_t block = xent::vocab_parallel_exchange_bytes(xent::cpu{}, 3, false, {}, false);
  std::vector<unsigned char> recv(2 * block);
  const xent::vocab_shard shards[2] = {{0, 20}, second};
  for (int r = 0; r < 2; ++r)
    xent::vocab_parallel_records(xent::cpu{}, a.view(), shards[r], a.ids(), {}, false,
                                 {recv.data() + r * block, static_cast<std::int64_t>(block)});
  return recv;
}

TEST(CpuVocabParallelSplitValidation, BuffersOfTheWrongSizeAreNamed) {
  vp_args a;
  const std::size_t block = xent::vocab_parallel_exchange_bytes(xent::cpu{}, 3, false, {}, false);
  EXPECT_EQ(block, 32u + 3u * 12u + 4u);  // header, 12-byte records, padding to 8
  std::vector<unsigned char> bytes(3 * block);
  EXPECT_EQ(xt::thrown_argument([&] {
              xent::vocab_parallel_records(xent::cpu{}, a.view(), {0, 20}, a.ids(), {}, false,
                                           {bytes.data(), static_cast<std::int64_t>(block - 8)});
            }),
            "send");
  EXPECT_EQ(xt::thrown_argument([&] {  // argmax asked of the finish: wider records than were sent
              std::int64_t correct = 0;
              xent::forward_outputs o = a.out();
              o.num_correct = &correct;
              xent::vocab_parallel_finish(xent::cpu{}, 2, a.view(), {0, 20}, a.ids(), {},
                                          {bytes.data(), static_cast<std::int64_t>(2 * block)}, o);
            }),
            "recv");
  EXPECT_EQ(xt::thrown_argument([&] {  // three ranks' bytes for two ranks
              xent::vocab_parallel_finish(xent::cpu{}, 2, a.view(), {0, 20}, a.ids(), {},
                                          {bytes.data(), static_cast<std::int64_t>(3 * block)},
                                          a.out());
            }),
            "recv");
  EXPECT_EQ(xt::thrown_argument([&] {
              xent::vocab_parallel_finish(xent::cpu{}, 0, a.view(), {0, 20}, a.ids(), {},
                                          {bytes.data(), 0}, a.out());
            }),
            "ranks");
  EXPECT_EQ(a.loss, 0.0f) << "an output was written before the error";
}

TEST(CpuVocabParallelSplitValidation, GatheredHeadersThatDoNotTileNameRecv) {
  // Rank 1's shard overlaps rank 0's, leaves a gap, declares another V; or the caller gathered
  // rank 0's block twice. Nothing is written.
  for (const xent::vocab_shard second :
       {xent::vocab_shard{5, 20}, xent::vocab_shard{12, 22}, xent::vocab_shard{10, 21}}) {
    vp_args a;
    const std::vector<unsigned char> recv = gathered_blocks(a, second);
    EXPECT_EQ(xt::thrown_argument([&] {
                xent::vocab_parallel_finish(xent::cpu{}, 2, a.view(), {0, 20}, a.ids(), {},
                                            {recv.data(), static_cast<std::int64_t>(recv.size())},
                                            a.out());
              }),
              "recv")
        << second.first << " " << second.vocab;
    EXPECT_EQ(a.loss, 0.0f);
  }
  vp_args a;
  std::vector<unsigned char> recv = gathered_blocks(a);
  std::copy(recv.begin(), recv.begin() + recv.size() / 2, recv.begin() + recv.size() / 2);
  EXPECT_EQ(xt::thrown_argument([&] {
              xent::vocab_parallel_finish(xent::cpu{}, 2, a.view(), {10, 20}, a.ids(), {},
                                          {recv.data(), static_cast<std::int64_t>(recv.size())},
                                          a.out());
            }),
            "recv");
  // The good blocks finish, the same on both ranks' shards.
  const std::vector<unsigned char> good = gathered_blocks(a);
  float loss[2] = {0.0f, 0.0f};
  for (int r = 0; r < 2; ++r)
    xent::vocab_parallel_finish(xent::cpu{}, 2, a.view(), {r * 10, 20}, a.ids(), {},
                                {good.data(), static_cast<std::int64_t>(good.size())},
                                xent::forward_outputs{&loss[r]});
  EXPECT_TRUE(std::isfinite(loss[0]));
  EXPECT_EQ(loss[0], loss[1]);
}

TEST(CpuVocabParallelSplitValidation, SoftTargetBackwardNeedsTheRowMass) {
  vp_args a;
  std::vector<float> probs(3 * 10, 0.05f), lse(3, 1.0f), g(3 * 10), mass(3, 1.0f);
  const auto t = xent::soft(xent::matrix_view<const float>(probs.data(), 3, 10));
  const xent::matrix_view<float> grad(g.data(), 3, 10);
  const xent::vector_view<const float> saved(lse.data(), 3);
  EXPECT_EQ(
      xt::thrown_argument([&] {
        xent::vocab_parallel_backward(xent::cpu{}, a.view(), {0, 20}, t, {}, saved, {}, {}, grad);
      }),
      "row_mass");
  EXPECT_EQ(xt::thrown_argument([&] {
              xent::vocab_parallel_backward(xent::cpu{}, a.view(), {0, 20}, t, {}, saved,
                                            xent::vector_view<const float>(mass.data(), 2), {},
                                            grad);
            }),
            "row_mass");
  // Class ids take no mass: no error.
  EXPECT_EQ(xt::thrown_argument([&] {
              xent::vocab_parallel_backward(xent::cpu{}, a.view(), {0, 20}, a.ids(), {}, saved, {},
                                            {}, grad);
            }),
            "");
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

namespace xvp {
// Named so that the tsan preset's filter (^CpuVocabParallel) runs them with the threaded tests.
INSTANTIATE_TYPED_TEST_SUITE_P(CpuVocabParallel, VocabParallelBackend, cpu_ranks);
INSTANTIATE_TYPED_TEST_SUITE_P(CpuVocabParallelSplit, VocabParallelBackend, cpu_split_ranks);
}  // namespace xvp
