// The CPU backend's innermost loops, on Eigen's packet primitives (SSE / AVX2 / AVX-512, whatever
// the build targets): the max, the exponential sum and the scaling of a chunk, reading and writing
// the caller's memory directly.
//
// Each loop runs whole packets from the start of the chunk with unaligned loads and stores, and
// the remainder in scalar code, so which elements take which path depends on their position in the
// chunk, never on the buffer's address: results are the same wherever the caller's arrays sit
// (Eigen's own assignment loops peel an unaligned head into scalar code, which is address-bound).
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <limits>

namespace xent {
namespace cpu_detail {

using packet = Eigen::internal::packet_traits<float>::type;
constexpr std::int64_t lanes = Eigen::internal::packet_traits<float>::size;

/// max_j z_j over n elements; NaN need not win here (the exponential sum carries it).
inline float packet_max(const float* z, std::int64_t n) {
  using namespace Eigen::internal;
  const std::int64_t whole = n - n % lanes;
  packet m = pset1<packet>(-std::numeric_limits<float>::infinity());
  for (std::int64_t i = 0; i < whole; i += lanes) m = pmax(m, ploadu<packet>(z + i));
  float r = predux_max(m);
  for (std::int64_t i = whole; i < n; ++i) r = z[i] > r ? z[i] : r;
  return r;
}

/// sum_j exp(z_j - m) over n elements, also storing each exp(z_j - m) to `out` when it is given
/// (`out` may be `z` itself: each packet is loaded before it is stored).
inline float packet_exp_sum(const float* z, std::int64_t n, float m, float* out) {
  using namespace Eigen::internal;
  const std::int64_t whole = n - n % lanes;
  const packet shift = pset1<packet>(m);
  // Two accumulators halve the dependency chain of the additions.
  packet s0 = pzero(shift), s1 = pzero(shift);
  std::int64_t i = 0;
  for (; i + 2 * lanes <= whole; i += 2 * lanes) {
    const packet e0 = pexp(psub(ploadu<packet>(z + i), shift));
    const packet e1 = pexp(psub(ploadu<packet>(z + i + lanes), shift));
    if (out) {
      pstoreu(out + i, e0);
      pstoreu(out + i + lanes, e1);
    }
    s0 = padd(s0, e0);
    s1 = padd(s1, e1);
  }
  for (; i < whole; i += lanes) {
    const packet e = pexp(psub(ploadu<packet>(z + i), shift));
    if (out) pstoreu(out + i, e);
    s0 = padd(s0, e);
  }
  float s = predux(padd(s0, s1));
  for (; i < n; ++i) {
    const float e = std::exp(z[i] - m);
    if (out) out[i] = e;
    s += e;
  }
  return s;
}

/// d_j *= scale over n elements, in place.
inline void packet_scale(float* d, std::int64_t n, float scale) {
  using namespace Eigen::internal;
  const std::int64_t whole = n - n % lanes;
  const packet k = pset1<packet>(scale);
  for (std::int64_t i = 0; i < whole; i += lanes) pstoreu(d + i, pmul(ploadu<packet>(d + i), k));
  for (std::int64_t i = whole; i < n; ++i) d[i] *= scale;
}

}  // namespace cpu_detail
}  // namespace xent
