// More than 2^31 elements: 64-bit offsets end to end. 16385 x 131073 bf16 logits are 2^31 +
// 131073 elements (4.3 GB), so the last row starts past 2^31. It needs that much memory and a few
// seconds, so it runs only when asked:
//
//   XENT_TEST_LARGE=1 ./xent_cpu_tests --gtest_filter='CpuLarge.*'
//
// (otherwise it is skipped, and ctest reports it as skipped).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include "harness.hpp"

namespace {

bool large_tests_enabled() {
  const char* v = std::getenv("XENT_TEST_LARGE");
  return v && std::strcmp(v, "1") == 0;
}

TEST(CpuLarge, MoreThan2Pow31ElementsIndexWith64BitOffsets) {
  if (!large_tests_enabled()) GTEST_SKIP() << "set XENT_TEST_LARGE=1 to run (needs 4.3 GB)";
  const std::int64_t rows = 16385, cols = 131073;
  ASSERT_GT(rows * cols, std::int64_t{1} << 31);
  std::unique_ptr<xt::bf16[]> logits(new (std::nothrow) xt::bf16[rows * cols]);
  if (!logits) GTEST_SKIP() << "could not allocate " << rows * cols * 2 << " bytes";
  std::memset(static_cast<void*>(logits.get()), 0,
              rows * cols * sizeof(xt::bf16));  // bf16 0 is all-zero bits

  // Rows 0, a middle one and the last get distinct patterns; the rest stay 0 (loss log V).
  const std::int64_t probe[3] = {0, rows / 2, rows - 1};
  std::vector<std::int64_t> targets(rows, 5);
  for (int k = 0; k < 3; ++k) {
    xt::bf16* row = logits.get() + probe[k] * cols;
    for (std::int64_t c = 0; c < cols; ++c)
      row[c] = xt::bf16(static_cast<float>((c * (k + 3)) % 17) * 0.25f);
    row[cols - 1 - k] = xt::bf16(9.0f + k);  // a unique maximum near the end
    targets[probe[k]] = cols - 1 - 2 * k;
  }
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<float> row_loss(rows, 12345.0f), lse(rows, 12345.0f);
  std::vector<std::int64_t> argmax(rows, -777);
  xent::options opts;
  opts.reduce = xent::reduction::none;
  xent::forward_outputs out;
  out.row_loss = {row_loss.data(), rows};
  out.lse = {lse.data(), rows};
  out.argmax = {argmax.data(), rows};
  const xent::vector_view<const std::int64_t> T(targets.data(), rows);
  xent::forward(xent::cpu(threads), xent::matrix_view<const xt::bf16>(logits.get(), rows, cols), T,
                opts, out);

  // Each probed row against the oracle on that row alone.
  std::vector<oracle::result> refs;
  for (int k = 0; k < 3; ++k) {
    oracle::problem p;
    p.rows = 1;
    p.cols = cols;
    p.logits.resize(cols);
    for (std::int64_t c = 0; c < cols; ++c)
      p.logits[c] = xt::to_double(logits[probe[k] * cols + c]);
    p.targets = {targets[probe[k]]};
    p.reduce = oracle::reduction::none;
    const oracle::upstream up;
    refs.push_back(oracle::evaluate(p, &up));
    const std::int64_t n = probe[k];
    EXPECT_NEAR(row_loss[n], refs[k].row_loss[0], 1e-5 * refs[k].row_magnitude[0]) << "row " << n;
    EXPECT_NEAR(lse[n], refs[k].lse[0], 1e-5 * (1 + refs[k].lse[0])) << "row " << n;
    EXPECT_EQ(argmax[n], cols - 1 - k) << "row " << n;
  }
  EXPECT_NEAR(row_loss[1], std::log(static_cast<double>(cols)), 1e-5);

  // In place: the gradient overwrites the logits, 64-bit offsets on the write side too.
  xent::forward_outputs none;
  const xent::matrix_view<xt::bf16> L(logits.get(), rows, cols);
  xent::forward_backward(xent::cpu(threads), L, T, opts, xent::upstream{}, none, L);
  for (int k = 0; k < 3; ++k) {
    const std::int64_t n = probe[k];
    double worst = 0, rowmax = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      worst = std::max(worst, std::fabs(xt::to_double(logits[n * cols + c]) - refs[k].grad[c]));
      rowmax = std::max(rowmax, std::fabs(refs[k].grad[c]));
    }
    EXPECT_LE(worst, std::ldexp(rowmax, -8)) << "row " << n;
  }
}

}  // namespace
