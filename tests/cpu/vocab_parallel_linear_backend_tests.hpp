// The vocab-parallel fused linear cross-entropy tests that every backend runs, typed over a
// backend fixture B: tests/cpu/vocab_parallel_linear_test.cpp instantiates them for the CPU's
// in-process ranks and tests/cuda/cuda_vocab_parallel_linear_test.cu for CUDA's staged ranks.
// B provides
//   template <class T, class G = T> bool run(const lspec&, const xt::split&) const;
//       one case on one split, held to the ranks' agreement, the float64 linear oracle and the
//       unsharded calls (vocab_parallel_linear_harness.hpp); returns whether all passed
//   narrow_stride (the share of the every-option cases run in bf16 / fp16), set_up(), tear_down().
#pragma once

#include <gtest/gtest.h>

#include <type_traits>

#include "cpu/backend_fixture.hpp"
#include "cpu/linear_harness.hpp"
#include "cpu/vocab_parallel_linear_harness.hpp"
#include "cpu/vocab_split.hpp"

namespace xtl {

template <class B>
class VocabParallelLinearBackend : public backend_test<B> {};

TYPED_TEST_SUITE_P(VocabParallelLinearBackend);

TYPED_TEST_P(VocabParallelLinearBackend, Float32MatchesOracleAndUnshardedWithEveryOption) {
  // Every option of the single-device linear sweep; case i on 1 + i % 4 ranks, cycling through
  // Megatron's split, an empty rank 0 and reversed shards.
  xt::case_budget b;
  int i = 0;
  for (const lspec& s : every_option(19, 13, 37))
    if (!b.record(this->backend.template run<float>(s, xvl::split_for(37, i++)))) return;
  EXPECT_EQ(b.cases(), 288);
}

TYPED_TEST_P(VocabParallelLinearBackend, Bfloat16AndHalfMatchOracleAndUnshardedWithEveryOption) {
  // Ranks cycling as in the float32 sweep.
  narrow_every_option(TypeParam::narrow_stride, [&](const lspec& s, int i, auto* dtype) {
    using T = std::remove_pointer_t<decltype(dtype)>;
    return this->backend.template run<T>(s, xvl::split_for(37, i));
  });
}

TYPED_TEST_P(VocabParallelLinearBackend, EveryRowIgnoredAndNoRows) {
  // Every rank's results as the unsharded call's (all_ignored_cases); then no rows at all.
  const auto& backend = this->backend;
  for (lspec s : all_ignored_cases()) {
    EXPECT_TRUE(backend.template run<float>(s, xt::even_split(9, 3)));
    EXPECT_TRUE(backend.template run<bf16>(s, xt::splits(9, 3)[1]));
    if (s.ce.reduce == reduction::none) continue;
    s.ce.rows = 0;
    EXPECT_TRUE(backend.template run<float>(s, xt::even_split(9, 2)));
    EXPECT_TRUE(backend.template run<half>(s, xt::splits(9, 3)[1]));
    EXPECT_TRUE((backend.template run<bf16, float>(s, xt::splits(9, 3)[1])));
  }
}

REGISTER_TYPED_TEST_SUITE_P(VocabParallelLinearBackend,
                            Float32MatchesOracleAndUnshardedWithEveryOption,
                            Bfloat16AndHalfMatchOracleAndUnshardedWithEveryOption,
                            EveryRowIgnoredAndNoRows);

}  // namespace xtl
