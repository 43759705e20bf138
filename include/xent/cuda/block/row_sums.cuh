// Sums over rows and classes that a row's gradient or the reduced loss needs: the mean's
// normaliser, sum_c w_c, and the deterministic reduction of the per-row losses through the
// workspace. Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "../../loss_math.hpp"
#include "../cuda.cuh"
#include "../tuning/policy.cuh"
#include "row_reduce.cuh"

namespace xent {
namespace cuda_detail {

/// Class-id or soft targets as the kernel sees them (device pointers).
template <class I>
struct class_ids {
  const I* ids;
  static constexpr bool soft = false;
};
template <class S>
struct soft_probs {
  const S* probs;
  std::int64_t ld;
  static constexpr bool soft = true;
};

/// The sum of every thread's `v` over the CTA, in a fixed order (the same bits in every CTA that
/// sums the same values), returned to all threads.
template <int Block>
__device__ double block_sum(double v) {
  using reduce_t = cub::BlockReduce<double, Block>;
  __shared__ typename reduce_t::TempStorage tmp;
  __shared__ double total;
  const double t = reduce_t(tmp).Sum(v);
  if (threadIdx.x == 0) total = t;
  __syncthreads();
  const double r = total;
  __syncthreads();  // tmp and total may be reused by the next call
  return r;
}

/// The mean's normaliser without class weights: the count of rows not ignored and in range,
/// exact in any order, so each CTA starts its walk over the targets at its own place (4 Block
/// targets after the previous CTA's) rather than every CTA of a launch asking the L2 for the same
/// lines at its start. H200, three rounds against the walk from row 0
///: bf16 8192 x 32000 backward 274 -> 272-273
/// us; the fused pass unchanged (284-285 us, where a sum takes 280 and no reduction 276: what
/// the mean costs it is not these loads), and keeping more of the loads in flight instead made it
/// 4 us slower.
template <int Block, class Tgt>
__device__ double spread_count(const Tgt& targets, std::int64_t rows, std::int64_t cols,
                               std::int64_t ignore_index) {
  const std::int64_t offset =
      rows > 0 ? static_cast<std::int64_t>(blockIdx.x) * (4 * Block) % rows : 0;
  long long count = 0;
#pragma unroll 4
  for (std::int64_t i = threadIdx.x; i < rows; i += Block) {
    const std::int64_t n = i + offset < rows ? i + offset : i + offset - rows;
    count += normalizer_weight(static_cast<std::int64_t>(targets.ids[n]), ignore_index, cols,
                               nullptr) != 0.0;
  }
  return block_sum<Block>(static_cast<double>(count));
}

/// A thread's part of the mean's normaliser: w[y] (1 without class weights) summed over rows
/// `first`, first + Step,... not ignored and in range.
template <int Step, class Tgt>
__device__ __forceinline__ double normalizer_part(const Tgt& targets, std::int64_t rows,
                                                  std::int64_t cols, std::int64_t ignore_index,
                                                  const float* weights, std::int64_t first) {
  double w = 0.0;
#pragma unroll 4
  for (std::int64_t n = first; n < rows; n += Step)
    w += normalizer_weight(static_cast<std::int64_t>(targets.ids[n]), ignore_index, cols, weights);
  return w;
}

/// The mean's normaliser: sum of w[y] over rows not ignored and in range (N for soft targets),
/// by every thread of the calling CTA in a fixed order: normalizer_kernel's one CTA ahead of the
/// row kernel (policy::normalizer_ahead), or each CTA that needs it in a launch with no such
/// kernel ahead (the streaming backward, the linear and vocab-parallel kernels, a row kernel
/// without a workspace; the small-batch kernel sums it in one warp, warp_normalizer); the
/// targets are a few KiB to a few hundred KiB read from L2. `Spread`: a launch of many CTAs;
/// without class weights each counts from its own place (spread_count).
template <int Block, bool Spread = false, class Tgt>
__device__ double mean_normalizer(const Tgt& targets, std::int64_t rows, std::int64_t cols,
                                  std::int64_t ignore_index, const float* weights) {
  if constexpr (Tgt::soft) {
    return static_cast<double>(rows);
  } else {
    if constexpr (Spread) {
      if (!weights) return spread_count<Block>(targets, rows, cols, ignore_index);
    }
    return block_sum<Block>(
        normalizer_part<Block>(targets, rows, cols, ignore_index, weights, threadIdx.x));
  }
}

/// The same normaliser of class-id rows by the 32 lanes of one warp, with no CTA barrier: the
/// small-batch kernel's rank 0 (its warp 1 while warp 0 waits for the row's partials; in the
/// forward, the warp that polls the rows' losses). Exact without class weights (a count); with
/// them, lane 0's sum in every lane (a butterfly leaves lanes different last bits).
template <class Tgt>
__device__ double warp_normalizer(const Tgt& targets, std::int64_t rows, std::int64_t cols,
                                  std::int64_t ignore_index, const float* weights) {
  static_assert(!Tgt::soft, "soft targets' normaliser is N");
  return __shfl_sync(
      0xffffffffu,
      warp_sum(normalizer_part<32>(targets, rows, cols, ignore_index, weights, threadIdx.x % 32)),
      0);
}

/// Asks L1 for the 128-byte lines of `count` elements at `p`, lane `lane` of a warp taking every
/// 32nd line, so that a walk over them a little later (warp_normalizer's) hits L1 instead of
/// waiting on L2 then.
template <class E>
__device__ __forceinline__ void prefetch_l1_lines(const E* p, std::int64_t count, int lane) {
  constexpr std::int64_t per_line = 128 / sizeof(E);
  for (std::int64_t i = lane * per_line; i < count; i += 32 * per_line)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p + i));
}

