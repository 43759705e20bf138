// A row's statistics from its chunk staged in shared memory: the exponential on the
// special-function unit, a register tile's sum of exponentials, a chunk's packed max, and the
// sweeps that fold a chunk into a thread's partial (max, sum, side sums, argmax), with or without
// keeping the exponentials for the gradient. Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../loss_math.hpp"
#include "../../online_lse.hpp"
#include "../tuning/policy.cuh"
#include "dtype.cuh"
#include "row_args.cuh"
#include "tile.cuh"

namespace xent {
namespace cuda_detail {

constexpr float log2e = 1.4426950408889634f;

/// 2^x on the special-function unit: one MUFU.EX2, ~2 ulp; 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// The sum of 2^(x log2e - shift) over this thread's elements of a register tile (`Full`: every
/// vector of it whole, no masks; `WholeVectors`: each vector whole or absent, one test per
/// vector), in two chains of additions. With `keep` (an exp_tile of the same shape), each
/// exponential is also left there, 0 outside the tile, for a gradient that multiplies instead.
template <bool Full, class Tile, bool WholeVectors = false, class Keep = std::nullptr_t>
__device__ __forceinline__ float tile_exp_sum(const Tile& t, float shift, Keep keep = nullptr) {
  constexpr bool keeps = !std::is_same_v<Keep, std::nullptr_t>;
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int r = 0; r < Tile::regs; ++r)
#pragma unroll
    for (int e = 0; e < Tile::vec; ++e) {
      if constexpr (keeps) keep->e[r][e] = 0.0f;
      if (Full || (t.has(r) && (WholeVectors || e < t.valid(r)))) {
        const float p = fast_exp2(fmaf(t.value(r, e), log2e, -shift));
        if constexpr (keeps) keep->e[r][e] = p;
        if (e % 2)
          s1 += p;
        else
          s0 += p;
      }
    }
  return s0 + s1;
}

/// This thread's largest raw value of a chunk staged in shared memory (plain kernels: no softcap),
/// in T's packed form, the tail masked to -inf. `Whole`: every vector of the tile is read, with no
/// test or mask (the stage holds -inf past the chunk: whole_extent).
template <int Regs, int Block, bool Whole = false, class T>
__device__ __forceinline__ float packed_max(const T* chunk, int count) {
  using shape = tile_shape<T, Regs, Block>;
  vec_t<T, 2> acc2[2];
  acc2[0].v[0] = acc2[0].v[1] = acc2[1].v[0] = acc2[1].v[1] = negative_infinity<T>();
  static_assert(Whole || Regs % 2 == 0, "vectors are taken in pairs");
  if constexpr (Whole) {
#pragma unroll
    for (int r = 0; r < Regs; ++r)
      fold_max(shape::template fetch<false>(chunk, count, r), acc2[r % 2]);
  } else {
#pragma unroll 1
    for (int r = 0; r < Regs; r += 2) {  // two accumulators halve the dependent chain
      if (shape::has(r, count)) fold_max(shape::template fetch<true>(chunk, count, r), acc2[0]);
      if (shape::has(r + 1, count))
        fold_max(shape::template fetch<true>(chunk, count, r + 1), acc2[1]);
    }
  }
  fold_max(acc2[1], acc2[0]);
  const float x0 = to_float(acc2[0].v[0]), x1 = to_float(acc2[0].v[1]);
  return x0 > x1 ? x0 : x1;
}

/// Statistics of row n's chunk of `count` elements staged at `chunk` (classes from `base`),
/// folded into this thread's partial. The sweeps read shared memory, so a chunk's statistics
/// can be taken while the registers still hold the previous row for its gradient. The max is the
/// warp's, so all lanes of a warp share it and their sums merge by plain addition; the
/// exponentials are taken relative to it, one per element. The side sums (soft targets, label
/// smoothing) and the argmax each take a sweep of their own, only when asked for.
template <bool Plain, int Regs, int Block, bool Whole = false, class T, class G, class Tgt,
          class Part>
__device__ __forceinline__ void chunk_stats(const row_args<T, G, Tgt>& a, const T* chunk, int count,
                                            std::int64_t n, std::int64_t base, Part& acc) {
  static_assert(Plain || !Whole, "whole tiles: plain rows (whole_extent)");
  using shape = tile_shape<T, Regs, Block>;
  constexpr int vec = shape::vec;
  // The chunk's sum of exponentials relative to `shift` (log2 units), two chains of additions.
  auto exp_sum = [&](float shift) {
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll(policy::stats_unroll)
    for (int r = 0; r < Regs; ++r) {
      if (!Whole && !shape::has(r, count)) continue;
      constexpr bool mask = Plain && !Whole;  // whole tiles: -inf past the chunk already
      const vec_t<T, vec> v = shape::template fetch<mask>(chunk, count, r);
#pragma unroll
      for (int e = 0; e < vec; ++e) {
        if (Plain || e < shape::valid(r, count)) {
          const float p = fast_exp2(fmaf(capped<Plain>(v.v[e], a.k), log2e, -shift));
          if (e % 2)
            s1 += p;
          else
            s0 += p;
        }
      }
    }
    return s0 + s1;
  };
  if constexpr (Plain && policy::running_max) {
    // A chunk after its row's first (a streamed row): one sweep, relative to the row's running
    // max, which the first chunk set (lanes share it). Elements above that max give
    // exponentials above 1, harmless unless one or the sum overflows; then (or on a NaN) the
    // warp takes the max-first sweeps below. The max sweep skipped is an eighth of the
    // instructions of a bf16 chunk's statistics.
    const float running = stats_of(acc).lse.max;
    if (running != -HUGE_VALF) {
      const float s = exp_sum(running * log2e);
      if (!__any_sync(0xffffffffu, !isfinite(s))) {
        stats_of(acc).lse.merge(online_lse::of_block(running, s));  // equal maxima: sum + s
        return;
      }
    }
  }
  float m;
  if constexpr (Plain) {
    m = packed_max<Regs, Block, Whole>(chunk, count);
  } else {
    m = -HUGE_VALF;
#pragma unroll(policy::stats_unroll)
    for (int r = 0; r < Regs; ++r) {
      if (!shape::has(r, count)) continue;
      const vec_t<T, vec> v = shape::template fetch<false>(chunk, count, r);
#pragma unroll
      for (int e = 0; e < vec; ++e)  // fmaxf passes over NaN; the sum below still meets it
        if (e < shape::valid(r, count)) m = fmaxf(m, capped(v.v[e], a.k));
    }
  }
  m = warp_max(m);
  stats_of(acc).lse.merge(online_lse::of_block(m, exp_sum(m == -HUGE_VALF ? 0.0f : m * log2e)));
  if constexpr (!Plain) {
    if (Tgt::soft || a.k.smooth != 0.0f) {
      float dot = 0.0f, mass = 0.0f;
#pragma unroll(policy::stats_unroll)
      for (int r = 0; r < Regs; ++r) {
        if (!shape::has(r, count)) continue;
        const vec_t<T, vec> v = shape::template fetch<false>(chunk, count, r);
#pragma unroll
        for (int e = 0; e < vec; ++e) {
          if (e >= shape::valid(r, count)) continue;
          const std::int64_t c = base + shape::offset(r) + e;
          const float z = capped(v.v[e], a.k);
          if constexpr (Tgt::soft) {
            const float wt = target_mass(a, n, c);
            mass += wt;
            dot += wt * z;
          } else {
            dot += (a.weights ? a.weights[c] : 1.0f) * z;
          }
        }
      }
      acc.stats.dot += dot;
      acc.stats.mass += mass;
    }
    if (a.want_argmax) {
      argmax_state best;
#pragma unroll(policy::stats_unroll)
      for (int r = 0; r < Regs; ++r) {  // offsets only grow: strict > keeps the first maximum
        if (!shape::has(r, count)) continue;
        const vec_t<T, vec> v = shape::template fetch<false>(chunk, count, r);
#pragma unroll
        for (int e = 0; e < vec; ++e) {
          const float z = capped(v.v[e], a.k);
          if (e < shape::valid(r, count) &&
              (best.index < 0 || argmax_state::greater(z, best.value))) {
            best.value = z;
            best.index = base + shape::offset(r) + e;
          }
        }
      }
      acc.argmax.merge(best);
    }
  }
}

/// Statistics of a resident chunk for a plain fused pass that keeps each element's exponential
/// for the gradient (policy::exp_once): the max sweep, then one sweep that sums the exponentials
/// relative to the warp's max and leaves them in `t` as floats, so the gradient multiplies
/// instead of exponentiating again.
template <int Regs, int Block, bool Whole, class T, class Part>
__device__ __forceinline__ void chunk_stats_keeping_exps(const T* chunk, int count, Part& acc,
                                                         exp_tile<T, Regs, Block, Whole>& t) {
  using shape = tile_shape<T, Regs, Block>;
  constexpr int vec = shape::vec;
  const float m = warp_max(packed_max<Regs, Block, Whole>(chunk, count));
  const float shift = m == -HUGE_VALF ? 0.0f : m * log2e;
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int r = 0; r < Regs; ++r) {
    if (!Whole && !shape::has(r, count)) continue;
    // The vector as four words, each element widened by one shift or mask (word_element), where
    // an element-wise vector took an extract and a shift each.
    const vec_t<T, vec> v = shape::template fetch<!Whole>(chunk, count, r);
    unsigned w[4];
    memcpy(w, &v, sizeof(w));
#pragma unroll
    for (int e = 0; e < vec; ++e) {
      const float p = fast_exp2(fmaf(word_element<T>(w, e), log2e, -shift));
      t.e[r][e] = p;
      if (e % 2)
        s1 += p;
      else
        s0 += p;
    }
  }
  t.count = count;
  t.max = m;
  stats_of(acc).lse.merge(online_lse::of_block(m, s0 + s1));
}

}  // namespace cuda_detail
}  // namespace xent
