// MUST NOT compile: vocab-parallel calls are float, bfloat16 and half only; float64 is for the
// single-device CPU calls.
#include <cstdint>

#include "xent/xent.hpp"

int main() {
  double logits[6] = {};
  std::int64_t targets[2] = {0, 1};
  float loss = 0;
  xent::forward_outputs out;
  out.loss = &loss;
  xent::inprocess_group group(1);
  group.run([&](xent::inprocess_group::communicator comm) {
    xent::vocab_parallel_forward(
        xent::cpu{}, comm, xent::matrix_view<const double>(logits, 2, 3), xent::vocab_shard{0, 3},
        xent::vector_view<const std::int64_t>(targets, 2), xent::options{}, out);
  });
}
