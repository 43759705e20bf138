// MUST compile: the same calls as the compile-fail files, with what they allow, so a compile-fail
// test cannot pass for a wrong reason (a bad include path, a missing Eigen).
#include <Eigen/Core>
#include <cstdint>

#include "two_rows.hpp"

int main() {
  forward_into_float_outputs<float>();
  forward_into_float_outputs<Eigen::bfloat16>();
  two_rows r;
  logits_2x3<float> x;
  float grad[6] = {};
  std::int32_t targets32[2] = {0, 1};
  xent::forward(xent::cpu{}, x.view(), xent::vector_view<const std::int32_t>(targets32, 2),
                xent::options{}, r.out);
  xent::forward_backward(xent::cpu{}, x.view(), r.ids(), xent::options{}, xent::upstream{},
                         xent::forward_outputs{}, xent::matrix_view<float>(grad, 2, 3));
  // float64 on the CPU: double logits, outputs, upstream and gradient.
  double logits64[6] = {}, grad64[6] = {}, loss64 = 0;
  xent::basic_forward_outputs<double> out64;
  out64.loss = &loss64;
  xent::forward_backward(xent::cpu{}, xent::matrix_view<const double>(logits64, 2, 3), r.ids(),
                         xent::options{}, xent::basic_upstream<double>{}, out64,
                         xent::matrix_view<double>(grad64, 2, 3));
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rm(2, 3);
  auto v = xent::view(rm);
  return static_cast<int>(v.ld);
}
