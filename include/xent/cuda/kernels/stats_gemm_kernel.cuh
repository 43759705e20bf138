// The fused linear forward's Hopper path (sm_90a): logits = X. W^T computed tile by tile by wgmma,
// each tile's epilogue turning a row's 256 logits into their max and sum of exponentials (and
// picking up the target's logit), so the N x V logits are never written or read back; a second
// kernel merges each row's N x V/256 partials into its LSE and loss. The cuBLAS path (linear.cuh)
// writes each chunk's logits and the cross-entropy pass reads them again: on an H200 that read was
// 4-7% of the forward's time above the GEMM alone. Included only by nvcc; dispatch/stats_gemm.cuh
// launches it.
//
// The GEMM kernel: persistent CTAs (one per SM) of three warpgroups. Warpgroup 0's first thread
// loads 128 x 64 tiles of X and 256 x 64 tiles of W by tensor copies (TMA, 128-byte swizzle) into
// three shared-memory stages; warpgroups 1 and 2 each multiply 64 of the tile's 128 rows by all 256
// columns with wgmma m64n256k16 (128 float accumulators per thread), keep one stage's products in
// flight while the next is issued, and release each stage when its products are done. At a tile's
// end they round its logits to bf16 into a shared-memory staging tile (16 matrix stores per thread)
// and go on to the next tile; warpgroup 0's other three warps turn the staged tile into each row's
// max and sum of exponentials meanwhile (or, in the form that stores the logits, one of their
// threads stores it by tensor stores: from the consumers' registers the stores cost 12-15% of the
// GEMM). When the consumer warpgroups computed the statistics themselves, the tensor cores stood
// idle through them (one MUFU exponential per logit): several percent of the GEMM's time. In
// training's form (form::probs, scaled_probs.cuh) the consumers stage each logit as its fp16
// difference from a row reference instead (eight times finer where it matters: see stage_tile), and
// the statistics warps also rewrite the staged tile as scaled exponentials and one of them stores
// it by tensor stores. Tiles are walked 16 row tiles at a time (Triton's grouped order), so the
// tiles in flight share their X and W tiles in L2. By default (policy::stats_gemm_cluster) the CTAs
// run in clusters of two on neighbouring row tiles, each loading half of every W tile into both by
// a multicast copy. Its body exists only in an sm_90a build (wgmma, setmaxnreg): a build without it
// leaves an empty kernel, which ready recognises by its lack of static shared memory (the real
// kernel's mbarriers).
//
// The statistics are of the logits rounded to bf16, as the cuBLAS path (which stores them so) and
// PyTorch eager have them: both paths give the same losses up to the order of the sums. Training's
// first pass alone takes them from the fp16 differences, the same values its P comes from.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../../loss_math.hpp"
#include "../../online_lse.hpp"
#include "../block/chunk_stats.cuh"
#include "../block/row_args.cuh"
#include "../block/row_reduce.cuh"
#include "../block/row_sums.cuh"
#include "../block/tile.cuh"
#include "../block/wgmma.cuh"
#include "../cuda.cuh"

