// Fused linear training without a cross-entropy pass (Hopper, bf16): each chunk's logits GEMM
// (stats_gemm.cuh, form::probs) stores P = exp(z - ref) instead of z, with ref a reference per row
// known before the GEMM (the target's logit), and keeps each row's statistics as the forward's
// does. Since a class-id row's logit gradient is
//     G = g (alpha softmax - w_y onehot(y)) = beta P',   beta = g alpha exp(ref - lse),
// with P' = P except at the target, P'_y = P_y - w_y exp(lse - ref) / alpha, the backward GEMMs
// take P' as it is and the row's scale beta aside: d_hidden = diag(beta) (P' W) (the float product
// rounded with its row's scale) and d_weight += P'^T (diag(beta) X_c) (a chunk-sized copy of the
// hidden rows, scaled). No pass reads and writes the N_c x V logits between the GEMMs: that pass
// was about 4 of 92 ms at 16384 x 2304 x 256000 on an H100.
//
// Per chunk, on the call's stream:
//   1. reference_kernel: ref = the target's logit, +inf for a row that is ignored or out of range
//      (its P row is then 0);
//   2. the GEMM (form::probs): P, the row partials and the target logits. It stages each logit as
//      the fp16 difference z - ref rather than bf16 z, so P carries |z - ref| 2^-11 of rounding
//      where torch's bf16 logits carry |z| 2^-8 (unit roundoffs); the partials come from the same
//      differences, so each row's P and LSE agree;
//   3. merge_kernel: each row's LSE, loss and outputs (as the forward's merge), beta, the target
//      element's patch and the scaled hidden row. A row whose P cannot be trusted in float range
//      (lse - ref above `range`: P up to e^range, beta down to e^-range; a z-loss alpha below half
//      the class weight; a difference past fp16's range; a NaN) is flagged for the second pass
//      instead, with beta = g;
//   4. for the flagged rows' row tiles only (nothing at all when none is: the count is read on the
//      device, no host synchronisation): the GEMM's statistics form (partials from bf16 logits),
//      second_merge_kernel (the flagged rows' outputs, ref = their LSE, multiplier alpha), then
//      the GEMM's probs form again with the flagged rows staged as bf16 logits, storing P' =
//      alpha softmax over the logits their LSE came from (the other rows of those tiles store
//      the bits they stored in step 2);
//   5. patch_kernel: each row's target element P'_y.
// Rows that lose more than `range` nats are rare in training (a probability of e^-40 for the
// target), so step 4 is normally empty; at worst it is two more logits GEMMs.
//
// Included only by nvcc; dispatch/scaled_probs.cuh lays out its buffers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../loss_math.hpp"
#include "../block/row_args.cuh"
#include "../block/row_reduce.cuh"
#include "../block/row_sums.cuh"
#include "../block/tile_gradient.cuh"
#include "../cuda.cuh"
#include "stats_gemm_kernel.cuh"  // the GEMM's partial and tile sizes

namespace xent {
namespace cuda_detail {
namespace scaled_probs {

/// The largest lse - ref for which a row keeps the first pass's P: P_j <= e^40 ~ 2e17 and beta >=
/// g alpha e^-40 ~ 4e-18 g alpha, so P, beta and the scaled hidden row beta x stay normal floats
/// and bf16 for any plausible upstream gradient and hidden values.
constexpr float range = 40.0f;

/// A chunk's buffers (dispatch/linear_plan.cuh's probs_layout), each per row of the chunk.
struct buffers {
  stats_gemm::partial* partials;  ///< rows x col_tiles
  __nv_bfloat16* hidden;          ///< rows x D: beta x, the d_weight GEMM's operand
  float* ref;
  float* mult;
  float* beta;
  float* patch;
  float* target_logit;
  int* tile_flags;  ///< one per 128-row tile holding a second-pass row, then their count
  int* second;      ///< per row: 1 for a row the second pass takes, else 0
  int row_tiles;

