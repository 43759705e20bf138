// The CUDA workspace of fused linear cross-entropy: which buffers a call needs, where they sit in
// the caller's device buffer, and how many rows a chunk can have in a given number of bytes.
//
// Layout (each buffer 256-byte aligned, measured from the first 256-byte-aligned address of the
// caller's buffer, so the buffer itself may have any alignment):
//   logits    chunk_rows x ld elements of T: the chunk's logits, then its logit gradient in place
//             (in the caller's d_weight instead when that gives larger chunks: linear_logits_room)
//   row_up    chunk_rows floats (training): each row's upstream gradient for mean / sum
//   scalars   the mean's normaliser W (a double)
//   row_loss  N floats: row losses for the reduced loss when the caller keeps none
//   argmax    N int64: argmax for num_correct when the caller keeps none
//   dx        chunk_rows x D floats (training, G not float): d_hidden rows before rounding
//   dw        V x D floats (training, G not float, dw_accumulation::fp32): d_weight's accumulator;
//             or dw_block x D floats (dw_accumulation::output with G neither float nor T): one
//             weight block's contribution before it is added to d_weight
//   db        V floats (training, G not float): d_bias's accumulator
//   probs     (training, bf16 inputs, policy::scaled_probs) the chunk's buffers of the path that
//             stores scaled probabilities (scaled_probs.cuh; probs_layout)
//   lt_work   linear_lt_workspace bytes (training with dw as the V x D float accumulator, or a
//             float d_weight from bf16 / fp16 inputs): cuBLASLt's workspace for the
//             accumulating d_weight GEMM (accumulate_gemm.cuh)
#pragma once

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../linear/options.hpp"
#include "../../linear/plan.hpp"
#include "../block/dtype.cuh"
#include "../tuning/policy.cuh"