namespace xent {
namespace cuda_detail {
namespace stats_gemm {

using namespace hopper;

/// Three stages of 64 columns beside the 64 KiB staging tile (H200, bench/lse_gemm_bench.cu, two
/// runs each, X. W^T's time against cuBLAS's: 8192 x 4096 x 128256 1.035x / 1.023x, 16384 x 2304 x
/// 256000 1.128x / 1.166x). Measured against it: four stages beside half a tile staged at a time,
/// the second half handed over two k-blocks into the next tile (1.074x / 1.069x, 1.147x / 1.138x)
/// or eight (1.043x / 1.048x, 1.128x / 1.104x); six stages of 32 columns (64-byte swizzle) with the
/// whole tile, 1.069x / 1.135x and 1.130x / 1.136x. Tiles walk 16 row tiles at a time (group_m):
/// two runs each at 8 / 16 / 32 / 64 row tiles, forward against cuBLAS at 8192 x 4096 x 128256
/// 1.018-1.023x / 0.983-1.015x / 0.996-1.033x / 1.052-1.077x, at 16384 x 2304 x 256000 1.086-1.129x
/// / 1.076-1.081x / 1.079x / 1.130-1.135x (H200).
constexpr int tile_m = 128, tile_n = 256, tile_k = 64, stages = 3, group_m = 16;
constexpr int threads = 384;  // producer + statistics warpgroup, two consumer warpgroups
/// The producer warpgroup's warps 1-3 compute the statistics (warp 0's thread 0 issues the
/// copies). A fourth warpgroup of its own would leave ptxas 128 registers per thread for the
/// whole kernel, too few for wgmma's 128 accumulators.
constexpr int stats_threads = 96;
constexpr int a_bytes = tile_m * tile_k * 2, b_bytes = tile_n * tile_k * 2;
constexpr int stage_bytes = a_bytes + b_bytes;
/// The staging tile: the tile's logits as bf16 in four blocks of 64 columns, each 128 rows of 128
/// bytes whose 16-byte chunks are swizzled by the row's low three bits (the tensor copy's 128-byte
/// swizzle, so a block leaves by one tensor store), so that the 8 rows of a matrix store and the
/// 8 rows a quarter warp reads fall in distinct banks.
constexpr int staged_block_bytes = tile_m * 128;
constexpr int staged_bytes = (tile_n / 64) * staged_block_bytes;
constexpr int smem_bytes = stages * stage_bytes + staged_bytes + 1024;  // + the swizzle's alignment
static_assert(smem_bytes + 128 <= 227 * 1024, "sm_90's shared memory per CTA (static included)");

/// One row's partial over a 256-column tile: the largest logit and the sum of exp(z - max), as
/// the core's mergeable state.
using partial = online_lse;

/// What the kernel makes of each tile: each row's statistics alone (the forward), the logits
/// (measuring the main loop: bench/lse_gemm_bench.cu; training's chunk logits behind
/// policy::stats_gemm_logits), or the statistics and the scaled exponentials of the logits
/// (training's chunk, scaled_probs.cuh).
enum class form { stats, logits, probs };

/// What the GEMM reads and writes beside its operands. form::stats: `partials` (rows x col_tiles)
/// and `target_logit` (one per row whose target is a class in [0, cols), written by the tile
/// holding it). form::logits: the rows x cols bf16 logits, through the kernel's output tensor map.
/// form::probs: through that map P = mult exp(z - ref), rounded to bf16, with `ref` and `mult` per
/// row (mult null: 1; ref +inf gives a row of zeros), and, where the pointers are given, the
/// partials and target logits as form::stats. Its logits are staged as fp16 differences z - ref
/// (stage_tile) except in the rows that `logit_rows` (null: none) flags with a 1, staged as bf16
/// logits: the rows a second pass takes with ref their LSE over bf16 logits. With `tile_flags` (one
/// per row tile) the kernel takes only the tiles whose cluster's row tiles have a flag set, and
/// with `flagged` nothing at all when *flagged is 0 (scaled_probs.cuh's second pass over the rows
/// it could not scale).
template <class I>
struct args {
  int rows, cols, depth;  // N, V, D of this launch
  int col_tiles;
  const I* targets;
  partial* partials;
  float* target_logit;
  const float* ref = nullptr;
  const float* mult = nullptr;
  const int* tile_flags = nullptr;
  const int* flagged = nullptr;
  const int* logit_rows = nullptr;
};

/// The arguments of a launch over `rows` x `cols` logits with `depth` products each, nothing else
/// set.
template <class I>
args<I> shape_args(std::int64_t rows, std::int64_t cols, std::int64_t depth) {
  args<I> a{};
  a.rows = static_cast<int>(rows);
  a.cols = static_cast<int>(cols);
  a.depth = static_cast<int>(depth);
  a.col_tiles = static_cast<int>((cols + tile_n - 1) / tile_n);
  return a;
}

/// Tile t of the grouped order: group_m row tiles at a time, each group's column tiles in turn.
/// With clusters (Cluster CTAs side by side on Cluster row tiles, sharing each W tile) the order is
/// of row-tile groups of Cluster, `row_tiles` of them, and m the row tile of the CTA of cluster
/// rank `rank` in its group.
template <int Cluster>
__device__ __forceinline__ void tile_at(int t, int row_tiles, int col_tiles, int rank, int& m,
                                        int& n) {
  constexpr int rows_per_group = group_m / Cluster;
  const int per_group = rows_per_group * col_tiles;
  const int first = t / per_group * rows_per_group;
  const int height = row_tiles - first < rows_per_group ? row_tiles - first : rows_per_group;
  const int in_group = t % per_group;
  m = (first + in_group % height) * Cluster + rank;
  n = in_group / height;
}

/// Where `chunk` (16 bytes) of staging row `row` lives.
__device__ __forceinline__ int staged_offset(int row, int chunk) {
  return (chunk >> 3) * staged_block_bytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

/// One consumer thread's epilogue: its logits rounded to bf16 into the staging tile by 16 matrix
/// stores; with Probs (form::probs), each logit less its row's reference rounded to fp16 instead,
/// but for the rows `logits` flags: fp16 carries |z - ref| 2^-11 where bf16 carried |z| 2^-8, and
/// |z - ref| is of the size of the row's loss for the logits whose exponentials matter (a
/// difference past fp16's 65504 becomes +-inf: the statistics warps see it). Accumulator layout of
/// m64nNk16: thread lane of warp w holds rows 16 w + lane / 4 and + 8, columns 8 j + 2 (lane % 4) +
/// {0, 1}, in d[4 j + {0, 1}] and d[4 j + {2, 3}]: each 8 x 8 block is a matrix in stmatrix's
/// fragment layout, and d[8 i.. 8 i + 7] are the blocks (2 i, rows +0), (2 i, +8), (2 i + 1, +0),
/// (2 i + 1, +8), whose row addresses lanes 0-7, 8-15, 16-23 and 24-31 give. Consumer warpgroup `c`
/// holds staging rows 64 c.. 64 c + 63; `ref` the references of the thread's two rows (+0, +8),
/// `logits` whether they stage bf16 logits.
template <bool Probs>
__device__ __forceinline__ void stage_tile(const float (&d)[128], unsigned char* staged, int c,
                                           const float (&ref)[2], const bool (&logits)[2]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int lane = static_cast<int>(threadIdx.x) % 32,
            warp = static_cast<int>(threadIdx.x) / 32 % 4;
  const int q = lane / 8, row = 64 * c + 16 * warp + 8 * (q % 2) + lane % 8;
  const unsigned base = shared_address(staged);
  auto pair = [&](int k) {  // d[2 k], d[2 k + 1]: row +0 for even k, +8 for odd
    if (Probs && !logits[k % 2]) {
      const __half2 v = __floats2half2_rn(d[2 * k] - ref[k % 2], d[2 * k + 1] - ref[k % 2]);
      return *reinterpret_cast<const unsigned*>(&v);
    }
    const __nv_bfloat162 v = __floats2bfloat162_rn(d[2 * k], d[2 * k + 1]);
    return *reinterpret_cast<const unsigned*>(&v);
  };
#pragma unroll
  for (int i = 0; i < 16; ++i)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                     base + staged_offset(row, 2 * i + q / 2)),
                 "r"(pair(4 * i)), "r"(pair(4 * i + 1)), "r"(pair(4 * i + 2)), "r"(pair(4 * i + 3))
                 : "memory");
#else
  (void)d;
  (void)staged;
  (void)c;
  (void)ref;
  (void)logits;
#endif
}

/// A statistics thread's work on one staged row (staging row `row` of a tile whose first `valid`
/// columns are logits): the partial of the row's max and sum of exponentials, and the logit of
/// column `target` (-1: another tile's) into `z`. Columns past V (W's rows there read as zeros)
/// are outside `valid`. E: the staged type, bf16 logits or (Probs only) fp16 differences.
///
/// Probs: each staged value is replaced by P = mult exp(z - ref) in bf16, formed as exp(v - max
/// v), the sum's term, times mult exp(max v - drop), with v the staged value (z, or d = z - ref in
/// fp16) and drop what is left to subtract (ref, or 0): one multiply per element beside the
/// exponential the sum takes anyway. The partial is of z (max v, plus ref for differences). A row
/// whose largest difference is +inf (past fp16's range, or an infinite logit) gets the partial
/// {+inf, 1} and no P: the merge sends it to the second pass (scaled_probs.cuh). A tile row whose
/// values are all -inf (differences below fp16's range) and a row of reference +inf (ignored or
/// out of range) get P = 0 and an empty partial.
template <bool Probs, class E = __nv_bfloat16>
__device__ __forceinline__ partial staged_row(unsigned char* staged, int row, int valid,
                                              std::int64_t target, float& z, float ref,
                                              float mult) {
  constexpr bool diff = std::is_same<E, __half>::value;
  static_assert(Probs || !diff, "fp16 differences are form::probs' alone");
  using E2 = std::conditional_t<diff, __half2, __nv_bfloat162>;
  auto at = [&](int c) -> E& {
    return *reinterpret_cast<E*>(staged + staged_offset(row, c / 8) + 2 * (c % 8));
  };
  auto v = [&](int i) { return reinterpret_cast<uint4*>(staged + staged_offset(row, i)); };
  auto zero_row = [&] {  // P = 0 over the tile row
    for (int i = 0; i < tile_n / 8; ++i) *v(i) = make_uint4(0u, 0u, 0u, 0u);
  };
  if constexpr (Probs) {
    if (ref == HUGE_VALF) {  // the row's gradient is 0; its partial is not read
      zero_row();
      return partial{};
    }
  }
  const float lift = diff ? ref : 0.0f, drop = Probs && !diff ? ref : 0.0f;
  if (target >= 0 && target < valid) z = to_float(at(static_cast<int>(target))) + lift;
  float m = -HUGE_VALF, s = 0.0f;
  float f = 0.0f;  // Probs: mult exp(max v - drop)
  if (valid == tile_n) {
    // A whole row in column order: the 8 rows a quarter warp reads at once sit in distinct banks
    // (the swizzle). Four independent chains each for the max and the sum (one chain of 256
    // dependent instructions would wait on latency); the max on 16-bit pairs, exact.
    E2 mc[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) mc[k] = E2(negative_infinity<E>(), negative_infinity<E>());
#pragma unroll 4  // 16 registers of loads in flight: the statistics warps have 64 in all
    for (int i = 0; i < tile_n / 8; ++i) {
      const uint4 q = *v(i);
      const unsigned u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) mc[k] = __hmax2(mc[k], *reinterpret_cast<const E2*>(&u[k]));
    }
    const E2 m2 = __hmax2(__hmax2(mc[0], mc[1]), __hmax2(mc[2], mc[3]));
    m = fmaxf(__low2float(m2), __high2float(m2));
    if (diff && m == HUGE_VALF) return partial::of_block(HUGE_VALF, 1.0f);
    if (Probs && m == -HUGE_VALF) {
      zero_row();
      return partial{};
    }
    const float shift = m * log2e;
    if constexpr (Probs) f = mult * fast_exp2((m - drop) * log2e);
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int i = 0; i < tile_n / 8; ++i) {
      const uint4 q = *v(i);
      const unsigned u[4] = {q.x, q.y, q.z, q.w};
      unsigned p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // the pair of word k, as tile.cuh's word_element unpacks it
        const float e0 = fast_exp2(fmaf(word_element<E>(u, 2 * k), log2e, -shift));
        const float e1 = fast_exp2(fmaf(word_element<E>(u, 2 * k + 1), log2e, -shift));
        sc[k] += e0 + e1;
        if constexpr (Probs) {
          const __nv_bfloat162 pk = __floats2bfloat162_rn(e0 * f, e1 * f);
          p[k] = *reinterpret_cast<const unsigned*>(&pk);
        }
      }
      if constexpr (Probs) *v(i) = make_uint4(p[0], p[1], p[2], p[3]);
    }
    s = (sc[0] + sc[1]) + (sc[2] + sc[3]);
  } else {  // the last column tile: element by element (one tile of the row's)
    for (int c = 0; c < valid; ++c) m = fmaxf(m, to_float(at(c)));
    if (diff && m == HUGE_VALF) return partial::of_block(HUGE_VALF, 1.0f);
    if (Probs && m == -HUGE_VALF) {
      zero_row();
      return partial{};
    }
    const float shift = m * log2e;
    if constexpr (Probs) f = mult * fast_exp2((m - drop) * log2e);
    for (int c = 0; c < valid; ++c) {
      const float e = fast_exp2(fmaf(to_float(at(c)), log2e, -shift));
      s += e;
      if constexpr (Probs) *reinterpret_cast<__nv_bfloat16*>(&at(c)) = __float2bfloat16_rn(e * f);
    }
  }
  return partial::of_block(m + lift, s);
}

