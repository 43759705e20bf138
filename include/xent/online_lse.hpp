// THE core every path shares: a mergeable log-sum-exp state.
//
// A row's log-sum-exp, lse = log(sum_j exp(z_j)), is computed in pieces: vocabulary chunks on a
// CPU core, threads and blocks on a GPU, shards on NCCL ranks. Each piece keeps (max, sum) with
// sum = sum_j exp(z_j - max) over its elements; two pieces merge by rescaling both sums to the
// larger max. The result does not depend on how the row was cut, up to the rounding of the
// accumulator type A (float; double for the CPU backend's float64 logits, accumulator.hpp).
#pragma once

#include <cmath>
#include <limits>

#include "config.hpp"

namespace xent {

template <class A>
struct basic_online_lse {
  A max = -static_cast<A>(HUGE_VAL);
  A sum = A(0);

  /// The state of a block whose largest element is `block_max` and whose elements z_j give
  /// sum_exp = sum_j exp(z_j - block_max).
  XENT_HOST_DEVICE static basic_online_lse of_block(A block_max, A sum_exp) {
    basic_online_lse s;
    s.max = block_max;
    s.sum = sum_exp;
    return s;
  }

  /// Adds one element (scalar paths; vector paths form a block and merge it).
  XENT_HOST_DEVICE void add(A z) { merge(of_block(z, A(1))); }

  /// Combines another piece of the same row into this one. Equal maxima (including two -inf
  /// pieces) take no exponential, so an all -inf piece never produces inf - inf. A NaN anywhere
  /// in either piece's sum survives the merge.
  XENT_HOST_DEVICE void merge(const basic_online_lse& other) {
    if (max == -static_cast<A>(HUGE_VAL) && sum == A(0)) {  // empty: the other piece, no exp
      *this = other;
      return;
    }
    const A m = other.max > max ? other.max : max;
    sum = rescale(sum, max, m) + rescale(other.sum, other.max, m);
    max = m;
  }

  /// log(sum_j exp(z_j)); -inf for an empty or all -inf row.
  XENT_HOST_DEVICE A lse() const { return max + std::log(sum); }

  /// sum * exp(from - to), with from <= to.
  XENT_HOST_DEVICE static A rescale(A s, A from, A to) {
    return from == to ? s : s * std::exp(from - to);
  }
};

/// The state of float accumulation, which every dtype but double uses (and the CUDA backend).
using online_lse = basic_online_lse<float>;

}  // namespace xent
