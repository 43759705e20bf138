// The per-row loss and gradient formulas, written once for every backend.
//
// With z the (soft-capped) logits of a row, p = softmax(z), class weights w (all 1 when absent),
// label smoothing eps over V classes and the target distribution
//     t'_c = (1 - eps) t_c + eps / V          (t one-hot at y for class-id targets),
// the row loss is
//     l = sum_c w_c t'_c (lse - z_c) + z_loss * lse^2 = mass * lse - dot + z_loss * lse^2,
//     mass = sum_c w_c t'_c,   dot = sum_c w_c t'_c z_c,
// and its gradient with respect to z_j, scaled by the row's upstream gradient g, is
//     dl/dz_j = g * (alpha * p_j - w_j t'_j),   alpha = mass + 2 * z_loss * lse,
// times the softcap slope 1 - (z_j / cap)^2 for the raw logit. For class ids this is PyTorch's
// (1 - eps) w_y (p_j - [j = y]) + (eps / V)(p_j sum_c w_c - w_j) (ANCHORS.md).
//
// Every formula is a template on the accumulator A (float, or double for the CPU backend's float64
// logits; accumulator.hpp), deduced from the state structs only, so float callers, device code
// included, compile to what they did before these were templates. The structs' float
// instantiations keep their old names (row_partial, argmax_state, slice_partial, loss_constants).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "accumulator.hpp"
#include "config.hpp"
#include "online_lse.hpp"
#include "options.hpp"

namespace xent {

/// What one pass over a row, or over a slice of it, accumulates. Slices merge by `merge`: the
/// LSE states combine and the sums add (a slice that does not hold the target adds 0).
template <class A>
struct basic_row_partial {
  basic_online_lse<A> lse;
  A target_logit = A(0);  ///< class ids: z_y if y is in this slice
  A dot = A(0);   ///< class ids: sum_c w_c z_c (label smoothing only); soft: sum_c w_c t'_c z_c
  A mass = A(0);  ///< soft targets: sum_c w_c t'_c

  XENT_HOST_DEVICE void merge(const basic_row_partial& other) {
    lse.merge(other.lse);
    target_logit += other.target_logit;
    dot += other.dot;
    mass += other.mass;
  }
};
using row_partial = basic_row_partial<float>;

/// The largest element of a row seen so far and its first index; NaN counts as largest, as in
/// torch.argmax. Pieces merge in any order to the same answer.
template <class A>
struct basic_argmax_state {
  A value = -static_cast<A>(HUGE_VAL);
  std::int64_t index = -1;

  XENT_HOST_DEVICE static bool greater(A a, A b) {
    return (a != a && b == b) || a > b;  // a is NaN and b is not, or plainly larger
  }
  XENT_HOST_DEVICE void merge(const basic_argmax_state& o) {
    if (o.index >= 0 &&
        (index < 0 || greater(o.value, value) || (o.index < index && !greater(value, o.value))))
      *this = o;
  }
};
using argmax_state = basic_argmax_state<float>;

/// Everything one slice of a row contributes: its statistics and its argmax (a global class id).
/// CPU threads merge these per row, and so do vocab-parallel ranks after exchanging them, in a
/// fixed order so that every rank gets the same bits. A plain, fixed-size record: it travels
/// through collectives as bytes.
template <class A>
struct basic_slice_partial {
  basic_row_partial<A> stats;
  basic_argmax_state<A> argmax;

  XENT_HOST_DEVICE void merge(const basic_slice_partial& other) {
    stats.merge(other.stats);
    argmax.merge(other.argmax);
  }
};
using slice_partial = basic_slice_partial<float>;

/// Constants of one call, derived from the options once (the options are float; double calls
/// widen them exactly).
template <class A>
struct basic_loss_constants {
  A keep = A(1);    ///< 1 - eps
  A smooth = A(0);  ///< eps / V
  A z_loss = A(0);
  A softcap = A(0);  ///< 0: off
  A inv_softcap = A(0);
  A weight_sum = A(0);  ///< sum_c w_c (V without weights)