/// Whether the tiles of row-tile group `g` (row tiles g Cluster.. g Cluster + Cluster - 1) are left
/// out: a second pass (tile_flags given) takes only the groups holding a flagged row tile.
template <int Cluster, class I>
__device__ __forceinline__ bool group_skipped(const args<I>& a, int g, int row_tiles) {
  if (!a.tile_flags) return false;
  int any = 0;
#pragma unroll
  for (int r = 0; r < Cluster; ++r)
    if (g * Cluster + r < row_tiles) any |= a.tile_flags[g * Cluster + r];
  return any == 0;
}

/// One thread: the staged tile (m, n) leaves by four tensor stores of 64 columns (the parts past
/// the matrix are not written), and once they have read it, `staged_empty` hears that it may be
/// written again.
__device__ __forceinline__ void store_staged(const CUtensorMap* map, const unsigned char* staged,
                                             int m, int n, int cols,
                                             unsigned long long* staged_empty) {
  for (int b = 0; b < tile_n / 64 && n * tile_n + 64 * b < cols; ++b)
    tma_store_2d(map, n * tile_n + 64 * b, m * tile_m, staged + b * staged_block_bytes);
  bulk_stores_wait<0>();  // read
  mbarrier_arrive(staged_empty);
}

/// The statistics warps' named barrier (warps 1-3: 96 threads), before one of them stores the
/// scaled tile; barrier 0 is __syncthreads'.
__device__ __forceinline__ void stats_warps_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(stats_threads) : "memory");
}