  __host__ __device__ int* flagged() const { return tile_flags + row_tiles; }
};

/// The 8 bf16 of a 16-byte vector as floats.
__device__ __forceinline__ void unpack8(const uint4& q, float (&v)[8]) {
  const unsigned u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = word_element<__nv_bfloat16>(u, e);
}

/// One warp per row: ref = x. w_y (the target's logit, up to the order of the sums), or +inf for a
/// row that is ignored or whose class id is outside [0, vocab). D is a multiple of 8 and the rows
/// are 16-byte aligned (the Hopper path's conditions).
template <class I>
XENT_KERNEL void reference_kernel(const __nv_bfloat16* x, std::int64_t ldx, const __nv_bfloat16* w,
                                  std::int64_t ldw, int depth, const I* targets, int rows,
                                  std::int64_t vocab, std::int64_t ignore_index, float* ref) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t row = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (row >= rows) return;
  const auto y = static_cast<std::int64_t>(targets[row]);
  if (skipped_class(y, ignore_index, vocab)) {
    if (lane == 0) ref[row] = HUGE_VALF;
    return;
  }
  const __nv_bfloat16* xr = x + row * ldx;
  const __nv_bfloat16* wr = w + y * ldw;
  float s = 0.0f;
  for (int k = 8 * lane; k < depth; k += 256) {
    float a[8], b[8];
    unpack8(*reinterpret_cast<const uint4*>(xr + k), a);
    unpack8(*reinterpret_cast<const uint4*>(wr + k), b);
#pragma unroll
    for (int e = 0; e < 8; ++e) s = fmaf(a[e], b[e], s);
  }
  s = warp_sum(s);
  if (lane == 0) ref[row] = s;
}

/// Every lane of a warp on row `row`: the row's statistics merged from its partials, and whether
/// one of them is the first pass's mark of a row whose fp16 differences overflowed
/// (stats_gemm::staged_row).
__device__ __forceinline__ row_partial merged_row(const buffers& b, std::int64_t row, int col_tiles,
                                                  int lane, bool& saturated) {
  online_lse acc;
  bool sat = false;
  for (int i = lane; i < col_tiles; i += 32) {
    const stats_gemm::partial p = b.partials[row * col_tiles + i];
    sat |= p.max == HUGE_VALF;
    acc.merge(p);
  }
  saturated = __any_sync(0xffffffffu, sat);
  row_partial r;
  r.lse = acc;
  r = warp_merge<32>(r);  // every lane has the row's state
  r.target_logit = b.target_logit[row];
  return r;
}

/// One warp per row of the chunk, after the first pass: the row's LSE from its partials, its loss
/// and outputs by the core's pieces (class_row_loss, write_row_outputs, write_skipped_row: no
/// smoothing or softcap on this path), then beta, the target's patch and the scaled hidden row;
/// or the row left to the second pass (see the file's comment), its outputs to second_merge_kernel
/// (its beta is g). `a` holds the chunk's rows (targets, outputs and upstream offset to them) as
/// reduction none; `x` the chunk's hidden rows.
template <class T, class G, class Tgt>
XENT_KERNEL void merge_kernel(row_args<T, G, Tgt> a, buffers b, int col_tiles,
                              const __nv_bfloat16* x, std::int64_t ldx, int depth) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t row = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (row >= a.rows) return;
  const auto y = static_cast<std::int64_t>(a.targets.ids[row]);
  float beta = 0.0f;
  bool second = false;
  if (skipped_target(a, y)) {
    if (lane == 0) {
      write_skipped_row(a, row, y != a.ignore_index, true, false);
      b.mult[row] = 1.0f;
    }
  } else {
    bool saturated = false;
    const row_partial r = merged_row(b, row, col_tiles, lane, saturated);
    const row_gradient t = backward_row(a, row, y, r.lse.lse(), 0.0);
    const float ref = b.ref[row];
    // Written so that a NaN anywhere takes the second pass (which then gives what the
    // cross-entropy pass would: NaN where the statistics are).
    second = !(!saturated && t.lse - ref <= range && (t.w_y == 0.0f || t.alpha / t.w_y >= 0.5f));
    if (!second) {
      beta = t.g * t.alpha * expf(ref - t.lse);
      const float onehot = t.w_y == 0.0f ? 0.0f : t.w_y * expf(t.lse - ref) / t.alpha;
      if (lane == 0) {
        b.patch[row] = expf(r.target_logit - ref) - onehot;
        b.mult[row] = 1.0f;
        write_row_outputs(a, row, class_row_loss(r, t.w_y, a.k), t.lse, -1, false, false);
      }
    } else {
      beta = t.g;
      if (lane == 0) {
        b.tile_flags[row / stats_gemm::tile_m] = 1;
        atomicAdd(b.flagged(), 1);
      }
    }
  }
  if (lane == 0) {
    b.beta[row] = beta;
    b.second[row] = second ? 1 : 0;
  }
  // The scaled hidden row (zeros for a skipped row: its G row is 0).
  const __nv_bfloat16* xr = x + row * ldx;
  __nv_bfloat16* hr = b.hidden + row * depth;
  for (int k = 8 * lane; k < depth; k += 256) {
    float v[8];
    unpack8(*reinterpret_cast<const uint4*>(xr + k), v);
    unsigned o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const __nv_bfloat162 p = __floats2bfloat162_rn(beta * v[2 * e], beta * v[2 * e + 1]);
      o[e] = *reinterpret_cast<const unsigned*>(&p);
    }
    *reinterpret_cast<uint4*>(hr + k) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

/// One warp per row of the chunk, after the statistics form rewrote the partials of the second
/// pass's row tiles from bf16 logits: each second-pass row's loss and outputs from those, its
/// target's patch, and the second pass's reference (its LSE; NaN for an infinite one, so that the
/// row's gradient is NaN) and multiplier alpha, so that the pass stores P' = alpha softmax over
/// the same bf16 logits as the LSE's. Other rows (and every row when none is flagged) leave at
/// once.
template <class T, class G, class Tgt>
XENT_KERNEL void second_merge_kernel(row_args<T, G, Tgt> a, buffers b, int col_tiles) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t row = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (*b.flagged() == 0 || row >= a.rows || b.second[row] == 0) return;
  const auto y = static_cast<std::int64_t>(a.targets.ids[row]);
  bool saturated = false;  // no marks in the statistics form's partials
  const row_partial r = merged_row(b, row, col_tiles, lane, saturated);
  const row_gradient t = backward_row(a, row, y, r.lse.lse(), 0.0);
  if (lane == 0) {
    b.patch[row] = t.alpha * expf(r.target_logit - t.lse) - t.w_y;
    b.ref[row] = t.lse == HUGE_VALF ? NAN : t.lse;
    b.mult[row] = t.alpha;
    write_row_outputs(a, row, class_row_loss(r, t.w_y, a.k), t.lse, -1, false, false);
  }
}

/// A thread per row, after the second pass: the target element of P' (rows with a class in
/// [0, vocab) and not ignored).
template <class I>
XENT_KERNEL void patch_kernel(__nv_bfloat16* p, std::int64_t ld, const I* targets, int rows,
                              std::int64_t vocab, std::int64_t ignore_index, const float* patch) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const auto y = static_cast<std::int64_t>(targets[row]);
  if (skipped_class(y, ignore_index, vocab)) return;
  p[row * ld + y] = __float2bfloat16_rn(patch[row]);
}

}  // namespace scaled_probs
}  // namespace cuda_detail
}  // namespace xent
