// What the compile checks share: two rows of three classes, their class ids and float outputs.
// Each file varies the one thing its static_assert is about.
#pragma once

#include <cstdint>

#include "xent/xent.hpp"

struct two_rows {
  std::int64_t targets[2] = {0, 1};
  float loss = 0;
  xent::forward_outputs out;

  two_rows() { out.loss = &loss; }
  xent::vector_view<const std::int64_t> ids() const { return {targets, 2}; }
};

/// 2 x 3 logits of dtype T (zeros) as a view.
template <class T>
struct logits_2x3 {
  T data[6] = {};
  xent::matrix_view<const T> view() const { return {data, 2, 3}; }
};

/// A forward of T logits into float outputs.
template <class T>
void forward_into_float_outputs() {
  two_rows r;
  logits_2x3<T> x;
  xent::forward(xent::cpu{}, x.view(), r.ids(), xent::options{}, r.out);
}
