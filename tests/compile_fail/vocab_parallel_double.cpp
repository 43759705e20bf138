// MUST NOT compile: vocab-parallel calls are float, bfloat16 and half only; float64 is for the
// single-device CPU calls.
#include "two_rows.hpp"

int main() {
  two_rows r;
  logits_2x3<double> x;
  xent::inprocess_group group(1);
  group.run([&](xent::inprocess_group::communicator comm) {
    xent::vocab_parallel_forward(xent::cpu{}, comm, x.view(), xent::vocab_shard{0, 3}, r.ids(),
                                 xent::options{}, r.out);
  });
}
