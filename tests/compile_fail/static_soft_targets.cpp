// MUST NOT compile: soft targets of 4 static classes for logits of 3.
#include "static_rows.hpp"

int main() {
  static_call c;
  xent::forward(xent::cpu{}, c.x(), xent::soft(c.h()), xent::options{}, c.out());
}
