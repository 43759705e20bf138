// The two sweeps over a row (or a vocabulary slice of it) that the CPU backend is made of:
// statistics (online LSE + the sums the options need) and the gradient. Both walk the slice in
// L1-sized chunks with Eigen's packet math; neither allocates.
//
// Everything is computed in the accumulator A of the logits' dtype (float; double for double
// logits: problem::acc). All arithmetic happens in 64-byte-aligned stack buffers; the caller's
// memory is only converted into them and out of them. Eigen peels the unaligned head of a buffer
// into scalar code (scalar std::exp, a different summation order), so arithmetic on the caller's
// pointers would make the results depend on where the caller's arrays happen to sit.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "../accumulator.hpp"
#include "../loss_math.hpp"
#include "../online_lse.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "convert.hpp"
#include "packet.hpp"
#include "policy.hpp"

namespace xent {
namespace cpu_detail {

template <class A>
using acc_array = Eigen::Array<A, Eigen::Dynamic, 1>;
/// A chunk in one of the aligned stack buffers.
template <class A>
using const_amap = Eigen::Map<const acc_array<A>, Eigen::Aligned64>;
template <class A>
using amap = Eigen::Map<acc_array<A>, Eigen::Aligned64>;
/// A chunk of the caller's memory (any alignment): only converted, never computed on.
template <class T>
using const_tmap = Eigen::Map<const Eigen::Array<std::remove_const_t<T>, Eigen::Dynamic, 1>>;
template <class T>
using tmap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;

/// Everything a sweep needs to know about the call, for one logits dtype T and target kind Tgt.
///
/// Sweeps index columns of `logits`. The logits may be a vocabulary shard (vocab-parallel calls):
/// column 0 is class `first_class`, class ids in `targets` are global, and `weights` points at the
/// weight of column 0 (the caller's full weight vector + first_class), so that local column
/// indices address logits, soft targets, gradient and weights alike. Unsharded: first_class = 0.
template <class T, class Tgt>
struct problem {
  using acc = accumulator_t<T>;  ///< what every sweep computes in

  matrix_view<const T> logits;
  Tgt targets;
  const float* weights;  ///< null: every class weight is 1
  basic_loss_constants<acc> k;
  std::int64_t ignore_index;
  std::int64_t chunk;
  std::int64_t first_class = 0;

  static constexpr bool soft = detail::target_traits<Tgt>::soft;

