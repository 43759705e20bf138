// MUST NOT compile: 50257 class weights for logits of 32000 static classes.
#include "static_rows.hpp"

int main() {
  static_call c;
  xent::basic_options<xent::extent<50257>> opts;
  xent::forward(xent::cpu{}, xent::matrix_view<const float, xent::extents<32, 32000>>(nullptr),
                xent::vector_view<const std::int64_t>(c.ids, 2), opts,
                xent::forward_outputs{&c.loss});
}
