// The vocab-parallel cross-entropy tests that every backend runs, typed over a backend fixture B:
// tests/cpu/vocab_parallel_test.cpp instantiates them for the CPU's in-process ranks and
// tests/cuda/cuda_vocab_parallel_test.cu for CUDA's staged ranks on one GPU.
// B provides
//   template <class T, class G = T> bool run(const xt::spec&, const xt::split&) const;
//       one case on one split, both call forms on every rank, held to the ranks' agreement, the
//       float64 oracle and the unsharded call (vocab_parallel_harness.hpp); returns whether all
//       passed
//   narrower_gradient (whether a gradient may have a narrower dtype than the logits: a bf16
//       gradient of float logits), set_up(), tear_down().
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>

#include "cpu/backend_fixture.hpp"
#include "cpu/harness.hpp"
#include "cpu/vocab_parallel_harness.hpp"
#include "cpu/vocab_split.hpp"

namespace xvp {

using xt::bf16;
using xt::half;
using xt::ignore_mode;

template <class B>
class VocabParallelBackend : public xtl::backend_test<B> {
 protected:
  /// Every option (every_option) of a short and a long vocabulary, each case on 1 to 4 ranks and
  /// every split of that count (Megatron's, an empty rank 0, reversed shards): 324 cases.
  template <class T>
  void every_option_on_one_to_four_ranks(std::uint64_t seed) {
    xt::case_budget b;
    for (auto shape : {std::pair<std::int64_t, std::int64_t>{7, 37}, {19, 3001}})
      for (const spec& s : every_option(shape.first, shape.second, seed += 100))
        for (int ranks = 1; ranks <= 4; ++ranks)
          for (const split& sp : xt::splits(s.cols, ranks))
            if (!b.record(this->backend.template run<T>(s, sp))) return;
    EXPECT_EQ(b.cases(), 324);
  }

  /// One case on one split in float, bf16 and fp16: whether all three passed.
  bool in_every_dtype(const spec& s, const split& sp) const {
    return this->backend.template run<float>(s, sp) && this->backend.template run<bf16>(s, sp) &&
           this->backend.template run<half>(s, sp);
  }
};

TYPED_TEST_SUITE_P(VocabParallelBackend);

TYPED_TEST_P(VocabParallelBackend, Float32MatchesOracleAndUnshardedWithEveryOption) {
  this->template every_option_on_one_to_four_ranks<float>(100);
}

TYPED_TEST_P(VocabParallelBackend, Bfloat16MatchesOracleAndUnshardedWithEveryOption) {
  this->template every_option_on_one_to_four_ranks<bf16>(200);
}

TYPED_TEST_P(VocabParallelBackend, HalfMatchesOracleAndUnshardedWithEveryOption) {
  this->template every_option_on_one_to_four_ranks<half>(300);
}

TYPED_TEST_P(VocabParallelBackend, EdgeVocabularySizesAndMoreRanksThanClasses) {
  // V = 1, 2, 3 on 2 to 4 ranks leave shards empty (with smoothing and class weights every rank
  // still needs the whole vocabulary's sums); 4097 and 50257 split unevenly.
  xt::case_budget b;
  std::uint64_t seed = 500;
  for (std::int64_t vocab : {1, 2, 3, 4097, 50257}) {
    spec s;
    s.rows = 5;
    s.cols = vocab;
    s.label_smoothing = vocab <= 3 ? 0.3f : 0.1f;
    s.weights = vocab % 2 == 1;
    s.ignore = ignore_mode::some;
    s.seed = ++seed;
    for (int ranks = 2; ranks <= (vocab <= 3 ? 4 : 3); ++ranks)
      for (const split& sp : xt::splits(vocab, ranks))
        if (!b.record(this->in_every_dtype(s, sp))) return;
  }
  EXPECT_EQ(b.cases(), 34);
}

TYPED_TEST_P(VocabParallelBackend, LongShardsChunksThreadsAndManyRows) {
  // Shards longer than a CPU chunk with a thread split within a rank's shard (rows < threads;
  // threads and chunk are the CPU's, other backends take the shapes alone); shards of 65537
  // classes, which stream through a CUDA cluster in chunks; 733 rows, which take CUDA's
  // whole-row forward on an H100 / H200 (>= 396 rows).
  const auto& backend = this->backend;
  xt::case_budget b;
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
        if (!b.record(backend.template run<float>(s, xt::even_split(s.cols, ranks)))) return;
      }
  for (auto shape : {std::pair<std::int64_t, std::int64_t>{3, 131073}, {733, 2048}}) {
    spec s;
    s.rows = shape.first;
    s.cols = shape.second;
    s.label_smoothing = 0.1f;
    s.weights = true;
    s.ignore = ignore_mode::some;
    s.seed = ++seed;
    for (const split& sp : xt::splits(s.cols, 2))
      if (!b.record(this->in_every_dtype(s, sp))) return;
  }
  EXPECT_EQ(b.cases(), 16);
}

TYPED_TEST_P(VocabParallelBackend, GradientDtypeMayDifferFromTheLogits) {
  // Float gradients of bf16 / fp16 logits and, where the backend has it, a bf16 gradient of float
  // logits, on 4 ranks and on 3 with an empty rank 0.
  const auto& backend = this->backend;
  spec s;
  s.rows = 9;
  s.cols = 37;
  s.label_smoothing = 0.1f;
  s.weights = true;
  s.ignore = ignore_mode::some;
  for (const split& sp : {xt::even_split(37, 4), xt::splits(37, 3)[1]}) {
    EXPECT_TRUE((backend.template run<bf16, float>(s, sp)));
    EXPECT_TRUE((backend.template run<half, float>(s, sp)));
    if constexpr (TypeParam::narrower_gradient) {
      EXPECT_TRUE((backend.template run<float, bf16>(s, sp)));
    }
  }
}

TYPED_TEST_P(VocabParallelBackend, EveryRowIgnoredAndNoRows) {
  // Each reduction with every row ignored, then with no rows at all, on 3 ranks.
  const auto& backend = this->backend;
  for (reduction red : {reduction::mean, reduction::sum, reduction::none})
    for (std::int64_t rows : {4, 0}) {
      spec s;
      s.rows = rows;
      s.cols = 37;
      s.reduce = red;
      s.ignore = ignore_mode::all;
      s.label_smoothing = 0.1f;
      s.weights = true;
      EXPECT_TRUE(backend.template run<float>(s, xt::even_split(37, 3)));
      EXPECT_TRUE(backend.template run<bf16>(s, xt::splits(37, 3)[1]));
    }
}

REGISTER_TYPED_TEST_SUITE_P(VocabParallelBackend, Float32MatchesOracleAndUnshardedWithEveryOption,
                            Bfloat16MatchesOracleAndUnshardedWithEveryOption,
                            HalfMatchesOracleAndUnshardedWithEveryOption,
                            EdgeVocabularySizesAndMoreRanksThanClasses,
                            LongShardsChunksThreadsAndManyRows, GradientDtypeMayDifferFromTheLogits,
                            EveryRowIgnoredAndNoRows);

}  // namespace xvp
