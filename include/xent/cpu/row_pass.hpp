// The two sweeps over a row (or a vocabulary slice of it) that the CPU backend is made of:
// statistics (online LSE + the sums the options need) and the gradient. Both walk the slice in
// L1-sized chunks with Eigen's packet math; neither allocates.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../loss_math.hpp"
#include "../online_lse.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "policy.hpp"

namespace xent {
namespace cpu_detail {

using farray = Eigen::Array<float, Eigen::Dynamic, 1>;
using const_fmap = Eigen::Map<const farray>;
template <class T>
using const_tmap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

/// The largest element of a row seen so far and its first index; NaN counts as largest, as in
/// torch.argmax.
struct argmax_state {
  float value = -std::numeric_limits<float>::infinity();
  std::int64_t index = -1;

  static bool greater(float a, float b) { return (std::isnan(a) && !std::isnan(b)) || a > b; }
  void merge(const argmax_state& o) {
    if (o.index >= 0 && (index < 0 || greater(o.value, value) ||
                         (o.index < index && !greater(value, o.value))))
      *this = o;
  }
};

/// Everything a sweep needs to know about the call, for one logits dtype T and target kind Tgt.
template <class T, class Tgt>
struct problem {
  matrix_view<const T> logits;
  Tgt targets;
  const float* weights;  ///< null: every class weight is 1
  loss_constants k;
  std::int64_t ignore_index;
  std::int64_t chunk;

  static constexpr bool soft = detail::target_traits<Tgt>::soft;

