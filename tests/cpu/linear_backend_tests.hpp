// The fused linear cross-entropy tests that every backend runs, typed over a backend fixture B:
// tests/cpu/linear_test.cpp instantiates them for the CPU (cpu_memory) and
// tests/cuda/cuda_linear_test.cu for CUDA (xent_test::device_memory). The cases, data and error
// bounds are linear_harness.hpp's; B says where a case's buffers live and how a call is made:
//   template <class T> struct inputs;   inputs(const ldata<T>&): hidden(), weight(), bias(),
//                                       options(), upstream(), with_targets(f)
//   template <class A> struct outputs;  outputs(rows): all(spec), lse_view(), fetch() -> the
//                                       poisoned basic_outputs<A> with the call's results
//   template <class G> struct grads;    grads(lspec): views(), fetch() -> gradients<G>
//   struct workspace;                   workspace(bytes, offset): ws, untouched()
//   struct error_count;                 read(): rows the backend counted as bad (0 without one)
//   exec(lspec, error_count&), sync(), offset(seed, k) (of a case's k-th workspace),
//   stored<T>() (xtl::rounding), chunk_rows<T, G>(exec, shape, accumulate, bytes),
//   narrow_stride (the share of the every-option cases run in bf16 / fp16), low_memory_order
//   (whether the backend has linear_order::low_memory), set_up(), tear_down().
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/backend_fixture.hpp"
#include "cpu/linear_harness.hpp"
#include "oracle/linear_oracle.hpp"

