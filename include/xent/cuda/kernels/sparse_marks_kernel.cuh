// The sparse backward's tile flags (dispatch/linear_sparse.cuh): a byte per tile of 64 global rows
// x 256 classes of the call, 1 where the tile must be kept. A tile is hot when one of its rows not
// ignored has a logit z with z - lse >= log tau (or NaN), or its class-id target among the
// tile's classes; marking writes only 1s over zeros, so rows of one tile may be marked by
// different CTAs (or chunks) in any order. Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../../online_lse.hpp"
#include "../block/dtype.cuh"
#include "../block/row_reduce.cuh"
#include "../cuda.cuh"
#include "sparse_gemm_kernel.cuh"

namespace xent {
namespace cuda_detail {
namespace sparse_gemm {

/// Whether a row (class id y, not ignored) keeps the tile of classes [first, first + 256) whose
/// largest logit is m: its target is there, or some p = exp(z - lse) may reach tau (NaN keeps).
__device__ __forceinline__ bool keeps_tile(std::int64_t y, std::int64_t first, float m, float lse,
                                           float log_tau) {
  return (y >= first && y < first + flag_cols) || !(m - lse < log_tau);
}

/// Marks the hot tiles among rows [0, n) x columns [0, cols) of `logits` (ld elements apart,
/// rows 16-byte aligned): row i is the call's row r0 + i (its LSE lse[i], its class id
/// targets[i]), column j the call's class c0 + j (c0 a multiple of 256). CTA (x, y): row x, and
/// eight warps over blocks 8 y to 8 y + 7 of its columns, a lane reading 8 logits.
template <class T, class I>
XENT_KERNEL void mark_kernel(const T* logits, std::int64_t ld, std::int64_t cols, const float* lse,
                             const I* targets, std::int64_t ignore_index, std::int64_t r0,
                             std::int64_t c0, float log_tau, unsigned char* flags,
                             std::int64_t ld_flags) {
  const std::int64_t row = blockIdx.x;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t j0 = (std::int64_t{blockIdx.y} * warps + (threadIdx.x >> 5)) * flag_cols;
  if (j0 >= cols) return;
  const auto y = static_cast<std::int64_t>(targets[row]);
  if (y == ignore_index) return;
  const T* z = logits + row * ld;
  const std::int64_t j = j0 + lane * 8;
  float m = -INFINITY;
  bool nan = false;
  if (j + 8 <= cols) {
    const auto v = load_vec<T, 8>(z + j);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float f = to_float(v.v[k]);
      nan |= f != f;
      m = fmaxf(m, f);
    }
  } else {
    for (std::int64_t k = j; k < cols; ++k) {
      const float f = to_float(z[k]);
      nan |= f != f;
      m = fmaxf(m, f);
    }
  }
  m = warp_max(m);
  nan = __any_sync(0xffffffffu, nan);
  if (lane != 0) return;
  if (nan || keeps_tile(y, c0 + j0, m, lse[row], log_tau))
    flags[(r0 + row) / flag_rows * ld_flags + (c0 + j0) / flag_cols] = 1;
}

/// The same marks from the statistics GEMM's row partials (stats_gemm.cuh: each row's max and sum
/// over each 256 columns, the tiles' classes): rows [0, n) of `partials` (col_tiles a row) are the
/// call's rows r0 + i. A thread per (row, tile).
template <class I>
XENT_KERNEL void mark_partials_kernel(const online_lse* partials, std::int64_t col_tiles,
                                      std::int64_t n, const float* lse, const I* targets,
                                      std::int64_t ignore_index, std::int64_t r0, float log_tau,
                                      unsigned char* flags) {
  const std::int64_t i = blockIdx.x * std::int64_t{threads} + threadIdx.x;
  if (i >= n * col_tiles) return;
  const std::int64_t row = i / col_tiles, t = i % col_tiles;
  const auto y = static_cast<std::int64_t>(targets[row]);
  if (y == ignore_index) return;
  if (keeps_tile(y, t * flag_cols, partials[i].max, lse[row], log_tau))
    flags[(r0 + row) / flag_rows * col_tiles + t] = 1;
}

/// Threads of list_kernel's one CTA.
constexpr int list_threads = 1024;

/// Lists, in order, the hot tiles among row tiles [rt0, rt0 + rows) x blocks [b0, b0 + blocks)
/// of the flags: items[k] = i * blocks + j for the k-th hot tile (rt0 + i, b0 + j); *count says
/// how many, and *next (tile_list_kernel's counter) starts at 0. One CTA of list_threads (a
/// template for count_kernel's reason).
template <int Threads = list_threads>
XENT_KERNEL void list_kernel(const unsigned char* flags, std::int64_t ld_flags, std::int64_t rt0,
                             std::int64_t rows, std::int64_t b0, std::int64_t blocks, int* items,
                             int* count, int* next) {
  __shared__ int counts[Threads / 32];
  const std::int64_t hot = compact<Threads>(
      rows * blocks,
      [&](std::int64_t i) { return flags[(rt0 + i / blocks) * ld_flags + b0 + i % blocks] != 0; },
      items, counts);
  if (threadIdx.x == 0) {
    *count = static_cast<int>(hot);
    *next = 0;
  }
}

/// Adds to counts[0] the tiles of row tiles [rt0, rt0 + rows) x blocks [b0, b0 + blocks) of the
/// flags, and to counts[1] the cold ones among them (linear_sparse_counts's fields, in device
/// memory). A template, as every kernel of a header: a plain __global__ is defined in each
/// translation unit that includes it (tests/cuda/link_check.cu).
template <int Threads = threads>
XENT_KERNEL void count_kernel(const unsigned char* flags, std::int64_t ld_flags, std::int64_t rt0,
                              std::int64_t rows, std::int64_t b0, std::int64_t blocks,
                              unsigned long long* counts) {
  unsigned long long cold = 0;
  const std::int64_t total = rows * blocks;
  for (std::int64_t i = blockIdx.x * std::int64_t{Threads} + threadIdx.x; i < total;
       i += std::int64_t{gridDim.x} * Threads)
    cold += flags[(rt0 + i / blocks) * ld_flags + b0 + i % blocks] == 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) cold += __shfl_xor_sync(0xffffffffu, cold, o);
  if ((threadIdx.x & 31) == 0 && cold) atomicAdd(counts + 1, cold);
  if (blockIdx.x == 0 && threadIdx.x == 0)
    atomicAdd(counts, static_cast<unsigned long long>(total));
}

}  // namespace sparse_gemm
}  // namespace cuda_detail
}  // namespace xent
