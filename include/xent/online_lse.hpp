// THE core every path shares: a mergeable log-sum-exp state.
//
// A row's log-sum-exp, lse = log(sum_j exp(z_j)), is computed in pieces: vocabulary chunks on a
// CPU core, threads and blocks on a GPU, shards on NCCL ranks. Each piece keeps (max, sum) with
// sum = sum_j exp(z_j - max) over its elements; two pieces merge by rescaling both sums to the
// larger max. The result does not depend on how the row was cut, up to float rounding.
#pragma once

#include <cmath>
#include <limits>

#include "config.hpp"

namespace xent {

struct online_lse {
  float max = -HUGE_VALF;
  float sum = 0.0f;

  /// The state of a block whose largest element is `block_max` and whose elements z_j give
  /// sum_exp = sum_j exp(z_j - block_max).
  XENT_HOST_DEVICE static online_lse of_block(float block_max, float sum_exp) {
    online_lse s;
    s.max = block_max;
    s.sum = sum_exp;
    return s;
  }

  /// Adds one element (scalar paths; vector paths form a block and merge it).
  XENT_HOST_DEVICE void add(float z) { merge(of_block(z, 1.0f)); }

  /// Combines another piece of the same row into this one. Equal maxima (including two -inf
  /// pieces) take no exponential, so an all -inf piece never produces inf - inf. A NaN anywhere
  /// in either piece's sum survives the merge.
  XENT_HOST_DEVICE void merge(const online_lse& other) {
    if (max == -HUGE_VALF && sum == 0.0f) {  // empty: the other piece as it is, no exponential
      *this = other;
      return;
    }
    const float m = other.max > max ? other.max : max;
    sum = rescale(sum, max, m) + rescale(other.sum, other.max, m);
    max = m;
  }

  /// log(sum_j exp(z_j)); -inf for an empty or all -inf row.
  XENT_HOST_DEVICE float lse() const { return max + std::log(sum); }

  /// sum * exp(from - to), with from <= to.
  XENT_HOST_DEVICE static float rescale(float s, float from, float to) {
    return from == to ? s : s * std::exp(from - to);
  }
};

}  // namespace xent