/// The GEMM over every tile (form F: row partials, bf16 logits, or both with the logits scaled).
/// One CTA per SM. With Cluster 2, the two CTAs of a cluster take two neighbouring row tiles at
/// the same column tile and each loads half of the W tile into both by a multicast copy: half the
/// L2-to-shared traffic of W, for CTAs that wait on each other's stage releases.
template <form F, int Cluster, class I>
XENT_KERNEL void __launch_bounds__(threads, 1)
    stats_gemm_kernel(const __grid_constant__ CUtensorMap x_map,
                      const __grid_constant__ CUtensorMap w_map,
                      const __grid_constant__ CUtensorMap logits_map, args<I> a) {
  static_assert(Cluster == 1 || Cluster == 2, "a W tile's halves go to at most two CTAs");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // A second pass with nothing to do leaves at once: every CTA of a cluster reads the same count
  // before any barrier, so all of them leave together.
  if (a.flagged && *a.flagged == 0) return;
  extern __shared__ unsigned char smem_raw[];
  // Static shared memory only in this build: ready reads its presence.
  __shared__ unsigned long long full[stages], empty[stages], staged_full, staged_empty;
  // 1024-byte aligned stages: the swizzle's atoms.
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  auto stage_a = [&](int s) { return smem + s * stage_bytes; };
  auto stage_b = [&](int s) { return smem + s * stage_bytes + a_bytes; };
  unsigned char* const staged = smem + stages * stage_bytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbarrier_init(&full[s], 1);  // the producer's expect_tx; the copies' bytes
      // One arrival per consumer warp (wgmma waits are per warp) of every CTA of the cluster:
      // each CTA's W half lands in all of them.
      mbarrier_init(&empty[s], 8 * Cluster);
    }
    mbarrier_init(&staged_full, 256);  // every consumer thread, after its matrix stores
    // Every statistics thread after its reads, or the thread that stores the tile once its
    // tensor stores have read it.
    mbarrier_init(&staged_empty, F == form::stats ? stats_threads : 1);
    mbarrier_init_fence();
  }
  // The barriers are initialised before another CTA of the cluster arrives on them or copies.
  if constexpr (Cluster > 1)
    cluster_sync_all();
  else
    __syncthreads();

  // Tiles go by groups of Cluster row tiles (one per CTA of the cluster) and a column tile.
  const int row_tiles = (a.rows + tile_m - 1) / tile_m;
  const int groups = (row_tiles + Cluster - 1) / Cluster;
  const int tiles = groups * a.col_tiles;
  const int rank = static_cast<int>(blockIdx.x) % Cluster;
  const int first_tile = static_cast<int>(blockIdx.x) / Cluster,
            tile_step = static_cast<int>(gridDim.x) / Cluster;
  const int k_blocks = (a.depth + tile_k - 1) / tile_k;
  const int group = static_cast<int>(threadIdx.x) / 128;
  // Registers: setmaxnreg moves them within the CTA's own allocation (168 per thread, ptxas's
  // limit for 384 threads: 504 per warpgroup slot), so 64 + 2 x 216 = 496; asking for more
  // leaves the consumers' increase waiting forever.
  if (group == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 64;");
    if (threadIdx.x == 0) {
      int s = 0;
      unsigned phase = 0;
      for (int t = first_tile; t < tiles; t += tile_step) {
        int m, n;
        tile_at<Cluster>(t, groups, a.col_tiles, rank, m, n);
        if (group_skipped<Cluster>(a, m / Cluster, row_tiles)) continue;
        for (int kb = 0; kb < k_blocks; ++kb) {
          // A fresh barrier's "previous phase" is complete. With clusters, every CTA's consumers
          // have released the stage (their arrivals come from other SMs: cluster-scope acquire).
          mbarrier_wait<(Cluster > 1)>(&empty[s], phase ^ 1);
          mbarrier_arrive_expect(&full[s], stage_bytes);
          tma_load_2d(stage_a(s), &x_map, kb * tile_k, m * tile_m, &full[s]);
          if constexpr (Cluster > 1)
            tma_load_2d_multicast(stage_b(s) + rank * (b_bytes / Cluster), &w_map, kb * tile_k,
                                  n * tile_n + rank * (tile_n / Cluster), &full[s],
                                  static_cast<std::uint16_t>((1u << Cluster) - 1));
          else
            tma_load_2d(stage_b(s), &w_map, kb * tile_k, n * tile_n, &full[s]);
          if (++s == stages) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    } else if (threadIdx.x >= 32) {
      if constexpr (F != form::logits) {
        // Warps 1-3: thread i takes rows i and i + 96 of each tile.
        constexpr bool probs = F == form::probs;
        const int r = static_cast<int>(threadIdx.x) - 32;
        unsigned phase = 0;
        for (int t = first_tile; t < tiles; t += tile_step) {
          int m, n;
          tile_at<Cluster>(t, groups, a.col_tiles, rank, m, n);
          if (group_skipped<Cluster>(a, m / Cluster, row_tiles)) continue;
          const int col0 = n * tile_n;
          const int valid = a.cols - col0 < tile_n ? a.cols - col0 : tile_n;
          // Read while the tile is computed.
          std::int64_t target[2] = {-1, -1};  // this tile's only
          float ref[2] = {0.0f, 0.0f}, mult[2] = {1.0f, 1.0f};
          bool logits[2] = {false, false};
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = m * tile_m + r + stats_threads * h;
            if (r + stats_threads * h < tile_m && row < a.rows) {
              const auto y = static_cast<std::int64_t>(a.targets[row]);
              target[h] = y >= col0 && y < col0 + valid ? y - col0 : -1;
              if constexpr (probs) {
                ref[h] = a.ref[row];
                if (a.mult) mult[h] = a.mult[row];
                logits[h] = a.logit_rows && a.logit_rows[row];
              }
            }
          }
          mbarrier_wait(&staged_full, phase);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int in_tile = r + stats_threads * h, row = m * tile_m + in_tile;
            if (in_tile < tile_m && row < a.rows) {
              float z = 0.0f;
              partial p;
              if constexpr (probs) {
                p = logits[h]
                        ? staged_row<true>(staged, in_tile, valid, target[h], z, ref[h], mult[h])
                        : staged_row<true, __half>(staged, in_tile, valid, target[h], z, ref[h],
                                                   mult[h]);
              } else {
                p = staged_row<false>(staged, in_tile, valid, target[h], z, ref[h], mult[h]);
              }
              if (a.partials) a.partials[static_cast<std::int64_t>(row) * a.col_tiles + n] = p;
              if (target[h] >= 0 && a.target_logit) a.target_logit[row] = z;
            }
          }
          if constexpr (probs) {
            // The scaled tile leaves by tensor stores from one thread, once every statistics
            // thread's writes are visible to them.
            fence_async_shared();
            stats_warps_sync();
            if (r == 0) store_staged(&logits_map, staged, m, n, a.cols, &staged_empty);
          } else {
            mbarrier_arrive(&staged_empty);
          }
          phase ^= 1;
        }
        if (probs && r == 0) bulk_stores_wait<0, true>();  // written, before the CTA ends
      } else if (threadIdx.x == 32) {
        // The logits: each staged tile leaves by four tensor stores of 64 columns (the parts past
        // the matrix are not written), so the consumer warpgroups never wait on global stores.
        unsigned phase = 0;
        for (int t = first_tile; t < tiles; t += tile_step) {
          int m, n;
          tile_at<Cluster>(t, groups, a.col_tiles, rank, m, n);
          if (group_skipped<Cluster>(a, m / Cluster, row_tiles)) continue;
          mbarrier_wait(&staged_full, phase);
          store_staged(&logits_map, staged, m, n, a.cols, &staged_empty);
          phase ^= 1;
        }
        bulk_stores_wait<0, true>();  // written, before the CTA ends
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
    const int c = group - 1;  // rows 64 c .. 64 c + 63 of each tile
    const bool leader =
        threadIdx.x % 32 == 0;  // each warp releases a stage once its products are done
    float d[128];
    int s = 0;
    unsigned phase = 0, staged_phase = 0;
    // Releases stage `s` in every CTA of the cluster (each holds the other's W half).
    auto release = [](unsigned long long* bar) {
      if constexpr (Cluster > 1) {
        for (int r = 0; r < Cluster; ++r) mbarrier_arrive_in(bar, static_cast<unsigned>(r));
      } else {
        mbarrier_arrive(bar);
      }
    };
    for (int t = first_tile; t < tiles; t += tile_step) {
      int m, n;
      tile_at<Cluster>(t, groups, a.col_tiles, rank, m, n);
      if (group_skipped<Cluster>(a, m / Cluster, row_tiles)) continue;
      // form::probs: the references of this thread's two rows and whether they stage logits
      // (stage_tile), read while the tile's products run; a row past the matrix or of reference
      // +inf (whose P the statistics warps write as zeros) stages its values less 0.
      float ref[2] = {0.0f, 0.0f};
      bool logits[2] = {false, false};
      if constexpr (F == form::probs) {
        const int row = m * tile_m + 64 * c + 16 * (static_cast<int>(threadIdx.x) / 32 % 4) +
                        static_cast<int>(threadIdx.x) % 32 / 4;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool in = row + 8 * h < a.rows;
          const float r = in ? a.ref[row + 8 * h] : 0.0f;
          ref[h] = r == HUGE_VALF ? 0.0f : r;
          logits[h] = in && a.logit_rows && a.logit_rows[row + 8 * h];
        }
      }
      int held = -1;  // the stage whose products are still in flight
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbarrier_wait(&full[s], phase);
        const std::uint64_t da = smem_descriptor(stage_a(s) + c * (a_bytes / 2));
        const std::uint64_t db = smem_descriptor(stage_b(s));
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < tile_k / 16; ++k)  // 16 columns = 32 bytes = 2 descriptor units
          wgmma_m64n256k16(d, da + 2 * k, db + 2 * k, kb > 0 || k > 0);
        wgmma_commit();
        wgmma_wait<1>();  // the previous stage's products are done: release it
        fence_operands(d);
        if (held >= 0 && leader) release(&empty[held]);
        held = s;
        if (++s == stages) {
          s = 0;
          phase ^= 1;
        }
      }
      wgmma_wait<0>();
      fence_operands(d);
      if (held >= 0 && leader) release(&empty[held]);
      // The statistics warps (or the storing thread) finished the previous tile long ago (they
      // need a few percent of a main loop's time), so this wait rarely waits.
      mbarrier_wait(&staged_empty, staged_phase ^ 1);
      stage_tile<F == form::probs>(d, staged, c, ref, logits);
      // The tensor stores read what stmatrix wrote (form::probs: after the statistics warps'
      // rewrite, which they fence themselves).
      if constexpr (F == form::logits) fence_async_shared();
      mbarrier_arrive(&staged_full);
      staged_phase ^= 1;
    }
  }
  // No CTA leaves while another of its cluster may still copy into its stages or arrive on its
  // barriers.
  if constexpr (Cluster > 1) cluster_sync_all();
