// The loss options, with PyTorch's semantics (torch.nn.functional.cross_entropy, aten LossNLL.cpp).
#pragma once

#include <cstdint>
#include <type_traits>

#include "accumulator.hpp"
#include "views.hpp"

namespace xent {

/// How per-row losses become the result.
enum class reduction {
  none,  ///< per-row losses only; backward takes a per-row upstream gradient
  mean,  ///< sum of row losses / W, W = sum of w[y] over rows not ignored (their count without
         ///< weights; N for soft targets). Every row ignored gives NaN, as PyTorch does.
  sum,   ///< sum of row losses; 0 when every row is ignored or N = 0
};

/// The options are float for every dtype: a float64 call widens them exactly, so a float64
/// reference to compare with should use the same float values (0.1f, not 0.1, for eps).
/// W is the extent of class_weights (views.hpp): xent::options for a run-time V,
/// basic_options<extent<V>> to have the entry points check V against the logits' at compile time.
template <class W = dynamic_extent>
struct basic_options {
  reduction reduce = reduction::mean;
  /// Rows whose target equals this are ignored (loss 0, gradient 0, excluded from W). Any value,
  /// also a valid class id. Not used with soft targets.
  std::int64_t ignore_index = -100;
  /// eps in [0, 1]: loss = (1 - eps) * NLL + (eps / V) * sum_c w_c * (-log p_c).
  float label_smoothing = 0.0f;
  /// Per-class weights w_c (V floats, in the backend's memory); empty means every weight is 1.
  /// Float for every logits dtype, float64 included: weights are given, not learned, and sums of
  /// them are formed in the call's accumulator.
  vector_view<const float, W> class_weights{};
  /// z-loss (PaLM; Liger's lse_square_scale) >= 0: adds z_loss * lse^2 to every row not ignored.
  float z_loss = 0.0f;
  /// softcap (Gemma 2) >= 0: logits become softcap * tanh(x / softcap) before the loss; 0 is off.
  float softcap = 0.0f;

  basic_options() = default;
  /// Run-time sized options from static ones (the entry points convert after their checks).
  template <class W2, class = std::enable_if_t<std::is_convertible<
                          vector_view<const float, W2>, vector_view<const float, W>>::value>>
  basic_options(const basic_options<W2>& o)  // NOLINT(google-explicit-constructor)
      : reduce(o.reduce),
        ignore_index(o.ignore_index),
        label_smoothing(o.label_smoothing),
        class_weights(detail::optional_view(o.class_weights)),
        z_loss(o.z_loss),
        softcap(o.softcap) {}
};
using options = basic_options<>;

/// The gradient flowing into the loss. With reduction mean or sum the loss is a scalar, and its
/// gradient is `scale`, times `*scale_ptr` when that is given (a pointer into the backend's memory,
/// so a device-resident gradient is read without a host synchronisation). With reduction none each
/// row n gets `scale * rows[n]` (`rows` has N entries), or `scale` when `rows` is empty.
/// A is the call's accumulator (accumulator_t of the logits): float, or double for double logits;
/// E the extent of `rows` (views.hpp).
template <class A, class E = dynamic_extent>
struct basic_upstream {
  A scale = A(1);
  const A* scale_ptr = nullptr;
  vector_view<const A, E> rows{};
};
using upstream = basic_upstream<float>;

/// Where forward results go; every member is optional except the loss the reduction produces
/// (`loss` for mean and sum, `row_loss` for none). Pointers and views refer to the backend's
/// memory. A is the call's accumulator, as for basic_upstream; E the extent of the per-row
/// outputs (views.hpp; a static one with null data is absent: detail::optional_view).
template <class A, class E = dynamic_extent>
struct basic_forward_outputs {
  A* loss = nullptr;                      ///< reduced loss (mean or sum)
  vector_view<A, E> row_loss{};           ///< per-row loss, N entries (0 on ignored rows)
  vector_view<A, E> lse{};                ///< per-row log-sum-exp of the (soft-capped) logits
  vector_view<std::int64_t, E> argmax{};  ///< per-row index of the largest (soft-capped) logit,
                                          ///< the first on ties
  std::int64_t* num_correct = nullptr;    ///< rows not ignored whose argmax equals the target
};
using forward_outputs = basic_forward_outputs<float>;

}  // namespace xent
