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
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "config.hpp"
#include "online_lse.hpp"
#include "options.hpp"

namespace xent {

/// What one pass over a row, or over a slice of it, accumulates. Slices merge by `merge`: the
/// LSE states combine and the sums add (a slice that does not hold the target adds 0).
struct row_partial {
  online_lse lse;
  float target_logit = 0.0f;  ///< class ids: z_y if y is in this slice
  float dot = 0.0f;   ///< class ids: sum_c w_c z_c (label smoothing only); soft: sum_c w_c t'_c z_c
  float mass = 0.0f;  ///< soft targets: sum_c w_c t'_c

  XENT_HOST_DEVICE void merge(const row_partial& other) {
    lse.merge(other.lse);
    target_logit += other.target_logit;
    dot += other.dot;
    mass += other.mass;
  }
};

/// The largest element of a row seen so far and its first index; NaN counts as largest, as in
/// torch.argmax. Pieces merge in any order to the same answer.
struct argmax_state {
  float value = -HUGE_VALF;
  std::int64_t index = -1;

  XENT_HOST_DEVICE static bool greater(float a, float b) {
    return (a != a && b == b) || a > b;  // a is NaN and b is not, or plainly larger
  }
  XENT_HOST_DEVICE void merge(const argmax_state& o) {
    if (o.index >= 0 &&
        (index < 0 || greater(o.value, value) || (o.index < index && !greater(value, o.value))))
      *this = o;
  }
};

/// Everything one slice of a row contributes: its statistics and its argmax (a global class id).
/// CPU threads merge these per row, and so do vocab-parallel ranks after exchanging them, in a
/// fixed order so that every rank gets the same bits. A plain, fixed-size record: it travels
/// through collectives as bytes.
struct slice_partial {
  row_partial stats;
  argmax_state argmax;

  XENT_HOST_DEVICE void merge(const slice_partial& other) {
    stats.merge(other.stats);
    argmax.merge(other.argmax);
  }
};

/// Constants of one call, derived from the options once.
struct loss_constants {
  float keep = 1.0f;    ///< 1 - eps
  float smooth = 0.0f;  ///< eps / V
  float z_loss = 0.0f;
  float softcap = 0.0f;  ///< 0: off
  float inv_softcap = 0.0f;
  float weight_sum = 0.0f;  ///< sum_c w_c (V without weights)

  XENT_HOST_DEVICE bool smoothing() const { return smooth != 0.0f; }
};

inline loss_constants make_loss_constants(const options& opts, std::int64_t vocab,
                                          float weight_sum) {
  loss_constants k;
  k.keep = 1.0f - opts.label_smoothing;
  k.smooth = vocab > 0 ? opts.label_smoothing / static_cast<float>(vocab) : 0.0f;
  k.z_loss = opts.z_loss;
  k.softcap = opts.softcap;
  k.inv_softcap = opts.softcap > 0.0f ? 1.0f / opts.softcap : 0.0f;
  k.weight_sum = weight_sum;
  return k;
}

/// softcap * tanh(x / softcap), or x when softcap is off.
XENT_HOST_DEVICE inline float apply_softcap(float x, const loss_constants& k) {
  return k.softcap > 0.0f ? k.softcap * std::tanh(x * k.inv_softcap) : x;
}

/// d(capped)/d(raw) from the capped value: 1 - tanh^2.
XENT_HOST_DEVICE inline float softcap_slope(float capped, const loss_constants& k) {
  const float r = capped * k.inv_softcap;
  return k.softcap > 0.0f ? 1.0f - r * r : 1.0f;
}

/// sum_c w_c t'_c for a class-id target whose weight is w_y.
XENT_HOST_DEVICE inline float class_target_mass(float w_y, const loss_constants& k) {
  return k.keep * w_y + k.smooth * k.weight_sum;
}

/// Loss of a row with class-id target of weight w_y. The NLL and smoothing terms are formed
/// separately, each as a difference of its own sums, so eps = 0 costs no precision.
XENT_HOST_DEVICE inline float class_row_loss(const row_partial& p, float w_y,
                                             const loss_constants& k) {
  const float lse = p.lse.lse();
  float loss = k.keep * w_y * (lse - p.target_logit);
  if (k.smoothing()) loss += k.smooth * (k.weight_sum * lse - p.dot);
  return loss + k.z_loss * lse * lse;
}

/// Loss of a row with soft targets.
XENT_HOST_DEVICE inline float soft_row_loss(const row_partial& p, const loss_constants& k) {
  const float lse = p.lse.lse();
  return p.mass * lse - p.dot + k.z_loss * lse * lse;
}

/// alpha = mass + 2 z_loss lse: the coefficient of p_j in the gradient.
XENT_HOST_DEVICE inline float gradient_alpha(float mass, float lse, const loss_constants& k) {
  return mass + 2.0f * k.z_loss * lse;
}

/// The upstream gradient every row of a mean or sum reduction gets: scale, times *scale_ptr when
/// given (read in the caller's memory space: host for the CPU, device inside a kernel), divided by
/// the mean's normaliser W. In double, rounded once by the caller.
XENT_HOST_DEVICE inline double scalar_upstream(float scale, const float* scale_ptr,
                                               reduction reduce, double normalizer) {
  double g = static_cast<double>(scale);
  if (scale_ptr) g *= static_cast<double>(*scale_ptr);
  if (reduce == reduction::mean) g /= normalizer;
  return g;
}

/// The gradient at the target class of a class-id row, formed in float from its (soft-capped)
/// logit z_y and rounded once by the caller: (alpha p_y - (1 - eps) w_y - (eps / V) w_y) * slope *
/// g. The p_y - 1 cancellation happens here, in float, never through a bf16 intermediate.
XENT_HOST_DEVICE inline float class_target_gradient(float z_y, float w_y, float alpha, float lse,
                                                    float g, const loss_constants& k) {
  const float p = std::exp(z_y - lse);
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
