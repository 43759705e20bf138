// A user's program: includes the umbrella header and computes a mean cross-entropy on the CPU.
#include <cmath>
#include <cstdint>
#include <cstdio>

#include <xent/xent.hpp>

int main() {
  float logits[6] = {1, 2, 3, 3, 2, 1};
  std::int64_t tgt[2] = {2, 0};
  xent::matrix_view<const float> L(logits, 2, 3);
  xent::vector_view<const std::int64_t> T(tgt, 2);

  float loss = 0;
  xent::forward_outputs out;
  out.loss = &loss;
  xent::options opts;  // reduction mean
  xent::forward(xent::cpu{}, L, T, opts, out);

  // Both rows have loss log(1 + e^-1 + e^-2).
  const double expected = std::log(1.0 + std::exp(-1.0) + std::exp(-2.0));
  std::printf("loss = %.8f (expected %.8f)\n", loss, expected);
  if (!std::isfinite(loss) || !(loss > 0) || std::fabs(loss - expected) > 1e-5) {
    std::fprintf(stderr, "consumer: unexpected loss\n");
    return 1;
  }
  return 0;
}
