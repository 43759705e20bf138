// xent::view() over Eigen objects: the view it makes (data, rows, cols, ld) and calls through it
// giving what a hand-made matrix_view of the same memory gives. A column-major matrix is a compile
// error (tests/compile_fail/view_column_major.cpp).
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cstdint>
#include <string>
#include <vector>

#include "harness.hpp"

namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Targets = Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1>;

/// Fills with a smooth function of position, so every entry differs.
template <class M>
void fill(M& m) {
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j)
      m(i, j) = static_cast<typename M::Scalar>(std::sin(0.7f * i + 1.3f * j + 0.1f));
}

/// forward_backward through a hand-made matrix_view of the same memory.
struct reference {
  std::vector<float> row_loss, grad;
  float loss = 0;
};

reference reference_call(const float* data, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                         const std::int64_t* targets, const xent::options& opts) {
  reference r;
  r.row_loss.resize(rows);
  r.grad.assign(rows * cols, 0.0f);
  xent::forward_outputs o;
  o.loss = &r.loss;
  o.row_loss = {r.row_loss.data(), rows};
  xent::forward_backward(xent::cpu{}, xent::matrix_view<const float>(data, rows, cols, ld),
                         xent::vector_view<const std::int64_t>(targets, rows), opts,
                         xent::upstream{}, o, xent::matrix_view<float>(r.grad.data(), rows, cols));
  return r;
}

template <class Logits>
void expect_same_as_reference(Logits& logits, const float* data, std::int64_t ld) {
  const std::int64_t rows = logits.rows(), cols = logits.cols();
  Targets t(rows);
  for (std::int64_t n = 0; n < rows; ++n) t(n) = (3 * n + 1) % cols;
  xent::options opts;
  opts.label_smoothing = 0.1f;
  const reference ref = reference_call(data, rows, cols, ld, t.data(), opts);

  RowMajor grad(rows, cols);
  Eigen::VectorXf row_loss(rows);
  float loss = 0;
  xent::forward_outputs o;
  o.loss = &loss;
  o.row_loss = xent::view(row_loss);
  xent::forward_backward(xent::cpu{}, xent::view(logits), xent::view(t), opts, xent::upstream{}, o,
                         xent::view(grad));
  // Equal up to rounding, not bitwise: the results depend on the gradient buffer's address
  // (CpuDeterminism.ResultsDoNotDependOnBufferAddresses), and these two calls use two buffers.
  EXPECT_NEAR(loss, ref.loss, 1e-6f * ref.loss);
  for (std::int64_t n = 0; n < rows; ++n) {
    EXPECT_NEAR(row_loss(n), ref.row_loss[n], 1e-6f * ref.row_loss[n]) << "row " << n;
    for (std::int64_t c = 0; c < cols; ++c)
      EXPECT_NEAR(grad(n, c), ref.grad[n * cols + c], 1e-7f) << n << "," << c;
  }
}

TEST(CpuEigen, ViewOfRowMajorMatrix) {
  RowMajor m(5, 7);
  fill(m);
  const auto v = xent::view(m);
  static_assert(std::is_same<decltype(v), const xent::matrix_view<float>>::value, "mutable view");
  EXPECT_EQ(v.data, m.data());
  EXPECT_EQ(v.rows, 5);
  EXPECT_EQ(v.cols, 7);
  EXPECT_EQ(v.ld, 7);
  const RowMajor& cm = m;
  const auto cv = xent::view(cm);
  static_assert(std::is_same<decltype(cv), const xent::matrix_view<const float>>::value,
                "a const matrix gives a const view");
  EXPECT_EQ(cv.ld, 7);
  expect_same_as_reference(m, m.data(), 7);
}