#else
  (void)x_map;
  (void)w_map;
  (void)logits_map;
  (void)a;
#endif
}

/// Row outputs of a launch's rows from their partials, one warp per row, by the core's own pieces:
/// each lane merges its partials (online_lse), the lanes by warp_merge, the loss by class_row_loss
/// (weights and z-loss; no smoothing or softcap on this path), the outputs by write_row_outputs,
/// and an ignored or out-of-range row by write_skipped_row. `a` holds the launch's rows (rows,
/// targets and outputs offset to them), no reduced outputs.
template <class T, class G, class Tgt>
XENT_KERNEL void merge_kernel(row_args<T, G, Tgt> a, const partial* partials,
                              const float* target_logit, int col_tiles) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t row = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (row >= a.rows) return;
  const auto y = static_cast<std::int64_t>(a.targets.ids[row]);
  if (skipped_target(a, y)) {
    if (lane == 0) write_skipped_row(a, row, y != a.ignore_index, true, false);
    return;
  }
  online_lse acc;
  for (int i = lane; i < col_tiles; i += 32) acc.merge(partials[row * col_tiles + i]);
  row_partial r;
  r.lse = acc;
  r = warp_merge<32>(r);
  if (lane == 0) {
    r.target_logit = target_logit[row];
    write_row_outputs(a, row, class_row_loss(r, a.weights ? a.weights[y] : 1.0f, a.k), r.lse.lse(),
                      -1, false, false);
  }
}

}  // namespace stats_gemm
}  // namespace cuda_detail
}  // namespace xent