  /// Global class id of row n, or -1 for soft targets.
  std::int64_t class_id(std::int64_t n) const {
    if constexpr (soft) {
      return -1;
    } else {
      return static_cast<std::int64_t>(targets[n]);
    }
  }
  /// Column of row n's target (outside [0, cols) when another shard holds it).
  std::int64_t target(std::int64_t n) const { return class_id(n) - first_class; }
  bool ignored(std::int64_t n) const {
    if constexpr (soft) {
      return false;
    } else {
      return class_id(n) == ignore_index;
    }
  }
  /// Weight of column c; columns outside the shard still index the caller's full weight vector.
  acc weight(std::int64_t c) const { return weights ? static_cast<acc>(weights[c]) : acc(1); }
};

template <class F, std::int64_t... I>
XENT_ALWAYS_INLINE void unrolled(F& f, std::integer_sequence<std::int64_t, I...>) {
  (f(std::integral_constant<std::int64_t, I>{}), ...);
}

/// Calls f(c, len, i) for chunk i, [c, c + len), of [v0, v1): `chunk` elements each, the last
/// fewer. Where the columns are a static extent Cols (views.hpp) and the call is a whole row at
/// the policy's chunk, the loop is unrolled and every len is a std::integral_constant, so the
/// packet loops (packet.hpp) know their remainders at compile time; the chunks, and so the
/// results, are the run-time loop's.
template <std::int64_t Cols = dynamic, class F>
XENT_ALWAYS_INLINE void for_each_chunk(std::int64_t v0, std::int64_t v1, std::int64_t chunk,
                                       F&& f) {
  if constexpr (Cols != dynamic) {
    if (v0 == 0 && v1 == Cols && chunk == policy::chunk) {
      constexpr std::int64_t full = Cols / policy::chunk, tail = Cols % policy::chunk;
      auto whole_chunk = [&](auto i) {
        f(i * policy::chunk, std::integral_constant<std::int64_t, policy::chunk>{}, i);
      };
      unrolled(whole_chunk, std::make_integer_sequence<std::int64_t, full>{});
      if constexpr (tail > 0)
        f(full * policy::chunk, std::integral_constant<std::int64_t, tail>{}, full);
      return;
    }
  }
  for (std::int64_t c = v0, i = 0; c < v1; c += chunk, ++i) f(c, std::min(chunk, v1 - c), i);
}

/// z = softcap(x) for n elements, as A, into the aligned buffer `buf`.
template <class T, class A>
const A* load_logits(const T* src, std::int64_t n, const basic_loss_constants<A>& k, A* buf) {
  convert(src, n, buf);
  if (k.softcap > A(0)) packet_softcap(buf, n, k.softcap, k.inv_softcap);
  return buf;
}

/// n class weights from c0, as A, into the aligned buffer `buf` (null weights: none to load).
template <class A>
const A* load_weights(const float* weights, std::int64_t c0, std::int64_t n, A* buf) {
  amap<A>(buf, n) = const_tmap<float>(weights + c0, n).template cast<A>();
  return buf;
}

/// t'_c = (1 - eps) t_c + eps / V, times w_c when weighted, for n classes from c0.
template <class T, class S, class A>
void load_soft_targets(const problem<T, soft_targets<S>>& pb, std::int64_t n, std::int64_t c0,
                       std::int64_t len, A* buf) {
  amap<A> b(buf, len);
  convert(pb.targets.probs.row(n) + c0, len, buf);
  b = b * pb.k.keep + pb.k.smooth;
  if (pb.weights)  // elementwise: no peeling issue
    b *= const_tmap<float>(pb.weights + c0, len).template cast<A>();
}

/// Finds the first index of the chunk maximum, only when it beats the running one: on real rows the
/// running maximum stops improving after a few chunks, so the scalar scan is rare.
template <class A>
void update_argmax(const_amap<A> z, std::int64_t c0, basic_argmax_state<A>& am) {
  const A cm = z.template maxCoeff<Eigen::PropagateNaN>();
  if (!(am.index < 0 || basic_argmax_state<A>::greater(cm, am.value))) return;
  const bool nan = std::isnan(cm);
  for (Eigen::Index i = 0; i < z.size(); ++i) {
    if (nan ? std::isnan(z[i]) : z[i] == cm) {
      am.value = cm;
      am.index = c0 + i;
      return;
    }
  }
}

/// Where the statistics pass may leave exp(z_j - m_c) for the gradient pass that follows, so a
/// fused call takes one exponential per element instead of two: `values` is a row of the
/// accumulator type (the gradient row, possibly the logits themselves) and m_c the max of chunk c.
template <class A>
struct exp_cache {
  static constexpr std::int64_t max_chunks = 256;
  A* values = nullptr;
  std::array<A, max_chunks> chunk_max;