TEST(CpuEigen, ViewOfMapWithOuterStride) {
  std::vector<float> buf(6 * 11, 99.0f);
  Eigen::Map<RowMajor, 0, Eigen::OuterStride<>> m(buf.data(), 6, 9, Eigen::OuterStride<>(11));
  fill(m);
  const auto v = xent::view(m);
  EXPECT_EQ(v.data, buf.data());
  EXPECT_EQ(v.rows, 6);
  EXPECT_EQ(v.cols, 9);
  EXPECT_EQ(v.ld, 11);
  expect_same_as_reference(m, buf.data(), 11);
  for (int n = 0; n < 6; ++n) EXPECT_EQ(buf[n * 11 + 9], 99.0f) << "stride padding untouched";
}

TEST(CpuEigen, ViewOfBlock) {
  RowMajor m(6, 10);
  fill(m);
  auto b = m.block(1, 2, 4, 5);
  const auto v = xent::view(b);
  EXPECT_EQ(v.data, &m(1, 2));
  EXPECT_EQ(v.rows, 4);
  EXPECT_EQ(v.cols, 5);
  EXPECT_EQ(v.ld, 10);
  expect_same_as_reference(b, &m(1, 2), 10);
  auto rows = m.middleRows(2, 3);
  const auto rv = xent::view(rows);
  EXPECT_EQ(rv.data, &m(2, 0));
  EXPECT_EQ(rv.ld, 10);
  expect_same_as_reference(rows, &m(2, 0), 10);
}

TEST(CpuEigen, ViewOfStridedElementsIsRefused) {
  // A column of a row-major matrix is a vector whose elements are a row apart (a stride Eigen
  // knows only at run time): read as adjacent, view(ids.col(1)) would give the wrong targets.
  Eigen::Matrix<std::int64_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> ids(3, 2);
  ids << 0, 1, 2, 3, 4, 5;
  try {
    (void)xent::view(ids.col(1));
    ADD_FAILURE() << "a strided column was viewed as adjacent elements";
  } catch (const xent::error& e) {
    EXPECT_EQ(e.argument(), "m") << e.what();
    EXPECT_NE(std::string(e.what()).find("2 apart"), std::string::npos) << e.what();
  }
  // A row of it, and a one-element column, are adjacent.
  EXPECT_EQ(xent::view(ids.row(1)).data, &ids(1, 0));
  EXPECT_EQ(xent::view(ids.col(1).head(1)).size, 1);
}

TEST(CpuEigen, ViewOfRefAndBfloat16Matrix) {
  RowMajor m(3, 40);
  fill(m);
  Eigen::Ref<RowMajor> r(m);
  EXPECT_EQ(xent::view(r).ld, 40);
  expect_same_as_reference(r, m.data(), 40);

  Eigen::Matrix<xt::bf16, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> h(3, 40);
  fill(h);
  Targets t(3);
  t << 0, 39, 7;
  float loss = 0;
  xent::forward_outputs o;
  o.loss = &loss;
  xent::forward(xent::cpu{}, xent::view(h), xent::view(t), xent::options{}, o);
  std::vector<xt::bf16> copy(h.data(), h.data() + h.size());
  float loss_ref = 0;
  o.loss = &loss_ref;
  xent::forward(xent::cpu{}, xent::matrix_view<const xt::bf16>(copy.data(), 3, 40), xent::view(t),
                xent::options{}, o);
  EXPECT_TRUE(xt::same_bits(loss, loss_ref));
}

TEST(CpuEigen, SoftTargetsAndInt32TargetsFromEigen) {
  RowMajor logits(4, 12), probs(4, 12);
  fill(logits);
  probs.setConstant(1.0f / 12);
  float soft_loss = 0, ce_loss = 0;
  xent::forward_outputs o;
  o.loss = &soft_loss;
  xent::forward(xent::cpu{}, xent::view(logits), xent::soft(xent::view(probs)), xent::options{}, o);
  // Uniform soft targets equal label smoothing 1 on any class ids.
  Eigen::VectorXi t(4);
  t << 0, 1, 2, 3;
  xent::options smooth;
  smooth.label_smoothing = 1.0f;
  o.loss = &ce_loss;
  xent::forward(xent::cpu{}, xent::view(logits), xent::view(t), smooth, o);
  EXPECT_NEAR(soft_loss, ce_loss, 1e-6f * ce_loss);
}

}  // namespace
