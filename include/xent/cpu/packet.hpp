// The CPU backend's innermost loops, on Eigen's packet primitives (SSE / AVX2 / AVX-512, whatever
// the build targets): the max, the exponential sum and the scaling of a chunk, reading and writing
// the caller's memory directly. Each is a template on the accumulator A (float, or double for
// double logits), whose Eigen packet it uses.
//
// Each loop runs whole packets from the start of the chunk with unaligned loads and stores, and
// the remainder in scalar code, so which elements take which path depends on their position in the
// chunk, never on the buffer's address: results are the same wherever the caller's arrays sit
// (Eigen's own assignment loops peel an unaligned head into scalar code, which is address-bound).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace xent {
namespace cpu_detail {

template <class A>
using packet_of = typename Eigen::internal::packet_traits<A>::type;
template <class A>
constexpr std::int64_t lanes_of = Eigen::internal::packet_traits<A>::size;

/// Below this argument exp(x) is not a normal number of A (log of its smallest normal).
template <class A>
constexpr A exp_underflow = std::is_same<A, double>::value ? A(-708.39641853226408)
                                                           : A(-87.3365447505531);

/// exp(x) for a packet, 0 where the result would not be a normal number (x below
/// exp_underflow<A>, -inf included; NaN stays NaN). Eigen 3.4 clamps the argument of its
/// exponentials (to about -88.4 for float, -709.4 for double), so without this exp(-inf) is
/// 2.9e-39 in float (SSE and AVX2 builds on a Zen 3 host; the tests saw 0 on an AVX-512 one) and
/// 5.6e-309 in double: a masked class would get a gradient where PyTorch's is 0, and results
/// would depend on the machine.
template <class A>
packet_of<A> packet_exp(const packet_of<A>& x) {
  using namespace Eigen::internal;
  return pandnot(pexp(x), pcmp_lt(x, pset1<packet_of<A>>(exp_underflow<A>)));
}

// n is a std::int64_t, or a std::integral_constant where the chunk's length is known at compile
// time (cpu/row_pass.hpp's for_each_chunk): the remainder loops then vanish or become constant.

/// max_j z_j over n elements; NaN need not win here (the exponential sum carries it).
template <class A, class N>
A packet_max(const A* z, N n) {
  using namespace Eigen::internal;
  using packet = packet_of<A>;
  constexpr std::int64_t lanes = lanes_of<A>;
  const std::int64_t whole = n - n % lanes;
  packet m = pset1<packet>(-std::numeric_limits<A>::infinity());
  for (std::int64_t i = 0; i < whole; i += lanes) m = pmax(m, ploadu<packet>(z + i));
  A r = predux_max(m);
  for (std::int64_t i = whole; i < n; ++i) r = z[i] > r ? z[i] : r;
  return r;
}

/// sum_j exp(z_j - m) over n elements, also storing each exp(z_j - m) to `out` when it is given
/// (`out` may be `z` itself: each packet is loaded before it is stored).
template <class A, class N>
A packet_exp_sum(const A* z, N n, A m, A* out) {
  using namespace Eigen::internal;
  using packet = packet_of<A>;
  constexpr std::int64_t lanes = lanes_of<A>;
  const std::int64_t whole = n - n % lanes;
  const packet shift = pset1<packet>(m);
  // Two accumulators halve the dependency chain of the additions.
  packet s0 = pzero(shift), s1 = pzero(shift);
  std::int64_t i = 0;
  for (; i + 2 * lanes <= whole; i += 2 * lanes) {
    const packet e0 = packet_exp<A>(psub(ploadu<packet>(z + i), shift));
    const packet e1 = packet_exp<A>(psub(ploadu<packet>(z + i + lanes), shift));
    if (out) {
      pstoreu(out + i, e0);
      pstoreu(out + i + lanes, e1);
    }
    s0 = padd(s0, e0);
    s1 = padd(s1, e1);
  }
  for (; i < whole; i += lanes) {
    const packet e = packet_exp<A>(psub(ploadu<packet>(z + i), shift));
    if (out) pstoreu(out + i, e);
    s0 = padd(s0, e);
  }
  A s = predux(padd(s0, s1));
  for (; i < n; ++i) {  // as packet_exp: 0 below the normal range
    const A x = z[i] - m;
    const A e = x < exp_underflow<A> ? A(0) : std::exp(x);
    if (out) out[i] = e;
    s += e;
  }
  return s;
}

/// tanh of a packet by Eigen's ptanh, except for float arguments past 7.5 in magnitude: there
/// Eigen 3.4's float fit is clamped (one value for every |x| >= 7.9053) where float's tanh still
/// tells arguments apart up to about 9, so soft-capped logits in that band tied and argmax took
/// the first of them (logits 40 and 44 under a cap of 5). Past 7.5, tanh |x| = 1 - 2 e^(-2|x|)
/// to within 2 e^(-4|x|) < 2e-13, far below float's resolution.
template <class A>
packet_of<A> packet_tanh(const packet_of<A>& x) {
  using namespace Eigen::internal;
  using packet = packet_of<A>;
  if constexpr (std::is_same<A, float>::value) {
    const packet a = pabs(x);
    const packet near_one =
        psub(pset1<packet>(1.0f), pmul(pset1<packet>(2.0f), pexp(pmul(pset1<packet>(-2.0f), a))));
    const packet tail = pselect(pcmp_lt(x, pzero(x)), pnegate(near_one), near_one);
    return pselect(pcmp_lt(pset1<packet>(7.5f), a), tail, ptanh(x));
  } else {
    return ptanh(x);
  }
}

/// softcap * tanh(z_j / softcap) over n elements, in place, every element by the same tanh:
/// packet_tanh where A has a packet tanh (a float's: Eigen's rational fit, 1 - 2 e^(-2|x|) past
/// 7.5), its remainder through one zero-padded packet. Eigen's own loops take std::tanh for a
/// remainder, which differs from the packet form by up to about 3e-7 relative near saturation: a
/// row's target logit capped alone could then exceed the LSE of its capped row, a negative loss.
template <class A>
void packet_softcap(A* z, std::int64_t n, A softcap, A inv_softcap) {
  using namespace Eigen::internal;
  if constexpr (packet_traits<A>::HasTanh) {
    using packet = packet_of<A>;
    constexpr std::int64_t lanes = lanes_of<A>;
    const std::int64_t whole = n - n % lanes;
    const packet cap = pset1<packet>(softcap), inv = pset1<packet>(inv_softcap);
    for (std::int64_t i = 0; i < whole; i += lanes)
      pstoreu(z + i, pmul(packet_tanh<A>(pmul(ploadu<packet>(z + i), inv)), cap));
    if (whole < n) {
      alignas(64) A tail[lanes] = {};
      std::copy(z + whole, z + n, tail);
      pstoreu(tail, pmul(packet_tanh<A>(pmul(ploadu<packet>(tail), inv)), cap));
      std::copy(tail, tail + (n - whole), z + whole);
    }
  } else {
    for (std::int64_t i = 0; i < n; ++i) z[i] = softcap * std::tanh(z[i] * inv_softcap);
  }
}

/// One logit soft-capped as packet_softcap caps a row's (the target's, beside its row's LSE).
template <class A>
A softcap_one(A x, A softcap, A inv_softcap) {
  if (!(softcap > A(0))) return x;
  packet_softcap(&x, 1, softcap, inv_softcap);
  return x;
}

/// d_j *= scale over n elements, in place.
template <class A, class N>
void packet_scale(A* d, N n, A scale) {
  using namespace Eigen::internal;
  using packet = packet_of<A>;
  constexpr std::int64_t lanes = lanes_of<A>;
  const std::int64_t whole = n - n % lanes;
  const packet k = pset1<packet>(scale);
  for (std::int64_t i = 0; i < whole; i += lanes) pstoreu(d + i, pmul(ploadu<packet>(d + i), k));
  for (std::int64_t i = whole; i < n; ++i) d[i] *= scale;
}

}  // namespace cpu_detail
}  // namespace xent