  static bool fits(std::int64_t cols, std::int64_t chunk) { return cols <= max_chunks * chunk; }
};

/// Adds chunk [c, c + len) of row n to the side sums the options need: argmax, the soft-target
/// mass and dot, or the label-smoothing dot.
template <bool Argmax, class T, class Tgt, class A = typename problem<T, Tgt>::acc>
void accumulate_sides(const problem<T, Tgt>& pb, std::int64_t n, std::int64_t c, const_amap<A> z,
                      basic_row_partial<A>& p, basic_argmax_state<A>* am, A* tbuf) {
  if constexpr (Argmax) update_argmax(z, pb.first_class + c, *am);  // a global class id
  if constexpr (problem<T, Tgt>::soft) {
    load_soft_targets(pb, n, c, z.size(), tbuf);
    const_amap<A> t(tbuf, z.size());
    p.mass += t.sum();
    p.dot += (t * z).sum();
  } else if (pb.k.smoothing()) {
    p.dot += pb.weights
                 ? (z * const_amap<A>(load_weights(pb.weights, c, z.size(), tbuf), z.size())).sum()
                 : z.sum();
  }
}

/// Statistics of row n over classes [v0, v1): one read of the logits. With a cache (whole rows,
/// no softcap), exp(z_j - m_c) is also stored in cache->values.
template <bool Argmax, std::int64_t Cols = dynamic, class T, class Tgt,
          class A = typename problem<T, Tgt>::acc>
basic_row_partial<A> slice_stats(const problem<T, Tgt>& pb, std::int64_t n, std::int64_t v0,
                                 std::int64_t v1, basic_argmax_state<A>* am,
                                 exp_cache<A>* cache = nullptr) {
  alignas(64) A zbuf[policy::max_chunk];
  alignas(64) A tbuf[policy::max_chunk];  // soft targets or class weights
  const T* x = pb.logits.row(n);
  basic_row_partial<A> p;
  // Logits of the accumulator type with nothing but the LSE to compute are swept in place by the
  // packet loops; any other case converts each chunk into zbuf first (the Eigen expressions then
  // run on it).
  const bool direct = std::is_same<T, A>::value && pb.k.softcap == A(0) && !Argmax &&
                      !problem<T, Tgt>::soft && !pb.k.smoothing();
  if constexpr (!problem<T, Tgt>::soft) {  // before a cache may overwrite it
    const std::int64_t y = pb.target(n);
    if (y >= v0 && y < v1)
      p.target_logit = softcap_one(static_cast<A>(x[y]), pb.k.softcap, pb.k.inv_softcap);
  }
  constexpr A inf = std::numeric_limits<A>::infinity();
  for_each_chunk<Cols>(v0, v1, pb.chunk, [&](std::int64_t c, auto len, std::int64_t i) {
    const A* zp = direct ? reinterpret_cast<const A*>(x + c) : load_logits(x + c, len, pb.k, zbuf);
    // Max first, then one exponential per element relative to it: the chunk is in L1, so the
    // second sweep is cheap, and it halves the exponentials of a per-element online update.
    const A m = packet_max(zp, len);
    if (!direct) accumulate_sides<Argmax>(pb, n, c, const_amap<A>(zp, len), p, am, tbuf);
    A* e = cache ? cache->values + c : nullptr;  // may be the logits: zp is read first
    A s;
    if (m == -inf) {  // all -inf (masked) or NaN: no exp(-inf - -inf)
      s = A(0);
      for (std::int64_t j = 0; j < len; ++j) s += zp[j] != zp[j] ? zp[j] : A(0);  // NaN stays
      if (e) std::fill(e, e + len, A(0));
    } else {
      s = packet_exp_sum(zp, len, m, e);
    }
    if (cache) cache->chunk_max[i] = m;
    p.lse.merge(basic_online_lse<A>::of_block(m, s));
  });
  return p;
}

/// sum_c w_c t'_c of a soft-target row (what backward needs before it can write a gradient).
template <class T, class S, class A = accumulator_t<T>>
A soft_mass(const problem<T, soft_targets<S>>& pb, std::int64_t n) {
  alignas(64) A tbuf[policy::max_chunk];
  A mass = A(0);
  for (std::int64_t c = 0; c < pb.logits.cols; c += pb.chunk) {
    const std::int64_t len = std::min(pb.chunk, pb.logits.cols - c);
    load_soft_targets(pb, n, c, len, tbuf);
    mass += const_amap<A>(tbuf, len).sum();
  }
  return mass;
}

/// Writes zeros over classes [v0, v1) of an ignored row.
template <class G>
void zero_slice(G* out, std::int64_t v0, std::int64_t v1) {
  std::fill(out + v0, out + v1, G(0.0f));
}

/// d_j -= g * w_j t'_j over chunk [c, c + len): the target part of the gradient that is not the
/// single target class (label smoothing, soft targets).
template <class T, class Tgt, class A>
void subtract_target_mass(const problem<T, Tgt>& pb, std::int64_t n, std::int64_t c, A g,
                          amap<A>& d, A* tbuf) {
  const std::int64_t len = d.size();
  if constexpr (problem<T, Tgt>::soft) {
    load_soft_targets(pb, n, c, len, tbuf);
    d -= const_amap<A>(tbuf, len) * g;
  } else if (pb.k.smoothing()) {
    if (pb.weights)
      d -= const_amap<A>(load_weights(pb.weights, c, len, tbuf), len) * (g * pb.k.smooth);
    else
      d -= g * pb.k.smooth;
  }
}

/// The target class of a class-id row, rewritten from a computation in A (class_target_gradient)
/// so that p_y - 1 is never formed in the output dtype.
template <class T, class Tgt, class G, class A>
void write_target_gradient(const problem<T, Tgt>& pb, std::int64_t y, A x_y, A lse, A mass, A g,
                           G* out) {
  out[y] = G(class_target_gradient(softcap_one(x_y, pb.k.softcap, pb.k.inv_softcap), pb.weight(y),
                                   gradient_alpha(mass, lse, pb.k), lse, g, pb.k));
}

/// Gradient of row n over classes [v0, v1), scaled by the row's upstream g:
///   g * (alpha * exp(z_j - lse) - w_j t'_j) * softcap'(x_j),
/// then the target class from write_target_gradient. `out` is the row of grad; it may be the row
/// of the logits (each chunk is read in full before it is written).
template <std::int64_t Cols = dynamic, class T, class Tgt, class G, class A>
void slice_gradient(const problem<T, Tgt>& pb, std::int64_t n, std::int64_t v0, std::int64_t v1,
                    A lse, A mass, A g, G* out) {
  alignas(64) A zbuf[policy::max_chunk];
  alignas(64) A gbuf[policy::max_chunk];
  alignas(64) A tbuf[policy::max_chunk];  // soft targets or class weights
  const T* x = pb.logits.row(n);
  const basic_loss_constants<A>& k = pb.k;
  const A ga = g * gradient_alpha(mass, lse, k);
  const std::int64_t y = pb.target(n);
  const bool has_target = y >= v0 && y < v1;
  const A x_y = has_target ? static_cast<A>(x[y]) : A(0);  // read before it is overwritten
  for_each_chunk<Cols>(v0, v1, pb.chunk, [&](std::int64_t c, std::int64_t len, std::int64_t) {
    const_amap<A> z(load_logits(x + c, len, k, zbuf), len);
    amap<A> d(gbuf, len);
    // Terms below the normal range (a masked class's -inf among them) are zeroed by packet_exp.
    // In a row of -inf alone the LSE is -inf too, every z - lse is NaN and stays so, as in
    // PyTorch's log_softmax. (Eigen 3.4's select() runs element by element: libm's expf.)
    packet_exp_sum(z.data(), len, lse, gbuf);  // the sum is not needed
    packet_scale(gbuf, len, ga);
    subtract_target_mass(pb, n, c, g, d, tbuf);
    if (k.softcap > A(0)) d *= A(1) - (z * k.inv_softcap).square();
    convert(gbuf, len, out + c);  // a conversion only: no peeled arithmetic
  });
  if (has_target) write_target_gradient(pb, y, x_y, lse, mass, g, out);
}

/// The same gradient over a whole row from the exponentials slice_stats cached in `out` (a row of
/// the accumulator type; no softcap): one multiply per element replaces the second exponential.
/// The row was written moments ago and is still in L2.
template <std::int64_t Cols = dynamic, class T, class Tgt, class A>
void cached_row_gradient(const problem<T, Tgt>& pb, std::int64_t n, A x_y, A lse, A mass, A g,
                         const exp_cache<A>& cache, A* out) {
  alignas(64) A gbuf[policy::max_chunk];
  alignas(64) A tbuf[policy::max_chunk];  // soft targets or class weights
  const A ga = g * gradient_alpha(mass, lse, pb.k);
  const std::int64_t cols = pb.logits.cols;
  const bool plain = !problem<T, Tgt>::soft && !pb.k.smoothing();
  for_each_chunk<Cols>(0, cols, pb.chunk, [&](std::int64_t c, auto len, std::int64_t i) {
    const A scale = ga * std::exp(cache.chunk_max[i] - lse);  // exp(z - m_c) exp(m_c - lse)
    if (plain) {
      packet_scale(out + c, len, scale);
      return;
    }
    amap<A> d(gbuf, len);
    d = tmap<A>(out + c, len);  // into the aligned buffer (L1/L2), computed there
    d *= scale;
    subtract_target_mass(pb, n, c, g, d, tbuf);
    tmap<A>(out + c, len) = d;
  });
  if constexpr (!problem<T, Tgt>::soft)
    write_target_gradient(pb, pb.target(n), x_y, lse, mass, g, out);
}

}  // namespace cpu_detail
}  // namespace xent