/// sum_c w_c (label smoothing with class weights).
template <int Block>
__device__ double class_weight_sum(const float* weights, std::int64_t cols) {
  double w = 0.0;
#pragma unroll 4
  for (std::int64_t c = threadIdx.x; c < cols; c += Block) w += weights[c];
  return block_sum<Block>(w);
}

__device__ __forceinline__ workspace_header* header(void* ws) {
  return static_cast<workspace_header*>(ws);
}

/// The normaliser normalizer_kernel left in the workspace header, once that kernel has finished
/// and its stores are visible (griddepcontrol.wait; it returns at once in a launch that is no
/// programmatic dependant).
__device__ __forceinline__ double normalizer_from_ahead(void* workspace) {
#if XENT_CUDA_SM90_PTX
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  return __ldcg(&header(workspace)->normalizer);
}

/// Records row n's loss and correctness in the workspace (plain stores; published by
/// finish_reduction's fence).
__device__ inline void record_row(void* workspace, std::int64_t rows, std::int64_t n, float loss,
                                  bool correct) {
  const workspace_layout layout(rows);
  char* ws = static_cast<char*>(workspace);
  reinterpret_cast<float*>(ws + layout.row_loss)[n] = loss;
  reinterpret_cast<unsigned char*>(ws + layout.correct)[n] = correct ? 1 : 0;
}

/// The reduced loss (the threads' `sum`s over `divisor`) and num_correct (their `hits`), written
/// by thread 0; every thread of the CTA calls it.
template <int Block>
__device__ void write_totals(double sum, double hits, double divisor, float* loss,
                             std::int64_t* num_correct) {
  const double total = block_sum<Block>(sum);
  const double total_hits = block_sum<Block>(hits);  // exact: integers below 2^53
  if (threadIdx.x == 0) {
    if (loss) *loss = static_cast<float>(over_normalizer(total, divisor));
    if (num_correct) *num_correct = static_cast<std::int64_t>(total_hits);
  }
}

/// Every thread of the CTA, once this CTA's part of the reduced loss is stored (by any of its
/// threads): adds `count` to the call's counter in the workspace header; true in the CTA that
/// brings it to `total`, which then, after a fence of its own, sees every other CTA's part (each
/// is fenced before its count).
__device__ inline bool completes_count(void* workspace, unsigned long long count,
                                       unsigned long long total) {
  __shared__ bool last;
  __syncthreads();  // the CTA's part is issued
  if (threadIdx.x == 0) {
    __threadfence();  // the part is visible before the count says so
    last = atomicAdd(&header(workspace)->rows_done, count) + count == total;
  }
  __syncthreads();  // `last` is visible
  return last;
}

/// Once per CTA, after its last row: adds its row count to the counter; the CTA that completes it
/// sums every row's entries in a fixed order (deterministic), writes the reduced loss and
/// num_correct, and resets the counter to 0 for the next call. One fence and one atomic per CTA,
/// not per row. `normalizer` is the mean's W (1 for a sum).
template <int Block>
__device__ void finish_reduction(void* workspace, std::int64_t rows, std::uint64_t my_rows,
                                 float* loss, std::int64_t* num_correct, double normalizer) {
  if (!completes_count(workspace, my_rows, static_cast<unsigned long long>(rows))) return;
  __threadfence();
  const workspace_layout layout(rows);
  const char* ws = static_cast<const char*>(workspace);
  const float* losses = reinterpret_cast<const float*>(ws + layout.row_loss);
  const signed char* flags = reinterpret_cast<const signed char*>(ws + layout.correct);
  double sum = 0.0, hits = 0.0;
  for (std::int64_t r = threadIdx.x; r < rows; r += Block) {
    sum += static_cast<double>(__ldcg(losses + r));  // from L2: written by other SMs
    hits += __ldcg(flags + r);
  }
  write_totals<Block>(sum, hits, normalizer, loss, num_correct);
  if (threadIdx.x == 0) header(workspace)->rows_done = 0;
}

/// A CTA's share of the reduced loss (the streaming forward's): the sums over its rows of their
/// losses and of their weights in the mean's normaliser, in its row order (deterministic).
struct loss_share {
  double loss, w;
};
static_assert(sizeof(loss_share) == 2 * sizeof(double), "workspace_layout's share slot");

