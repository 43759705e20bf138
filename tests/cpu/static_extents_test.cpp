// Static extents (views.hpp): the same call through static views and through run-time sized ones
// gives the same bits, on the seed shapes (32 x 32000, 128 x 32000, 32 x 50257) under every
// option set of the sweeps; a static view given a wrong run-time size throws xent::error naming
// it. The compile-time half (mismatched static extents) is in tests/compile_fail/static_*.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "harness.hpp"
#include "vocab_parallel_harness.hpp"

namespace {

using xt::call_result;
using xt::dataset;
using xt::spec;
using xt::target_kind;

/// xt::call_into's calls (forward_backward, or forward then backward) with every view, the
/// outputs, upstream and class weights carrying extents E (rows and columns of the logits).
template <class E, class T, class G>
void call_static(const dataset<T>& d, bool fused, call_result<G, xent::accumulator_t<T>>& res) {
  using A = xent::accumulator_t<T>;
  using rows_e = xent::extent<E::rows>;
  const spec& s = d.s;
  const bool soft = s.kind == target_kind::soft;
  res.row_loss.assign(s.rows, A(12345.0f));
  res.lse.assign(s.rows, A(12345.0f));
  res.argmax.assign(s.rows, -777);
  res.grad.assign(s.rows * s.ld(), xt::sentinel<G>());
  res.loss = A(12345.0f);
  res.correct = -777;

  xent::basic_options<xent::extent<E::cols>> opts;
  const xent::options dyn = d.options();
  opts.reduce = dyn.reduce;
  opts.ignore_index = dyn.ignore_index;
  opts.label_smoothing = dyn.label_smoothing;
  opts.z_loss = dyn.z_loss;
  opts.softcap = dyn.softcap;
  if (s.weights) opts.class_weights = {d.weights.data(), s.cols};  // checked against E::cols

  xent::basic_forward_outputs<A, rows_e> o;
  if (s.reduce != xent::reduction::none) o.loss = &res.loss;
  o.row_loss = {res.row_loss.data(), s.rows};
  o.lse = {res.lse.data(), s.rows};
  o.argmax = {res.argmax.data(), s.rows};
  if (!soft) o.num_correct = &res.correct;

  const xent::basic_upstream<A> dyn_up = d.upstream();
  xent::basic_upstream<A, rows_e> up;
  up.scale = dyn_up.scale;
  up.scale_ptr = dyn_up.scale_ptr;
  if (dyn_up.rows.data) up.rows = {dyn_up.rows.data, s.rows};  // else absent: null data

  const xent::matrix_view<const T, E> logits(d.logits.data(), s.rows, s.cols, s.ld());
  const xent::matrix_view<G, E> grad(res.grad.data(), s.rows, s.cols, s.ld());
  auto run = [&](const auto& targets) {
    if (fused) {
      xent::forward_backward(d.exec(), logits, targets, opts, up, o, grad);
    } else {
      xent::forward(d.exec(), logits, targets, opts, o);
      xent::backward(d.exec(), logits, targets, opts,
                     xent::vector_view<const A, rows_e>(res.lse.data(), s.rows), up, grad);
    }
  };
  switch (s.kind) {
    case target_kind::int32:
      run(xent::vector_view<const std::int32_t, rows_e>(d.t32.data(), s.rows));
      break;
    case target_kind::int64:
      run(xent::vector_view<const std::int64_t, rows_e>(d.t64.data(), s.rows));
      break;
    case target_kind::soft:
      run(xent::soft(xent::matrix_view<const T, E>(d.probs.data(), s.rows, s.cols, s.ld())));
      break;
  }
}

template <class G, class A>
std::string first_difference(const call_result<G, A>& a, const call_result<G, A>& b) {
  if (!xt::same_bits(a.loss, b.loss)) return "loss";
  if (a.correct != b.correct) return "num_correct";
  for (std::size_t n = 0; n < a.lse.size(); ++n) {
    if (!xt::same_bits(a.row_loss[n], b.row_loss[n])) return "row_loss[" + std::to_string(n) + "]";
    if (!xt::same_bits(a.lse[n], b.lse[n])) return "lse[" + std::to_string(n) + "]";
    if (a.argmax[n] != b.argmax[n]) return "argmax[" + std::to_string(n) + "]";
  }
  for (std::size_t i = 0; i < a.grad.size(); ++i)
    if (!xt::same_bits(a.grad[i], b.grad[i])) return "grad[" + std::to_string(i) + "]";
  return "";
}

/// Every option set at rows x cols: static extents E, and columns only static, against the
/// run-time sized call, fused and not, at `threads`.
template <std::int64_t Rows, std::int64_t Cols, class T = float>
void expect_static_matches_dynamic(std::uint64_t seed, int threads) {
  using A = xent::accumulator_t<T>;
  for (spec s : xvp::every_option(Rows, Cols, seed)) {
    s.threads = threads;
    const dataset<T> d = xt::make_dataset<T>(s);
    for (bool fused : {true, false}) {
      const call_result<T, A> want = xt::call<T>(d, fused);
      call_result<T, A> got;
      call_static<xent::extents<Rows, Cols>>(d, fused, got);
      EXPECT_EQ(first_difference(got, want), "")
          << "static, fused=" << fused << " " << s.describe();
      call_static<xent::extents<xent::dynamic, Cols>>(d, fused, got);
      EXPECT_EQ(first_difference(got, want), "")
          << "static columns, fused=" << fused << " " << s.describe();
    }
  }
}

TEST(CpuStaticExtents, SeedShapesGiveTheBitsOfRunTimeSizedViewsWithEveryOption) {
  expect_static_matches_dynamic<32, 32000>(100, 1);
  expect_static_matches_dynamic<128, 32000>(200, 1);
  expect_static_matches_dynamic<32, 50257>(300, 1);
}

TEST(CpuStaticExtents, SplitRowsAndNarrowDtypesGiveTheBitsOfRunTimeSizedViews) {
  expect_static_matches_dynamic<32, 32000>(400, 2);           // rows split over two threads
  expect_static_matches_dynamic<3, 50257, xt::bf16>(500, 4);  // vocabulary slices per row
  expect_static_matches_dynamic<7, 3000, double>(600, 1);
}

TEST(CpuStaticExtents, WrongRunTimeSizeForAStaticExtentThrowsNamingIt) {
  std::vector<float> x(64 * 32000);
  using logits = xent::matrix_view<const float, xent::extents<32, 32000>>;
  EXPECT_EQ(xt::thrown_argument([&] { logits(x.data(), 64, 32000); }), "rows");
  EXPECT_EQ(xt::thrown_argument([&] { logits(x.data(), 32, 50257); }), "cols");
  EXPECT_EQ(xt::thrown_argument([&] { logits(x.data(), 32, 32000, 32001); }), "");  // ld is free
  const xent::matrix_view<const float> dyn(x.data(), 64, 32000);
  EXPECT_EQ(xt::thrown_argument([&] { logits{dyn}; }), "rows");
  EXPECT_EQ(xt::thrown_argument([&] {
              xent::matrix_view<const float, xent::extents<xent::dynamic, 32000>>(x.data(), 2,
                                                                                  31999);
            }),
            "cols");
  EXPECT_EQ(
      xt::thrown_argument([&] { xent::vector_view<const float, xent::extent<32>>(x.data(), 64); }),
      "size");
  EXPECT_EQ(xt::thrown_argument([&] {
              xent::vector_view<const float, xent::extent<32>>{
                  xent::vector_view<const float>(x.data(), 31)};
            }),
            "size");
  try {
    logits(x.data(), 64, 32000);
  } catch (const xent::error& e) {
    EXPECT_NE(std::string(e.what()).find("is 64, the view's static extent is 32"),
              std::string::npos)
        << e.what();
  }
}

TEST(CpuStaticExtents, StaticViewsStoreOnlyWhatIsDynamic) {
  static_assert(sizeof(xent::matrix_view<float, xent::extents<32, 32000>>) ==
                    sizeof(float*) + sizeof(std::int64_t),
                "data and ld");
  static_assert(sizeof(xent::matrix_view<float, xent::extents<xent::dynamic, 32000>>) ==
                    sizeof(float*) + 2 * sizeof(std::int64_t),
                "data, rows and ld");
  static_assert(sizeof(xent::vector_view<float, xent::extent<32>>) == sizeof(float*), "data");
  float x[6] = {};
  const xent::matrix_view<float, xent::extents<2, 3>> s(x);
  const xent::matrix_view<const float> d = s;  // implicit: static to dynamic, mutable to const
  EXPECT_EQ(d.rows, 2);
  EXPECT_EQ(d.cols, 3);
  EXPECT_EQ(d.ld, 3);
  const xent::matrix_view<float, xent::extents<xent::dynamic, 3>> r(x, 2);
  EXPECT_EQ(r.rows, 2);
  EXPECT_EQ(r.ld, 3);
}

TEST(CpuStaticExtents, StaticViewWithNullDataIsAbsent) {
  // An optional output left out of static outputs: its view has a static size and no data,
  // which the call takes as absent (the dynamic form of absent is null data and size 0).
  std::vector<float> x(2 * 3, 0.0f);
  const std::int64_t ids[2] = {0, 2};
  float loss = -1;
  xent::basic_forward_outputs<float, xent::extent<2>> out;  // row_loss, lse, argmax absent
  out.loss = &loss;
  xent::forward(xent::cpu{}, xent::matrix_view<const float, xent::extents<2, 3>>(x.data()),
                xent::vector_view<const std::int64_t, xent::extent<2>>(ids), xent::options{}, out);
  EXPECT_FLOAT_EQ(loss, std::log(3.0f));
  // Logits are required: null data in a static view is an error, not an empty matrix.
  EXPECT_EQ(xt::thrown_argument([&] {
              xent::forward(xent::cpu{},
                            xent::matrix_view<const float, xent::extents<2, 3>>(nullptr),
                            xent::vector_view<const std::int64_t, xent::extent<2>>(ids),
                            xent::options{}, out);
            }),
            "logits");
}

}  // namespace
