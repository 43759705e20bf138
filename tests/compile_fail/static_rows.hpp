// What the static-extent compile checks share: 2 x 3 float logits, 2 x 4 hidden rows and a 3 x 4
// weight as static views, their class ids, outputs and gradients. Each compile-fail file changes
// the extent of one argument; static_views.cpp makes every call with all of them agreeing.
#pragma once

#include <cstdint>

#include "xent/xent.hpp"

using ext23 = xent::extents<2, 3>;
using ext24 = xent::extents<2, 4>;
using ext34 = xent::extents<3, 4>;

struct static_call {
  float logits[6] = {};
  float grad[6] = {};
  std::int64_t ids[2] = {0, 1};
  float row_loss[2] = {}, lse[2] = {}, up_rows[2] = {1, 1};
  float weights[3] = {1, 1, 1};
  float loss = 0;
  float hidden[8] = {}, weight[12] = {}, bias[3] = {};
  float d_hidden[8] = {}, d_weight[12] = {}, d_bias[3] = {};
  unsigned char workspace[1 << 16] = {};

  xent::matrix_view<const float, ext23> x() const {
    return xent::matrix_view<const float, ext23>(logits);
  }
  xent::matrix_view<float, ext23> g() { return xent::matrix_view<float, ext23>(grad); }
  xent::vector_view<const std::int64_t, xent::extent<2>> targets() const {
    return xent::vector_view<const std::int64_t, xent::extent<2>>(ids);
  }
  xent::basic_options<xent::extent<3>> opts() const {
    xent::basic_options<xent::extent<3>> o;
    o.class_weights = xent::vector_view<const float, xent::extent<3>>(weights);
    return o;
  }
  xent::basic_linear_options<xent::extent<3>> linear_opts() const {
    xent::basic_linear_options<xent::extent<3>> o;
    o.class_weights = xent::vector_view<const float, xent::extent<3>>(weights);
    return o;
  }
  xent::basic_forward_outputs<float, xent::extent<2>> out() {
    xent::basic_forward_outputs<float, xent::extent<2>> o;
    o.loss = &loss;
    o.row_loss = xent::vector_view<float, xent::extent<2>>(row_loss);
    return o;
  }
  xent::vector_view<const float, xent::extent<2>> saved_lse() const {
    return xent::vector_view<const float, xent::extent<2>>(lse);
  }
  xent::basic_upstream<float, xent::extent<2>> up() const { return {}; }
  xent::matrix_view<const float, ext24> h() const {
    return xent::matrix_view<const float, ext24>(hidden);
  }
  xent::matrix_view<const float, ext34> w() const {
    return xent::matrix_view<const float, ext34>(weight);
  }
  xent::vector_view<const float, xent::extent<3>> b() const {
    return xent::vector_view<const float, xent::extent<3>>(bias);
  }
  xent::linear_grads<float, ext24, ext34> grads() {
    return {xent::matrix_view<float, ext24>(d_hidden), xent::matrix_view<float, ext34>(d_weight),
            xent::vector_view<float, xent::extent<3>>(d_bias)};
  }
  xent::linear_workspace ws() { return {workspace, sizeof workspace}; }
};