  XENT_HOST_DEVICE bool smoothing() const { return smooth != A(0); }
};
using loss_constants = basic_loss_constants<float>;

template <class A = float>
basic_loss_constants<A> make_loss_constants(const options& opts, std::int64_t vocab,
                                            detail::non_deduced_t<A> weight_sum) {
  basic_loss_constants<A> k;
  const A eps = static_cast<A>(opts.label_smoothing), cap = static_cast<A>(opts.softcap);
  k.keep = A(1) - eps;
  k.smooth = vocab > 0 ? eps / static_cast<A>(vocab) : A(0);
  k.z_loss = static_cast<A>(opts.z_loss);
  k.softcap = cap;
  k.inv_softcap = cap > A(0) ? A(1) / cap : A(0);
  k.weight_sum = weight_sum;
  return k;
}

/// softcap * tanh(x / softcap), or x when softcap is off.
template <class A>
XENT_HOST_DEVICE A apply_softcap(detail::non_deduced_t<A> x, const basic_loss_constants<A>& k) {
  return k.softcap > A(0) ? k.softcap * std::tanh(x * k.inv_softcap) : x;
}

/// d(capped)/d(raw) from the capped value: 1 - tanh^2.
template <class A>
XENT_HOST_DEVICE A softcap_slope(detail::non_deduced_t<A> capped,
                                 const basic_loss_constants<A>& k) {
  const A r = capped * k.inv_softcap;
  return k.softcap > A(0) ? A(1) - r * r : A(1);
}

/// sum_c w_c t'_c for a class-id target whose weight is w_y.
template <class A>
XENT_HOST_DEVICE A class_target_mass(detail::non_deduced_t<A> w_y,
                                     const basic_loss_constants<A>& k) {
  return k.keep * w_y + k.smooth * k.weight_sum;
}

/// Loss of a row with class-id target of weight w_y. The NLL and smoothing terms are formed
/// separately, each as a difference of its own sums, so eps = 0 costs no precision.
template <class A>
XENT_HOST_DEVICE A class_row_loss(const basic_row_partial<A>& p, detail::non_deduced_t<A> w_y,
                                  const basic_loss_constants<A>& k) {
  const A lse = p.lse.lse();
  A loss = k.keep * w_y * (lse - p.target_logit);
  if (k.smoothing()) loss += k.smooth * (k.weight_sum * lse - p.dot);
  return loss + k.z_loss * lse * lse;
}

/// Loss of a row with soft targets.
template <class A>
XENT_HOST_DEVICE A soft_row_loss(const basic_row_partial<A>& p, const basic_loss_constants<A>& k) {
  const A lse = p.lse.lse();
  return p.mass * lse - p.dot + k.z_loss * lse * lse;
}

/// alpha = mass + 2 z_loss lse: the coefficient of p_j in the gradient.
template <class A>
XENT_HOST_DEVICE A gradient_alpha(detail::non_deduced_t<A> mass, detail::non_deduced_t<A> lse,
                                  const basic_loss_constants<A>& k) {
  return mass + A(2) * k.z_loss * lse;
}

/// `total` over the mean's normaliser W (`divisor` 1 for a sum). W = 0 gives NaN whatever the
/// total, as PyTorch's mean does: every row ignored is 0 / 0, and so is the NLL term of
/// (1 - eps) * NLL / W + eps * S / W when every kept row's class weight is 0, though S / W alone
/// (label smoothing, and likewise z-loss) would be +inf.
XENT_HOST_DEVICE inline double over_normalizer(double total, double divisor) {
  return divisor == 0.0 ? static_cast<double>(NAN) : total / divisor;
}

/// The upstream gradient every row of a mean or sum reduction gets: scale, times *scale_ptr when
/// given (read in the caller's memory space: host for the CPU, device inside a kernel), divided by
/// the mean's normaliser W (NaN for W = 0: PyTorch's gradient of its NaN mean is NaN on every row
/// it keeps; ignored rows stay 0). In double, rounded once by the caller.
template <class A>
XENT_HOST_DEVICE double scalar_upstream(detail::non_deduced_t<A> scale, const A* scale_ptr,
                                        reduction reduce, double normalizer) {
  double g = static_cast<double>(scale);
  if (scale_ptr) g *= static_cast<double>(*scale_ptr);
  return reduce == reduction::mean ? over_normalizer(g, normalizer) : g;
}

/// The gradient at the target class of a class-id row, formed in A from its (soft-capped)
/// logit z_y and rounded once by the caller: (alpha p_y - (1 - eps) w_y - (eps / V) w_y) * slope *
/// g. The p_y - 1 cancellation happens here, in A, never through a bf16 intermediate.
template <class A>
XENT_HOST_DEVICE A class_target_gradient(detail::non_deduced_t<A> z_y, detail::non_deduced_t<A> w_y,
                                         detail::non_deduced_t<A> alpha,
                                         detail::non_deduced_t<A> lse, detail::non_deduced_t<A> g,
                                         const basic_loss_constants<A>& k) {
  const A p = std::exp(z_y - lse);
  return g * (alpha * p - (k.keep + k.smooth) * w_y) * softcap_slope(z_y, k);
}

/// Row weight in the mean's normaliser W = sum_n w[y_n]: w[y] (1 without class weights), 0 for
/// an ignored row or a class id outside [0, cols) (the CUDA backend's NaN rows; the CPU throws
/// on those first).
XENT_HOST_DEVICE inline double normalizer_weight(std::int64_t y, std::int64_t ignore_index,
                                                 std::int64_t cols, const float* weights) {
  if (y == ignore_index || y < 0 || y >= cols) return 0.0;
  return weights ? static_cast<double>(weights[y]) : 1.0;
}

}  // namespace xent
