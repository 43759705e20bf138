// backend_traits<cuda>: the public call layer of the cross-entropy entry points, over the
// dispatch (dispatch/rows.cuh).
#pragma once

#include "../backend.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "block/dtype.cuh"
#include "cuda.cuh"
#include "dispatch/rows.cuh"
#include "instances.cuh"

namespace xent {

template <>
struct backend_traits<cuda> {
  template <class T>
  static constexpr bool supports_dtype = cuda_detail::is_device_dtype<T>;
  /// A gradient no narrower than the logits: a tile's gradient is stored in whole 16-byte vectors
  /// (block/tile_gradient.cuh), which a narrower element would leave half filled.
  template <class T, class G>
  static constexpr bool supports_gradient = cuda_detail::is_device_dtype<G> &&
                                            sizeof(G) >= sizeof(T);
  /// The logits come with their static extents (views.hpp): a static shape's small batch runs
  /// a launch plan fixed at compile time (dispatch/rows.cuh's try_small_rows).
  static constexpr bool static_shape = true;

  template <class T, class E, class Tgt>
  static void forward(const cuda& exec, matrix_view<const T, E> logits, const Tgt& targets,
                      const options& opts, const forward_outputs& out) {
    cuda_detail::run<cuda_detail::pass::forward, E>("xent::forward", exec,
                                                    matrix_view<const T>(logits), targets, opts,
                                                    nullptr, &out, {}, matrix_view<float>{});
  }

  template <class T, class E, class Tgt, class G>
  static void backward(const cuda& exec, matrix_view<const T, E> logits, const Tgt& targets,
                       const options& opts, vector_view<const float> lse, const upstream& up,
                       matrix_view<G> grad) {
    cuda_detail::run<cuda_detail::pass::backward, E>("xent::backward", exec,
                                                     matrix_view<const T>(logits), targets, opts,
                                                     &up, nullptr, lse, grad);
  }

  template <class T, class E, class Tgt, class G>
  static void forward_backward(const cuda& exec, matrix_view<const T, E> logits, const Tgt& targets,
                               const options& opts, const upstream& up, const forward_outputs& out,
                               matrix_view<G> grad) {
    cuda_detail::run<cuda_detail::pass::fused, E>("xent::forward_backward", exec,
                                                  matrix_view<const T>(logits), targets, opts, &up,
                                                  &out, {}, grad);
  }
};

}  // namespace xent
