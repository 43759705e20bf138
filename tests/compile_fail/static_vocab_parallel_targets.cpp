// MUST NOT compile: a vocab-parallel call whose class ids have 3 static rows for 2 logits rows.
#include "static_rows.hpp"

int main() {
  static_call c;
  xent::inprocess_group group(1);
  group.run([&](xent::inprocess_group::communicator comm) {
    xent::vocab_parallel_forward(xent::cpu{}, comm, c.x(), xent::vocab_shard{0, 3},
                                 xent::vector_view<const std::int64_t, xent::extent<3>>(c.ids),
                                 c.opts(), c.out());
  });
}
