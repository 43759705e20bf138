// MUST compile: the same calls as the compile-fail files, with what they allow, so a compile-fail
// test cannot pass for a wrong reason (a bad include path, a missing Eigen).
#include <Eigen/Core>
#include <cstdint>

#include "xent/xent.hpp"

int main() {
  float logits[6] = {};
  Eigen::bfloat16 logits16[6] = {};
  float grad[6] = {};
  std::int64_t targets[2] = {0, 1};
  std::int32_t targets32[2] = {0, 1};
  float loss = 0;
  xent::forward_outputs out;
  out.loss = &loss;
  xent::forward(xent::cpu{}, xent::matrix_view<const float>(logits, 2, 3),
                xent::vector_view<const std::int64_t>(targets, 2), xent::options{}, out);
  xent::forward(xent::cpu{}, xent::matrix_view<const Eigen::bfloat16>(logits16, 2, 3),
                xent::vector_view<const std::int32_t>(targets32, 2), xent::options{}, out);
  xent::forward_backward(xent::cpu{}, xent::matrix_view<const float>(logits, 2, 3),
                         xent::vector_view<const std::int64_t>(targets, 2), xent::options{},
                         xent::upstream{}, xent::forward_outputs{},
                         xent::matrix_view<float>(grad, 2, 3));
  // float64 on the CPU: double logits, outputs, upstream and gradient.
  double logits64[6] = {}, grad64[6] = {}, loss64 = 0;
  xent::basic_forward_outputs<double> out64;
  out64.loss = &loss64;
  xent::forward_backward(xent::cpu{}, xent::matrix_view<const double>(logits64, 2, 3),
                         xent::vector_view<const std::int64_t>(targets, 2), xent::options{},
                         xent::basic_upstream<double>{}, out64,
                         xent::matrix_view<double>(grad64, 2, 3));
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rm(2, 3);
  auto v = xent::view(rm);
  return static_cast<int>(v.ld);
}