namespace xtl {

/// Runs linear_forward, linear_forward_backward and linear_backward (from forward's LSE) on a
/// case through backend B, with inputs of dtype T and gradients of dtype G, and checks each
/// against the oracle. Returns whether everything passed.
template <class T, class G = T, class B>
bool run_case(const B& backend, const lspec& s) {
  using A = xent::accumulator_t<T>;
  const ldata<T> L = make_data<T>(s);
  const oracle::linear_problem pb = L.problem();
  const oracle::upstream up = L.d.oracle_upstream();
  const oracle::linear_result r = oracle::evaluate_linear(pb, &up);
  const typename B::template inputs<T> in(L);
  typename B::error_count errors;
  const auto exec = backend.exec(s, errors);
  const xent::linear_options opts = in.options();
  const auto training = xent::linear_pass::training;
  const std::size_t train_bytes = workspace_bytes<T, G>(exec, L, training);
  // Chunks d_weight is rounded in under dw_accumulation::output with a narrow d_weight.
  double chunk_rounding = 0.0;
  if (s.accumulate == xent::dw_accumulation::output && !std::is_same<G, A>::value) {
    // The chunks a call makes in train_bytes (the size query's budget leaves out fixed buffers).
    const std::int64_t rows =
        B::template chunk_rows<T, G>(exec, {L.N(), L.D(), L.V()}, opts.accumulate, train_bytes);
    chunk_rounding =
        2.0 * xt::unit_roundoff<G>() * ((L.N() + rows - 1) / std::max<std::int64_t>(rows, 1));
  }
  const bounds e = error_bounds(L, pb, r, chunk_rounding, B::template stored<T>());
  std::string errs;
  auto note = [&](const char* what, const std::string& m) {
    if (!m.empty()) errs += std::string(what) + ":\n" + m;
  };

  typename B::template outputs<A> fwd(L.N());
  {
    typename B::workspace ws(workspace_bytes<T>(exec, L, xent::linear_pass::forward),
                             B::offset(s.ce.seed, 0));
    in.with_targets([&](auto t) {
      xent::linear_forward(exec, in.hidden(), in.weight(), in.bias(), t, opts, fwd.all(s.ce),
                           ws.ws);
    });
    B::sync();
    note("linear_forward", check_outputs(L, r, e, fwd.fetch()));
  }
  {
    typename B::workspace ws(train_bytes, B::offset(s.ce.seed, 1));
    typename B::template outputs<A> fb(L.N());
    typename B::template grads<G> g(s);
    in.with_targets([&](auto t) {
      xent::linear_forward_backward(exec, in.hidden(), in.weight(), in.bias(), t, opts,
                                    in.upstream(), fb.all(s.ce), g.views(), ws.ws);
    });
    B::sync();
    note("linear_forward_backward", check_outputs(L, r, e, fb.fetch()));
    note("linear_forward_backward", check_gradients(L, r, e, g.fetch()));

    typename B::template grads<G> gb(s);
    in.with_targets([&](auto t) {
      xent::linear_backward(exec, in.hidden(), in.weight(), in.bias(), t, opts, fwd.lse_view(),
                            in.upstream(), gb.views(), ws.ws);
    });
    B::sync();
    note("linear_backward", check_gradients(L, r, e, gb.fetch()));
  }
  const int bad_rows = errors.read();
  if (bad_rows != 0) note("error_count", "  " + std::to_string(bad_rows) + " rows counted\n");
  if (!errs.empty()) {
    ADD_FAILURE() << "case " << xt::dtype_name<T>() << " -> " << xt::dtype_name<G>() << " grads, "
                  << s.describe() << "\n"
                  << errs;
    return false;
  }
  return true;
}

template <class B>
class LinearBackend : public backend_test<B> {};

TYPED_TEST_SUITE_P(LinearBackend);

TYPED_TEST_P(LinearBackend, Float32MatchesFloat64OracleWithEveryOption) {
  xt::case_budget b;
  for (const lspec& s : every_option(19, 13, 37))
    if (!b.record(run_case<float>(this->backend, s))) return;
  EXPECT_EQ(b.cases(), 288);
}

TYPED_TEST_P(LinearBackend, Bfloat16AndHalfMatchFloat64OracleWithEveryOption) {
  narrow_every_option(TypeParam::narrow_stride, [&](const lspec& s, int, auto* dtype) {
    return run_case<std::remove_pointer_t<decltype(dtype)>>(this->backend, s);
  });
}

TYPED_TEST_P(LinearBackend, EveryRowIgnoredGivesPyTorchsResultsAndZeroGradients) {
  for (const lspec& s : all_ignored_cases()) {
    EXPECT_TRUE(run_case<float>(this->backend, s));
    EXPECT_TRUE(run_case<bf16>(this->backend, s));
  }
}

TYPED_TEST_P(LinearBackend, NoRowsWritesZeroWeightAndBiasGradients) {
  for (reduction red : {reduction::mean, reduction::sum}) {
    lspec s = make_spec(0, 4, 6);
    s.ce.reduce = red;
    EXPECT_TRUE(run_case<float>(this->backend, s));
    EXPECT_TRUE(run_case<half>(this->backend, s));
    EXPECT_TRUE((run_case<bf16, float>(this->backend, s)));
  }
}

TYPED_TEST_P(LinearBackend, WorkspaceTooSmallThrowsNamingItAndTheSizeBeforeWriting) {
  using B = TypeParam;
  const lspec s = make_spec(8, 6, 10);
  const ldata<bf16> L = make_data<bf16>(s);
  const typename B::template inputs<bf16> in(L);
  typename B::error_count errors;
  const auto exec = this->backend.exec(s, errors);
  for (auto pass : {xent::linear_pass::forward, xent::linear_pass::training}) {
    const auto need = xent::linear_workspace_size<bf16>(exec, {8, 6, 10}, pass, in.options());
    typename B::workspace ws(need.minimal - 1, 0);
    typename B::template outputs<float> f(8);
    typename B::template grads<bf16> g(s);
    in.with_targets([&](auto t) {
      expect_error("workspace", std::to_string(need.minimal), [&] {
        if (pass == xent::linear_pass::forward)
          xent::linear_forward(exec, in.hidden(), in.weight(), in.bias(), t, in.options(),
                               f.all(s.ce), ws.ws);
        else
          xent::linear_forward_backward(exec, in.hidden(), in.weight(), in.bias(), t, in.options(),
                                        in.upstream(), f.all(s.ce), g.views(), ws.ws);
      });
    });
    B::sync();
    const outputs& got = f.fetch();
    EXPECT_EQ(got.loss, 12345.0f);
    EXPECT_EQ(got.lse[0], 12345.0f);
    EXPECT_TRUE(xt::same_bits(g.fetch().dw[0], xt::sentinel<bf16>()));
    EXPECT_TRUE(ws.untouched());
  }
}

// A frozen LM head (no d_weight): whatever the accumulation mode, the size query's least workspace
// for it is enough (the call plans the mode with the smaller buffers), and d_hidden and d_bias are
// right. V = 300 with two threads is where the CPU's d_weight blocks outgrow the V x D
// accumulator.
TYPED_TEST_P(LinearBackend, FrozenWeightTrainsInTheLeastWorkspaceOfEitherMode) {
  using B = TypeParam;
  for (auto mode : {xent::dw_accumulation::fp32, xent::dw_accumulation::output})
    for (std::int64_t V : {7, 300}) {
      lspec s = make_spec(5, 6, V);
      s.ce.threads = 2;
      s.accumulate = mode;
      s.space = budget::minimal;
      const judged_case<bf16> j(s, B::template stored<bf16>());
      const ldata<bf16>& L = j.L;
      const oracle::linear_result& r = j.r;
      const bounds& e = j.e;
      const typename B::template inputs<bf16> in(L);
      typename B::error_count errors;
      const auto exec = this->backend.exec(s, errors);
      typename B::workspace ws(workspace_bytes<bf16>(exec, L, xent::linear_pass::training), 0);
      typename B::template outputs<float> f(L.N());
      typename B::template grads<bf16> g(s);
      xent::linear_grads<bf16> frozen = g.views();
      frozen.d_weight = {};
      in.with_targets([&](auto t) {
        xent::linear_forward_backward(exec, in.hidden(), in.weight(), in.bias(), t, in.options(),
                                      in.upstream(), f.all(s.ce), frozen, ws.ws);
      });
      B::sync();
      const gradients<bf16>& got = g.fetch();
      SCOPED_TRACE(s.describe());
      EXPECT_EQ(check_array("d_hidden", got.dx.data(), L.N(), L.D(), s.ld(), r.dx, e.dx) +
                    check_array("d_bias", got.db.data(), 1, L.V(), L.V(), r.db, e.db),
                "");
      EXPECT_TRUE(xt::same_bits(got.dw[0], xt::sentinel<bf16>()));
    }
}

TYPED_TEST_P(LinearBackend, NoHiddenColumnsGivesTheBiasAloneOnEveryPath) {
  // D = 0: every logit is its bias. Minimal workspaces put each row in a chunk of its own, so the
  // calls visit rows past the first; padded rows make ld > 0 with no column to read.
  for (auto mode : {xent::dw_accumulation::fp32, xent::dw_accumulation::output})
    for (budget space : {budget::minimal, budget::all_rows}) {
      lspec s = make_spec(5, 0, 7);
      s.pad = 3;
      s.accumulate = mode;
      s.space = space;
      EXPECT_TRUE(run_case<float>(this->backend, s));
      EXPECT_TRUE(run_case<bf16>(this->backend, s));
    }
}

/// every_option's cases in the low-memory order.
inline std::vector<lspec> low_memory_cases(std::int64_t rows, std::int64_t hidden,
                                           std::int64_t vocab) {
  std::vector<lspec> out = every_option(rows, hidden, vocab);
  for (lspec& s : out) s.order = xent::linear_order::low_memory;
  return out;
}

TYPED_TEST_P(LinearBackend, LowMemoryOrderMatchesFloat64OracleWithEveryOption) {
  if (!TypeParam::low_memory_order) GTEST_SKIP() << "no low-memory order on this backend";
  xt::case_budget b;
  for (const lspec& s : low_memory_cases(19, 13, 37))
    if (!b.record(run_case<float>(this->backend, s))) return;
  EXPECT_EQ(b.cases(), 288);
}

TYPED_TEST_P(LinearBackend, LowMemoryOrderInBfloat16AndHalfMatchesFloat64OracleWithEveryOption) {
  if (!TypeParam::low_memory_order) GTEST_SKIP() << "no low-memory order on this backend";
  narrow_every_option(TypeParam::narrow_stride, [&](lspec s, int, auto* dtype) {
    s.order = xent::linear_order::low_memory;
    return run_case<std::remove_pointer_t<decltype(dtype)>>(this->backend, s);
  });
}

// V = 5000 and D = 29 are multiples of no tile, block or panel; the vocabulary spans several
// panels (the CPU's are 1024 rows or more), the last one partial. Every seventh case.
TYPED_TEST_P(LinearBackend, LowMemoryOrderOverSeveralPanelsMatchesFloat64Oracle) {
  if (!TypeParam::low_memory_order) GTEST_SKIP() << "no low-memory order on this backend";
  xt::case_budget b;
  int i = 0;
  for (const lspec& s : low_memory_cases(9, 29, 5000)) {
    if (i++ % 7 != 0) continue;
    const bool passed =
        i % 2 ? run_case<float>(this->backend, s) : run_case<bf16, float>(this->backend, s);
    if (!b.record(passed)) return;
  }
  EXPECT_EQ(b.cases(), 42);
}

// linear_order::automatic runs the fast order in a training workspace of the fast order's
// minimal and the low-memory order in one byte less, down to the low-memory minimal; one byte
// less than that throws naming it. Each automatic call's results are bit for bit those of the
// order it chose, given the same bytes.
TYPED_TEST_P(LinearBackend, AutomaticOrderSwitchesAtTheFastOrdersMinimal) {
  if (!TypeParam::low_memory_order) GTEST_SKIP() << "no low-memory order on this backend";
  using B = TypeParam;
  // V past both backends' narrowest panels (1024 rows): the V x D accumulator outgrows a
  // panel's.
  lspec s = make_spec(9, 6, 20000);
  s.ce.threads = 2;
  const ldata<bf16> L = make_data<bf16>(s);
  const typename B::template inputs<bf16> in(L);
  typename B::error_count errors;
  const auto exec = this->backend.exec(s, errors);
  const xent::linear_shape shape{L.N(), L.D(), L.V()};
  const auto train = xent::linear_pass::training;
  xent::linear_options automatic = in.options(), fast = automatic, low = automatic;
  automatic.order = xent::linear_order::automatic;
  fast.order = xent::linear_order::fast;
  low.order = xent::linear_order::low_memory;
  const auto sizes = xent::linear_workspace_size<bf16>(exec, shape, train, automatic, 0);
  const std::size_t fast_min = xent::linear_workspace_size<bf16>(exec, shape, train, fast).minimal;
  const std::size_t low_min = xent::linear_workspace_size<bf16>(exec, shape, train, low).minimal;
  ASSERT_LT(low_min, fast_min);  // the V x D float accumulator
  EXPECT_EQ(sizes.fast_minimal, fast_min);
  EXPECT_EQ(sizes.minimal, low_min);

  auto train_with = [&](const xent::linear_options& o, std::size_t bytes) {
    typename B::workspace ws(bytes, 8);
    typename B::template outputs<float> f(L.N());
    typename B::template grads<bf16> g(s);
    in.with_targets([&](auto t) {
      xent::linear_forward_backward(exec, in.hidden(), in.weight(), in.bias(), t, o, in.upstream(),
                                    f.all(s.ce), g.views(), ws.ws);
    });
    B::sync();
    return g.fetch();
  };
  auto same = [](const gradients<bf16>& a, const gradients<bf16>& b) {
    return xt::same_vector_bits(a.dx, b.dx) && xt::same_vector_bits(a.dw, b.dw) &&
           xt::same_vector_bits(a.db, b.db);
  };
  EXPECT_TRUE(same(train_with(automatic, fast_min), train_with(fast, fast_min)));
  EXPECT_TRUE(same(train_with(automatic, fast_min - 1), train_with(low, fast_min - 1)));
  EXPECT_TRUE(same(train_with(automatic, low_min), train_with(low, low_min)));
  const judged_case<bf16> j(s, B::template stored<bf16>());
  EXPECT_EQ(check_gradients(L, j.r, j.e, train_with(automatic, low_min)), "");

  for (const auto& order_need :
       {std::pair{automatic, low_min}, std::pair{fast, fast_min}, std::pair{low, low_min}}) {
    const xent::linear_options& o = order_need.first;
    const std::size_t need = order_need.second;
    typename B::workspace ws(need - 1, 0);
    typename B::template outputs<float> f(L.N());
    typename B::template grads<bf16> g(s);
    in.with_targets([&](auto t) {
      expect_error("workspace", std::to_string(need), [&] {
        xent::linear_forward_backward(exec, in.hidden(), in.weight(), in.bias(), t, o,
                                      in.upstream(), f.all(s.ce), g.views(), ws.ws);
      });
    });
    B::sync();
    EXPECT_TRUE(xt::same_bits(g.fetch().dw[0], xt::sentinel<bf16>()));
    EXPECT_TRUE(ws.untouched());
  }
}

// Every subset of d_hidden, d_weight and d_bias (a frozen head, a first layer, a frozen bias) in
// both orders: the gradients asked for match the oracle and the others keep their poison. V spans
// several CPU panels.
TYPED_TEST_P(LinearBackend, EachOrderComputesExactlyTheGradientsAskedFor) {
  using B = TypeParam;
  if (!B::low_memory_order) GTEST_SKIP() << "no low-memory order on this backend";
  lspec s = make_spec(7, 10, 2100);
  s.ce.threads = 2;
  s.ce.label_smoothing = 0.1f;
  s.ce.ignore = ignore_mode::some;
  typename B::error_count errors;
  const auto exec = this->backend.exec(s, errors);
  const judged_case<bf16> j(s, B::template stored<bf16>());
  const ldata<bf16>& L = j.L;
  const typename B::template inputs<bf16> in(L);
  for (auto order : {xent::linear_order::fast, xent::linear_order::low_memory})
    for (int mask = 0; mask < 8; ++mask) {
      xent::linear_options o = in.options();
      o.order = order;
      const auto size = xent::linear_workspace_size<bf16>(exec, {L.N(), L.D(), L.V()},
                                                          xent::linear_pass::training, o);
      typename B::workspace ws(size.bytes, 0);
      typename B::template outputs<float> f(L.N());
      typename B::template grads<bf16> g(s);
      xent::linear_grads<bf16> asked = g.views();
      if (!(mask & 1)) asked.d_hidden = {};
      if (!(mask & 2)) asked.d_weight = {};
      if (!(mask & 4)) asked.d_bias = {};
      in.with_targets([&](auto t) {
        xent::linear_forward_backward(exec, in.hidden(), in.weight(), in.bias(), t, o,
                                      in.upstream(), f.all(s.ce), asked, ws.ws);
      });
      B::sync();
      const gradients<bf16>& got = g.fetch();
      SCOPED_TRACE(std::string(order == xent::linear_order::fast ? "fast" : "low_memory") +
                   " mask " + std::to_string(mask));
      if (mask & 1)
        EXPECT_EQ(check_array("d_hidden", got.dx.data(), L.N(), L.D(), s.ld(), j.r.dx, j.e.dx), "");
      else
        EXPECT_TRUE(xt::same_bits(got.dx[0], xt::sentinel<bf16>()));
      if (mask & 2)
        EXPECT_EQ(check_array("d_weight", got.dw.data(), L.V(), L.D(), s.ld(), j.r.dw, j.e.dw), "");
      else
        EXPECT_TRUE(xt::same_bits(got.dw.back(), xt::sentinel<bf16>()));
      if (mask & 4)
        EXPECT_EQ(check_array("d_bias", got.db.data(), 1, L.V(), L.V(), j.r.db, j.e.db), "");
      else
        EXPECT_TRUE(xt::same_bits(got.db.back(), xt::sentinel<bf16>()));
    }
}

REGISTER_TYPED_TEST_SUITE_P(
    LinearBackend, Float32MatchesFloat64OracleWithEveryOption,
    EachOrderComputesExactlyTheGradientsAskedFor, LowMemoryOrderMatchesFloat64OracleWithEveryOption,
    LowMemoryOrderInBfloat16AndHalfMatchesFloat64OracleWithEveryOption,
    LowMemoryOrderOverSeveralPanelsMatchesFloat64Oracle,
    AutomaticOrderSwitchesAtTheFastOrdersMinimal, Bfloat16AndHalfMatchFloat64OracleWithEveryOption,
    EveryRowIgnoredGivesPyTorchsResultsAndZeroGradients, NoRowsWritesZeroWeightAndBiasGradients,
    WorkspaceTooSmallThrowsNamingItAndTheSizeBeforeWriting,
    FrozenWeightTrainsInTheLeastWorkspaceOfEitherMode, NoHiddenColumnsGivesTheBiasAloneOnEveryPath);

}  // namespace xtl