/// Once per CTA of a call over `rows` rows, every thread calling, thread 0 holding the CTA's share
/// `mine` (slot `slot` of `ctas`, at most `rows`): stores the share and adds one to the counter;
/// the CTA that completes it sums the shares in slot order (deterministic), writes the reduced loss
/// (over the shares' w for reduction::mean; num_correct 0: plain rows count nothing) and resets the
/// counter for the next call. Against finish_reduction's entry per row, this last CTA's sum is of
/// one share per CTA, and no CTA sums the normaliser from every target: bf16 8192 x 32000 forward
/// 198 -> 195 us, where reduction none takes 192 (H100). The row kernels keep finish_reduction: a
/// share summed on their row path (in registers or shared memory) spilled the fused pass's register
/// tile, and one summed from the row entries at each CTA's end measured slower there (fused 378 ->
/// 381 us).
template <int Block>
__device__ void finish_shares(void* workspace, std::int64_t rows, std::int64_t slot,
                              std::int64_t ctas, const loss_share& mine, reduction reduce,
                              float* loss, std::int64_t* num_correct) {
  loss_share* const shares =
      reinterpret_cast<loss_share*>(static_cast<char*>(workspace) + workspace_layout(rows).shares);
  if (threadIdx.x == 0) shares[slot] = mine;
  if (!completes_count(workspace, 1, static_cast<unsigned long long>(ctas))) return;
  __threadfence();
  double sum = 0.0, w = 0.0;
  for (std::int64_t c = threadIdx.x; c < ctas; c += Block) {
    sum += __ldcg(&shares[c].loss);  // from L2: written by other SMs
    w += __ldcg(&shares[c].w);
  }
  w = reduce == reduction::mean ? block_sum<Block>(w) : 1.0;
  write_totals<Block>(sum, 0.0, w, loss, num_correct);
  if (threadIdx.x == 0) header(workspace)->rows_done = 0;
}

/// The small-batch kernel's polled sum (no fence, no counter): each row's loss goes into its
/// record with a ready flag in the same 64-bit word, so one relaxed store publishes it and a
/// relaxed load that sees the flag sees the loss. One warp of one CTA polls every record, sums
/// them in a fixed order, writes the totals and zeroes the records for the next call.
/// Where the records start: the same place for every row count (workspace_layout).
__device__ __forceinline__ unsigned long long* row_records(void* workspace) {
  return reinterpret_cast<unsigned long long*>(static_cast<char*>(workspace) +
                                               workspace_layout(0).records);
}
/// One record word, stored and loaded whole (relaxed, GPU scope): a load that sees it set sees
/// all of it.
__device__ __forceinline__ void store_record(unsigned long long* at, unsigned long long word) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(at), "l"(word) : "memory");
}
__device__ __forceinline__ unsigned long long load_record(const unsigned long long* at) {
  unsigned long long word;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(word) : "l"(at) : "memory");
  return word;
}
__device__ __forceinline__ void publish_record(void* workspace, std::int64_t n, float loss) {
  store_record(row_records(workspace) + n,
               (1ull << 32) | static_cast<unsigned long long>(__float_as_uint(loss)));
}
/// Every lane of one warp. The rows' writers run beside it in the same launch (a CTA that polls
/// holds one slot while the rest of the grid is scheduled around it). A lane loads its records a
/// batch at a time, every load in flight before it waits on any (each is a round trip to L2; one
/// after another, 128 rows took four), and polls again all of those not yet ready at once (again
/// one round trip, not one per record); the sum stays in row order, so the bits are those of a
/// one-by-one poll.
__device__ inline void warp_poll_reduction(void* workspace, std::int64_t rows, float* loss,
                                           std::int64_t* num_correct, double normalizer) {
  unsigned long long* records = row_records(workspace);
  const int lane = static_cast<int>(threadIdx.x % 32);
  constexpr int batch = 4;  // 128 rows in one batch, in 8 registers: the kernel keeps its 48
  double sum = 0.0;
  for (std::int64_t r0 = lane; r0 < rows; r0 += 32 * batch) {
    unsigned long long word[batch] = {};
    unsigned pending = 0;  // bit k: record r0 + 32 k is this lane's and not yet ready
#pragma unroll
    for (int k = 0; k < batch; ++k)
      if (r0 + 32 * k < rows) pending |= 1u << k;
    for (bool first = true; pending != 0; first = false) {
      if (!first) __nanosleep(32);
#pragma unroll
      for (int k = 0; k < batch; ++k)
        if (pending >> k & 1u) word[k] = load_record(records + r0 + 32 * k);
#pragma unroll
      for (int k = 0; k < batch; ++k)
        if ((pending >> k & 1u) && (word[k] >> 32)) pending &= ~(1u << k);
    }
#pragma unroll
    for (int k = 0; k < batch; ++k)
      if (r0 + 32 * k < rows)
        sum += static_cast<double>(__uint_as_float(static_cast<unsigned>(word[k])));
  }
  sum = warp_sum(sum);
  for (std::int64_t r = lane; r < rows; r += 32) records[r] = 0ull;
  if (lane == 0) {
    if (loss) *loss = static_cast<float>(over_normalizer(sum, normalizer));
    if (num_correct) *num_correct = 0;  // plain rows only: no argmax, nothing counted
  }
}

}  // namespace cuda_detail
}  // namespace xent
