// A row's gradient from its chunk held in registers: the row's constants (row_gradient) and the
// sweep that writes each vector of a register tile once (tile_gradient). Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../loss_math.hpp"
#include "chunk_stats.cuh"
#include "dtype.cuh"
#include "row_args.cuh"
#include "tile.cuh"

namespace xent {
namespace cuda_detail {

/// Per-row constants of the gradient sweep.
struct row_gradient {
  float lse;    ///< log-sum-exp of the row
  float alpha;  ///< coefficient of p_j (gradient_alpha)
  float g;      ///< the row's upstream gradient
  float w_y;    ///< class ids: weight of the target
  std::int64_t y;
};

/// A vector stored by one instruction per 16 bytes that the compiler cannot split: with a lead
/// (tile_gradient), nvcc merged the vector and element-wise stores of the same values into
/// element-wise stores for every vector (SASS of the shifted small-batch kernel: no STG.E.128).
/// More than 16 bytes (a float gradient of a 16-bit tile) only in instantiations whose launch
/// the dispatcher never makes (shifted rows need the gradient's element size to be the logits').
template <class G, int Vec>
__device__ __forceinline__ void store_whole(G* p, const vec_t<G, Vec>& d) {
  static_assert(sizeof(d) % 16 == 0, "whole 16-byte vectors");
  unsigned w[sizeof(d) / 4];
  memcpy(w, &d, sizeof(w));
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(d) / 16); ++k)
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p + k * (16 / sizeof(G))),
                 "r"(w[4 * k]), "r"(w[4 * k + 1]), "r"(w[4 * k + 2]), "r"(w[4 * k + 3])
                 : "memory");
}

/// Gradient of row n's chunk held in `t`, stored to `out` (the row of grad) a vector at a time.
/// The thread whose vectors hold the target class of a class-id row reads z_y once more from the
/// logits (before its own store can overwrite it: only this thread writes that element), and after
/// its vectors rewrites the target's element with the gradient formed once, in float. Picking
/// z_y out of the registers instead unrolled that formula (an accurate expf) once per element of
/// the tile: 64 copies for a bf16 tile, a third of the fused kernel's code, which a short launch
/// runs once from a cold instruction cache (ncu, fp32 32 x 32000: instruction-fetch stalls were
/// the largest share). `Lead`: the tile starts `lead` elements before the row (global_tile's
/// lead), which thread 0's first vector does not store. `KnownTarget`: the caller has z_y
/// (`target_logit`; the small-batch kernel, from its merged partial), and the owner of the
/// target's element reads nothing: there the read was a dependent round trip to L2 at the end of
/// a short launch. A template argument: every other kernel's SASS stays byte for byte what it was
/// (cuobjdump), where a run-time flag in row_gradient rescheduled the row kernels.
template <bool Plain, bool Aligned, bool Lead = false, bool KnownTarget = false, class T,
          class Tile, class G, class Tgt>
