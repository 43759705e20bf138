// MUST compile: every entry point with static views whose extents agree, and with run-time
// sized mutable weight and bias views (deduced as before static extents existed). The
// compile-fail files named static_*.cpp each change one extent of these calls.
#include "static_rows.hpp"

int main() {
  static_call c;
  const xent::cpu cpu{};
  xent::forward(cpu, c.x(), c.targets(), c.opts(), c.out());
  xent::backward(cpu, c.x(), c.targets(), c.opts(), c.saved_lse(), c.up(), c.g());
  xent::forward_backward(cpu, c.x(), xent::soft(c.x()), c.opts(), c.up(), c.out(), c.g());
  xent::linear_forward(cpu, c.h(), c.w(), c.b(), c.targets(), c.linear_opts(), c.out(), c.ws());
  xent::linear_forward_backward(cpu, c.h(), c.w(), c.b(), c.targets(), c.linear_opts(), c.up(),
                                c.out(), c.grads(), c.ws());
  xent::linear_backward(cpu, c.h(), c.w(), c.b(), c.targets(), c.linear_opts(), c.saved_lse(),
                        c.up(), c.grads(), c.ws());
  // Run-time sized, mutable weight and bias; an empty bias as {}.
  xent::matrix_view<float> weight(c.weight, 3, 4);
  xent::vector_view<float> bias(c.bias, 3);
  xent::linear_forward(cpu, c.h(), weight, bias, c.targets(), xent::linear_options{}, c.out(),
                       c.ws());
  xent::linear_forward(cpu, c.h(), weight, {}, c.targets(), {}, c.out(), c.ws());
  xent::inprocess_group group(1);
  group.run([&](xent::inprocess_group::communicator comm) {
    const xent::vocab_shard shard{0, 3};
    xent::vocab_parallel_forward(cpu, comm, c.x(), shard, c.targets(), c.opts(), c.out());
    xent::vocab_parallel_backward(cpu, comm, c.x(), shard, c.targets(), c.opts(), c.saved_lse(),
                                  c.up(), c.g());
    xent::vocab_parallel_forward_backward(cpu, comm, c.x(), shard, c.targets(), c.opts(), c.up(),
                                          c.out(), c.g());
    xent::vocab_parallel_linear_workspace vws;
    xent::vocab_parallel_linear_forward(cpu, comm, c.h(), c.w(), c.b(), shard, c.targets(),
                                        c.linear_opts(), c.out(), vws);
    xent::vocab_parallel_linear_forward_backward(cpu, comm, c.h(), c.w(), c.b(), shard, c.targets(),
                                                 c.linear_opts(), c.up(), c.out(), c.grads(), vws);
    xent::vocab_parallel_linear_backward(cpu, comm, c.h(), c.w(), c.b(), shard, c.targets(),
                                         c.linear_opts(), c.saved_lse(), c.up(), c.grads(), vws);
  });
  return 0;
}
