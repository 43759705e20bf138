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

#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/backend_fixture.hpp"
#include "cpu/linear_harness.hpp"
#include "cpu/vocab_parallel_linear_harness.hpp"
#include "cpu/vocab_split.hpp"

namespace xtl {

template <class B>
class VocabParallelLinearBackend : public backend_test<B> {};

TYPED_TEST_SUITE_P(VocabParallelLinearBackend);

/// Every option of the single-device linear sweep in float32, the training calls in `order`; case
/// i on 1 + i % 4 ranks, cycling through Megatron's split, an empty rank 0 and reversed shards.
template <class B>
void float32_sweep(const B& backend, xent::linear_order order) {
  xt::case_budget b;
  int i = 0;
  for (lspec s : every_option(19, 13, 37)) {
    s.order = order;
    if (!b.record(backend.template run<float>(s, xvl::split_for(37, i++)))) return;
  }
  EXPECT_EQ(b.cases(), 288);
}

/// The bf16 / fp16 share of the sweep (B::narrow_stride), ranks cycling as in float32_sweep.
template <class B>
void narrow_sweep(const B& backend, xent::linear_order order) {
  narrow_every_option(B::narrow_stride, [&](lspec s, int i, auto* dtype) {
    using T = std::remove_pointer_t<decltype(dtype)>;
    s.order = order;
    return backend.template run<T>(s, xvl::split_for(37, i));
  });
}

TYPED_TEST_P(VocabParallelLinearBackend, Float32MatchesOracleAndUnshardedWithEveryOption) {
  float32_sweep(this->backend, xent::linear_order::fast);
}

TYPED_TEST_P(VocabParallelLinearBackend, Bfloat16AndHalfMatchOracleAndUnshardedWithEveryOption) {
  narrow_sweep(this->backend, xent::linear_order::fast);
}

// The low-memory order: held to the oracle and to the unsharded calls in the fast order.
TYPED_TEST_P(VocabParallelLinearBackend, LowMemoryOrderMatchesOracleAndFastOrderWithEveryOption) {
  float32_sweep(this->backend, xent::linear_order::low_memory);
}

TYPED_TEST_P(VocabParallelLinearBackend, LowMemoryOrderInBfloat16AndHalfMatchesOracleAndFastOrder) {
  narrow_sweep(this->backend, xent::linear_order::low_memory);
}

TYPED_TEST_P(VocabParallelLinearBackend, LowMemoryOrderOverSeveralPanelsOfUnevenShards) {
  // V = 20000 and D = 29, multiples of no tile, block or panel: shards of up to 13334 classes span
  // several panels (the CPU's are 1024 rows or more, CUDA's 8192), the last one partial, on 2 and
  // 3 ranks of uneven, empty and reordered shards. Every seventh case, float32 and bf16 -> float.
  xt::case_budget b;
  int i = 0;
  for (lspec s : every_option(9, 29, 20000)) {
    if (i++ % 7 != 0) continue;
    s.order = xent::linear_order::low_memory;
    const std::vector<xt::split> all = xt::splits(20000, 2 + i / 14 % 2);
    const xt::split& sp = all[static_cast<std::size_t>(i / 28) % all.size()];
    const bool passed = i % 2 ? this->backend.template run<float>(s, sp)
                              : this->backend.template run<bf16, float>(s, sp);
    if (!b.record(passed)) return;
  }
  EXPECT_EQ(b.cases(), 42);
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
                            LowMemoryOrderMatchesOracleAndFastOrderWithEveryOption,
                            LowMemoryOrderInBfloat16AndHalfMatchesOracleAndFastOrder,
                            LowMemoryOrderOverSeveralPanelsOfUnevenShards,
                            EveryRowIgnoredAndNoRows);

}  // namespace xtl