__device__ __forceinline__ void tile_gradient(const row_args<T, G, Tgt>& a, const Tile& t,
                                              std::int64_t n, std::int64_t base,
                                              const row_gradient& rg, G* out, int lead = 0,
                                              float target_logit = 0.0f) {
  constexpr int vec = Tile::vec, Regs = Tile::regs, Block = Tile::block;
  const float ga = rg.g * rg.alpha;
  // Folded scale (plain kernels, 16-bit gradients): |ga| p_j = 2^(z_j log2e - lse log2e +
  // log2 |ga|), the sign put back on the rounded pairs by one xor per two elements: one multiply
  // per element fewer (see policy::fold_scale). |ga| = 0 gives a shift of +inf and zeros; a NaN
  // stays a NaN.
  constexpr bool fold = policy::fold_scale && Plain && sizeof(G) == 2 && !Tile::holds_exps;
  // A tile of kept exponentials (exp_tile): each element's scale, once per row.
  float kept = 0.0f;
  if constexpr (Tile::holds_exps) kept = ga * fast_exp2((t.max - rg.lse) * log2e);
  const float shift = fold ? rg.lse * log2e - log2f(fabsf(ga)) : rg.lse * log2e;
  const unsigned sign = fold && signbit(ga) ? 0x80008000u : 0u;
  const bool plain = Plain || (!Tgt::soft && a.k.smooth == 0.0f && a.k.softcap == 0.0f);
  // Whether the target is in this thread's vectors; if so, its raw logit, read before any store.
  bool own = false;
  T x_y{};
  float z_known = 0.0f;
  if constexpr (!Tgt::soft) {
    const std::int64_t yo = rg.y - base;
    own = yo >= 0 && yo < t.count && static_cast<int>(yo / vec) % Block == Tile::thread();
    if constexpr (KnownTarget) {
      if (own) z_known = target_logit;
    } else if (own) {
      x_y = a.logits[n * a.ld + rg.y];
    }
  }
  out += base;
#pragma unroll
  for (int r = 0; r < Regs; ++r) {
    if (!t.has(r)) continue;
    // A lead's elements lie before the row: never stored, and their columns index no class.
    const int skip = Lead && r == 0 && Tile::thread() == 0 ? lead : 0;
    float f[vec];
#pragma unroll
    for (int e = 0; e < vec; ++e) {
      if constexpr (Tile::holds_exps) {  // p_j = e_j 2^((m - lse) log2e): a multiply
        f[e] = t.e[r][e] * kept;
      } else {
        const float z = capped<Plain>(t.value(r, e), a.k);
        f[e] = fold ? fast_exp2(fmaf(z, log2e, -shift)) : ga * fast_exp2(fmaf(z, log2e, -shift));
        if (!plain && e < t.valid(r) && (!Lead || e >= skip)) {
          f[e] -= rg.g * target_mass(a, n, base + t.offset(r) + e);
          if (a.k.softcap > 0.0f) f[e] *= softcap_slope(z, a.k);
        }
      }
    }
    vec_t<G, vec> d = round_vector<G, vec>(f);
    if constexpr (fold) {
      static_assert(sizeof(d) % 4 == 0, "pairs of 16-bit elements");
      unsigned w[sizeof(d) / 4];
      memcpy(w, &d, sizeof(d));
#pragma unroll
      for (unsigned& x : w) x ^= sign;
      memcpy(&d, w, sizeof(d));
    }
    if (Aligned && t.valid(r) == vec && (!Lead || skip == 0)) {
      if (!Tile::whole || t.stored(r)) {
        if constexpr (Lead)
          store_whole(out + t.offset(r), d);
        else
          store_vector<G, vec>(out + t.offset(r), d);
      }
    } else {  // a row's partial first or last vector, or a row not 16-byte aligned: element by
      // element (unrolled: a loop indexing d at run time would put d in local memory for every
      // vector)
#pragma unroll
      for (int e = 0; e < vec; ++e)
        if (e < t.valid(r) && (!Lead || e >= skip)) out[t.offset(r) + e] = d.v[e];
    }
  }
  if constexpr (!Tgt::soft) {
    if (own) {  // after this thread's vector store of the same element: program order keeps this
      float z;
      if constexpr (KnownTarget)
        z = capped<Plain>(z_known, a.k);
      else
        z = capped<Plain>(x_y, a.k);
      out[rg.y - base] =
          from_float<G>(class_target_gradient(z, rg.w_y, rg.alpha, rg.lse, rg.g, a.k));
    }
  }
}

/// The per-launch constants of a backward from saved LSE, as the row kernel forms them (every
/// CTA: one launch per call): sum_c w_c into `a.k` where smoothing needs it, and the scalar
/// upstream gradient (scale * *scale_ptr / W for mean and sum). Every CTA walks the targets from
/// the first: walking from its own place (mean_normalizer's Spread) saved 2-3 us at 8192 x 32000
/// but cost the bulk backward of bf16 16384 x 128256 about 200 us (H200).
template <int Block, class T, class G, class Tgt>
__device__ double backward_constants(row_args<T, G, Tgt>& a) {
  if (a.weights && a.k.smooth != 0.0f)
    a.k.weight_sum = static_cast<float>(class_weight_sum<Block>(full_weights(a), a.vocab));
  const double normalizer =
      a.reduce == reduction::mean
          ? mean_normalizer<Block>(a.targets, a.rows, a.vocab, a.ignore_index, full_weights(a))
          : 1.0;
  return a.reduce != reduction::none ? scalar_upstream(a.scale, a.scale_ptr, a.reduce, normalizer)
                                     : 0.0;
}

/// Row n's gradient constants from its target y (in range) and saved LSE.
template <class T, class G, class Tgt>
__device__ __forceinline__ row_gradient backward_row(const row_args<T, G, Tgt>& a, std::int64_t n,
                                                     std::int64_t y, float lse, double scalar) {
  row_gradient rg;
  rg.y = y - a.first;  // the target's column in this shard
  rg.w_y = a.weights ? full_weights(a)[y] : 1.0f;
  rg.lse = lse;
  rg.g = row_scale(a, n, scalar);
  rg.alpha = gradient_alpha(class_target_mass(rg.w_y, a.k), rg.lse, a.k);
  return rg;
}

}  // namespace cuda_detail
}  // namespace xent