namespace xent {
namespace cuda_detail {

/// cudaMalloc's own alignment: every buffer starts as a fresh allocation would, which cuBLAS's
/// tensor-core kernels and the core's 16-byte vector accesses need.
constexpr std::size_t linear_alignment = 256;
constexpr std::size_t linear_absent = ~std::size_t{0};

/// Weight rows per block when d_weight is accumulated in its own dtype and that dtype is neither
/// float nor the inputs' (cuBLAS's GemmEx writes C in the inputs' dtype or float only): each
/// block's float contribution is staged here and added to d_weight by a kernel. 1024 rows keep
/// the scratch at 4 KiB per hidden unit (16 MiB for D = 4096). Not tuned: a rare combination.
constexpr std::int64_t linear_dw_block_rows = 1024;

/// Device memory lent to cuBLASLt for the accumulating d_weight GEMM (accumulate_gemm.cuh); the
/// algorithms it chooses there ask for a few bytes (split-K counters), 1 MiB leaves them room.
constexpr std::size_t linear_lt_workspace = std::size_t{1} << 20;

/// The logits' leading dimension: V rounded up to 16 bytes, so every row starts 16-byte aligned
/// (the core's bulk copies and vector stores take the aligned path; cuBLAS's kernels want it too).
template <class T>
std::int64_t logits_ld(std::int64_t vocab) {
  constexpr std::int64_t per = 16 / static_cast<std::int64_t>(sizeof(T));
  return (vocab + per - 1) / per * per;
}

/// Lays buffers out one after another, each at a linear_alignment boundary from the start.
struct aligned_layout {
  std::size_t end = 0;
  /// The next buffer's offset; linear_absent, taking nothing, when it is not `needed`.
  std::size_t take(std::size_t bytes, bool needed = true) {
    if (!needed) return linear_absent;
    const std::size_t offset = end;
    end += (bytes + linear_alignment - 1) / linear_alignment * linear_alignment;
    return offset;
  }
};

/// Rows and columns per tile of the Hopper GEMM (stats_gemm::tile_m, tile_n) and the size of its
/// row partials: each row of a chunk has one partial per 256 columns, each 128 rows one flag
/// (scaled_probs.cuh checks all three).
constexpr std::int64_t probs_tile_rows = 128, probs_tile_cols = 256;
constexpr std::size_t probs_partial_bytes = 8;

/// The buffers of training's scaled-probabilities path (scaled_probs.cuh) for chunks of `rows`
/// rows, as byte offsets from the region's start, each 256-byte aligned: the row partials (rows x
/// V / 256), the scaled hidden rows (rows x D bf16), five floats per row (reference, multiplier,
/// scale, target patch, target logit), a flag per 128-row tile with the count of flagged rows, and
/// a flag per row. About V / 32 + 2 D + 24 bytes per row beside its 2 V bytes of logits.
struct probs_layout {
  std::size_t partials = 0, hidden = 0, ref = 0, mult = 0, beta = 0, patch = 0, target_logit = 0;
  std::size_t flags = 0, second = 0, bytes = 0;
  std::int64_t row_tiles = 0;
};

inline probs_layout make_probs_layout(std::int64_t rows, std::int64_t vocab, std::int64_t hidden) {
  probs_layout l;
  aligned_layout at;
  const auto R = static_cast<std::size_t>(rows);
  const auto col_tiles = static_cast<std::size_t>((vocab + probs_tile_cols - 1) / probs_tile_cols);
  l.row_tiles = (rows + probs_tile_rows - 1) / probs_tile_rows;
  l.partials = at.take(probs_partial_bytes * R * col_tiles);
  l.hidden = at.take(2 * R * static_cast<std::size_t>(hidden));
  l.ref = at.take(sizeof(float) * R);
  l.mult = at.take(sizeof(float) * R);
  l.beta = at.take(sizeof(float) * R);
  l.patch = at.take(sizeof(float) * R);
  l.target_logit = at.take(sizeof(float) * R);
  l.flags = at.take(sizeof(int) * (static_cast<std::size_t>(l.row_tiles) + 1));
  l.second = at.take(sizeof(int) * R);
  l.bytes = at.end;
  return l;
}

/// Byte offsets of a call's buffers from the aligned base (linear_absent when not needed).
struct linear_plan {
  std::int64_t chunk_rows = 1;  ///< rows of hidden per chunk
  std::int64_t ld = 0;          ///< the logits' leading dimension, in elements
  std::int64_t dw_block = 0;    ///< weight rows per staged block (0: none)
  std::size_t logits = linear_absent;
  std::size_t row_up = linear_absent;
  std::size_t scalars = linear_absent;
  std::size_t row_loss = linear_absent;
  std::size_t argmax = linear_absent;
  std::size_t dx = linear_absent;
  std::size_t dw = linear_absent;
  std::size_t db = linear_absent;
  std::size_t lt_work = linear_absent;
  std::size_t probs = linear_absent;  ///< the probs_layout region
  std::size_t end = 0;                ///< the end of the last buffer, from the aligned base
  std::size_t bytes = 0;              ///< what the call needs, alignment slack included
};

/// `logits_outside`: the chunk's logits live in the caller's d_weight (linear_logits_room), not in
/// the workspace. `probs_room`: room for the scaled-probabilities path where it may run (the
/// vocab-parallel calls, which do not take it, plan none). `dx_room`: room for the chunk's
/// d_hidden rows in float (the low-memory order's panels write no d_hidden of their own: they sum
/// it over the panels in an N x D buffer of that order's plan).
template <class T, class G>
linear_plan make_linear_plan(const linear_shape& s, linear_pass pass, dw_accumulation accumulate,
                             std::int64_t chunk_rows, bool logits_outside = false,
                             bool probs_room = true, bool dx_room = true) {
  using DT = device_t<T>;
  using DG = device_t<G>;
  constexpr bool narrow_grads = !std::is_same<DG, float>::value;
  constexpr bool grads_as_inputs = std::is_same<DG, DT>::value;
  const bool training = pass == linear_pass::training;
  linear_plan p;
  p.chunk_rows = chunk_rows;
  p.ld = logits_ld<DT>(s.vocab);
  aligned_layout at;
  const auto R = static_cast<std::size_t>(chunk_rows), N = static_cast<std::size_t>(s.rows);
  const auto V = static_cast<std::size_t>(s.vocab), D = static_cast<std::size_t>(s.hidden);
  p.logits = at.take(sizeof(DT) * R * static_cast<std::size_t>(p.ld), !logits_outside);
  p.row_up = at.take(sizeof(float) * R, training);
  p.scalars = at.take(sizeof(double), true);
  p.row_loss = at.take(sizeof(float) * N, true);
  p.argmax = at.take(sizeof(std::int64_t) * N, true);
  p.dx = at.take(sizeof(float) * R * D, training && narrow_grads && dx_room);
  if (accumulate == dw_accumulation::fp32) {
    p.dw = at.take(sizeof(float) * V * D, training && narrow_grads);
  } else if (training && narrow_grads && !grads_as_inputs) {
    p.dw_block = std::max<std::int64_t>(1, std::min(s.vocab, linear_dw_block_rows));
    p.dw = at.take(sizeof(float) * static_cast<std::size_t>(p.dw_block) * D, true);
  }
  p.db = at.take(sizeof(float) * V, training && narrow_grads);
  // The accumulating d_weight GEMM's: into the float accumulator, or into a float d_weight
  // (its own accumulator) from 16-bit inputs.
  constexpr bool float_dw_from_narrow = !narrow_grads && !std::is_same<DT, float>::value;
  p.lt_work = at.take(linear_lt_workspace, (p.dw != linear_absent && p.dw_block == 0) ||
                                               (training && float_dw_from_narrow));
  // Whether a call takes that path is known only on the device (an sm_90 GPU running the sm_90a
  // build): every bf16 training plan has the room.
  constexpr bool probs_dtype = std::is_same<DT, __nv_bfloat16>::value;
  p.probs =
      at.take(make_probs_layout(chunk_rows, s.vocab, s.hidden).bytes,
              probs_room && training && probs_dtype && policy::stats_gemm && policy::scaled_probs);
  p.end = at.end;
  p.bytes = at.end + linear_alignment;  // room to align whatever address the caller's buffer has
  return p;
}

/// Rows per chunk when at most `most` fit: the fewest chunks, of equal size rounded up to a
/// multiple of 128 rows where that stays within `most` (else `most` rounded down to one). Each
/// chunk's GEMMs tile its rows by 128 (cuBLAS's tensor-core tiles on sm_90): the 524-row chunks a
/// 256 MiB budget gives at V = 256000 left every logits GEMM a fifth tile of 12 rows, 16 % more
/// tiles than 512 rows need.
inline std::int64_t gemm_friendly_rows(std::int64_t rows, std::int64_t most) {
  constexpr std::int64_t tile = 128;
  if (most >= rows || most < 2 * tile) return most;
  const std::int64_t chunks = (rows + most - 1) / most;
  const std::int64_t even = (rows + chunks - 1) / chunks;
  const std::int64_t up = (even + tile - 1) / tile * tile;
  return up <= most ? up : most / tile * tile;
}

/// The plan with the most rows per chunk (at most every row) that fits `budget` bytes; the
/// one-row plan when none does. With `logits_room` bytes of the caller's d_weight free for the
/// logits (linear_logits_room), the chunk's logits go there when that makes chunks larger, and
/// the workspace holds the rest.
template <class T, class G>
linear_plan plan_linear(const linear_shape& s, linear_pass pass, dw_accumulation accumulate,
                        std::size_t budget, std::size_t logits_room = 0) {
  // Training with the float d_weight accumulator in one chunk of every row needs no accumulator:
  // the chunk's d_weight GEMM sums every row in float and rounds once into d_weight, as the
  // accumulator would (dw_accumulation::output's buffers, with the same numbers). Its logits
  // (N x V of T) replace the V x D floats of the accumulator, so it fits a workspace sized for
  // the accumulator whenever N <= 2 D (+ the budget's rows): 8192 x 4096 x 128256 in bf16 needs
  // 2.1 GB either way. It also saves the accumulator's traffic, which each chunk's d_weight GEMM
  // reads and writes (4 V D bytes each way), and rounding it at the end.
  // cuBLAS takes a GEMM's rows as an int: chunks of at most INT_MAX rows (whole 128-row tiles).
  constexpr std::int64_t most_rows = std::int64_t{INT_MAX} / 128 * 128;
  constexpr bool narrow_grads = !std::is_same<device_t<G>, float>::value;
  if (narrow_grads && pass == linear_pass::training && accumulate == dw_accumulation::fp32 &&
      s.rows >= 1 && s.rows <= most_rows) {
    const linear_plan whole = make_linear_plan<T, G>(s, pass, dw_accumulation::output, s.rows);
    if (whole.bytes <= budget) return whole;
  }
  const linear_plan inside = detail::largest_chunk_plan(
      std::min(s.rows, most_rows), budget,
      [&](std::int64_t rows) { return make_linear_plan<T, G>(s, pass, accumulate, rows); });
  auto rounded = [&](const linear_plan& p, bool logits_outside) {
    const std::int64_t rows = gemm_friendly_rows(s.rows, p.chunk_rows);
    return rows == p.chunk_rows ? p
                                : make_linear_plan<T, G>(s, pass, accumulate, rows, logits_outside);
  };
  // A vocabulary of none (no rows, or a forward's size query) has logits rows of no bytes.
  if (s.vocab == 0 || logits_room == 0) return rounded(inside, false);
  const std::size_t row_bytes =
      sizeof(device_t<T>) * static_cast<std::size_t>(logits_ld<device_t<T>>(s.vocab));
  const auto room_rows = static_cast<std::int64_t>(std::min<std::size_t>(
      logits_room / row_bytes, static_cast<std::size_t>(std::min(s.rows, most_rows))));
  if (room_rows <= inside.chunk_rows) return rounded(inside, false);
  const linear_plan outside = detail::largest_chunk_plan(room_rows, budget, [&](std::int64_t rows) {
    return make_linear_plan<T, G>(s, pass, accumulate, rows, true);
  });
  return outside.bytes <= budget && outside.chunk_rows > inside.chunk_rows ? rounded(outside, true)
                                                                           : rounded(inside, false);
}

/// Bytes of d_weight (from its first 256-byte-aligned address) that can hold a chunk's logits
/// until the call's end: training with the float accumulator (dw_accumulation::fp32) and a
/// 16-bit d_weight writes d_weight once, when the accumulator is rounded into it after the last
/// chunk, so until then its V x D elements are free room. Larger chunks are what the d_weight GEMM
/// needs: each chunk reads and writes the whole V x D float accumulator (2.4 GB for 256000 x 2304)
/// while its products grow with the chunk's rows, so 515-row chunks (256 MiB of bf16 logits at
/// V = 256000) left that GEMM bound by the accumulator's traffic. Only a d_weight without padding
/// between rows (ld == D): padding may belong to a larger matrix of the caller's.
template <class T, class G>
std::size_t linear_logits_room(linear_pass pass, dw_accumulation accumulate, const G* d_weight,
                               std::int64_t vocab, std::int64_t hidden, std::int64_t ld) {
  if (std::is_same<device_t<G>, float>::value || pass != linear_pass::training ||
      accumulate != dw_accumulation::fp32 || d_weight == nullptr || ld != hidden || vocab == 0 ||
      hidden == 0)
    return 0;
  const auto address = reinterpret_cast<std::uintptr_t>(d_weight);
  const std::uintptr_t skip = (linear_alignment - address % linear_alignment) % linear_alignment;
  const std::size_t bytes =
      sizeof(G) * static_cast<std::size_t>(vocab) * static_cast<std::size_t>(hidden);
  return bytes > skip ? bytes - skip : 0;
}

}  // namespace cuda_detail
}  // namespace xent