  /// Class id of row n, or -1 for soft targets.
  std::int64_t target(std::int64_t n) const {
    if constexpr (soft) {
      return -1;
    } else {
      return static_cast<std::int64_t>(targets[n]);
    }
  }
  bool ignored(std::int64_t n) const {
    if constexpr (soft) {
      return false;
    } else {
      return target(n) == ignore_index;
    }
  }
  float weight(std::int64_t c) const { return weights ? weights[c] : 1.0f; }
};

/// z = softcap(x) for n elements as float. Returns `src` itself when it already is that (float
/// logits, no softcap) so the common fp32 path sweeps the caller's memory without a copy.
template <class T>
const float* load_logits(const T* src, std::int64_t n, const loss_constants& k, float* buf) {
  if constexpr (std::is_same<T, float>::value) {
    if (k.softcap == 0.0f) return src;
  }
  Eigen::Map<farray> b(buf, n);
  auto x = const_tmap<T>(src, n).template cast<float>();
  if (k.softcap > 0.0f)
    b = (x * k.inv_softcap).tanh() * k.softcap;
  else
    b = x;
  return buf;
}

/// t'_c = (1 - eps) t_c + eps / V, times w_c when weighted, for n classes from c0.
template <class T, class S>
void load_soft_targets(const problem<T, soft_targets<S>>& pb, std::int64_t n, std::int64_t c0,
                       std::int64_t len, float* buf) {
  Eigen::Map<farray> b(buf, len);
  b = const_tmap<S>(pb.targets.probs.row(n) + c0, len).template cast<float>() * pb.k.keep +
      pb.k.smooth;
  if (pb.weights) b *= const_fmap(pb.weights + c0, len);
}

/// Finds the first index of the chunk maximum, only when it beats the running one: on real rows the
/// running maximum stops improving after a few chunks, so the scalar scan is rare.
inline void update_argmax(const_fmap z, std::int64_t c0, argmax_state& am) {
  const float cm = z.template maxCoeff<Eigen::PropagateNaN>();
  if (!(am.index < 0 || argmax_state::greater(cm, am.value))) return;
  const bool nan = std::isnan(cm);
  for (Eigen::Index i = 0; i < z.size(); ++i) {
    if (nan ? std::isnan(z[i]) : z[i] == cm) {
      am.value = cm;
      am.index = c0 + i;
      return;
    }
  }
}

/// Statistics of row n over classes [v0, v1): one read of the logits.
template <bool Argmax, class T, class Tgt>
row_partial slice_stats(const problem<T, Tgt>& pb, std::int64_t n, std::int64_t v0, std::int64_t v1,
                        argmax_state* am) {
  alignas(64) float zbuf[policy::max_chunk];
  alignas(64) float tbuf[problem<T, Tgt>::soft ? policy::max_chunk : 1];
  const T* x = pb.logits.row(n);
  row_partial p;
  for (std::int64_t c = v0; c < v1; c += pb.chunk) {
    const std::int64_t len = std::min(pb.chunk, v1 - c);
    const_fmap z(load_logits(x + c, len, pb.k, zbuf), len);
    // Max first, then one exponential per element relative to it: the chunk is in L1, so the
    // second sweep is cheap, and it halves the exponentials of a per-element online update.
    const float m = z.maxCoeff();
    float s;
    if (m == -std::numeric_limits<float>::infinity())
      s = z.isNaN().any() ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    else
      s = (z - m).exp().sum();
    p.lse.merge(online_lse::of_block(m, s));
    if constexpr (Argmax) update_argmax(z, c, *am);
    if constexpr (problem<T, Tgt>::soft) {
      load_soft_targets(pb, n, c, len, tbuf);
      const_fmap t(tbuf, len);
      p.mass += t.sum();
      p.dot += (t * z).sum();
    } else if (pb.k.smoothing()) {
      p.dot += pb.weights ? (z * const_fmap(pb.weights + c, len)).sum() : z.sum();
    }
  }
  if constexpr (!problem<T, Tgt>::soft) {
    const std::int64_t y = pb.target(n);
    if (y >= v0 && y < v1) p.target_logit = apply_softcap(static_cast<float>(x[y]), pb.k);
  }
  return p;
}

/// sum_c w_c t'_c of a soft-target row (what backward needs before it can write a gradient).
template <class T, class S>
float soft_mass(const problem<T, soft_targets<S>>& pb, std::int64_t n) {
  alignas(64) float tbuf[policy::max_chunk];
  float mass = 0.0f;
  for (std::int64_t c = 0; c < pb.logits.cols; c += pb.chunk) {
    const std::int64_t len = std::min(pb.chunk, pb.logits.cols - c);
    load_soft_targets(pb, n, c, len, tbuf);
    mass += const_fmap(tbuf, len).sum();
  }
  return mass;
}

/// Writes zeros over classes [v0, v1) of an ignored row.
template <class G>
void zero_slice(G* out, std::int64_t v0, std::int64_t v1) {
  std::fill(out + v0, out + v1, G(0.0f));
}

/// Gradient of row n over classes [v0, v1), scaled by the row's upstream g:
///   g * (alpha * exp(z_j - lse) - w_j t'_j) * softcap'(x_j),
/// then the target class rewritten from a float computation (class_target_gradient) so that
/// p_y - 1 is never formed in the output dtype. `out` is the row of grad; it may be the row of the
/// logits (each chunk is read in full before it is written).
template <class T, class Tgt, class G>
void slice_gradient(const problem<T, Tgt>& pb, std::int64_t n, std::int64_t v0, std::int64_t v1,
                    float lse, float mass, float g, G* out) {
  alignas(64) float zbuf[policy::max_chunk];
  alignas(64) float gbuf[policy::max_chunk];
  alignas(64) float tbuf[problem<T, Tgt>::soft ? policy::max_chunk : 1];
  const T* x = pb.logits.row(n);
  const loss_constants& k = pb.k;
  const float ga = g * gradient_alpha(mass, lse, k);
  const std::int64_t y = pb.target(n);
  const bool has_target = y >= v0 && y < v1;
  const float x_y = has_target ? static_cast<float>(x[y]) : 0.0f;  // read before it is overwritten
  const bool plain = !problem<T, Tgt>::soft && !k.smoothing() && k.softcap == 0.0f;
  for (std::int64_t c = v0; c < v1; c += pb.chunk) {
    const std::int64_t len = std::min(pb.chunk, v1 - c);
    const_fmap z(load_logits(x + c, len, k, zbuf), len);
    Eigen::Map<Eigen::Array<G, Eigen::Dynamic, 1>> o(out + c, len);
    if (plain) {  // the common case in one fused sweep
      o = ((z - lse).exp() * ga).template cast<G>();
      continue;
    }
    Eigen::Map<farray> d(gbuf, len);
    d = (z - lse).exp() * ga;
    if constexpr (problem<T, Tgt>::soft) {
      load_soft_targets(pb, n, c, len, tbuf);
      d -= const_fmap(tbuf, len) * g;
    } else if (k.smoothing()) {
      if (pb.weights)
        d -= const_fmap(pb.weights + c, len) * (g * k.smooth);
      else
        d -= g * k.smooth;
    }
    if (k.softcap > 0.0f) d *= 1.0f - (z * k.inv_softcap).square();
    o = d.template cast<G>();
  }
  if (has_target)
    out[y] = G(class_target_gradient(x_y, pb.weight(y), gradient_alpha(mass, lse, k), lse, g, k));
}

}  // namespace cpu_detail
}  // namespace xent
