// Fused linear training's d_weight GEMM on Hopper (sm_90a): acc (V x D, float) = or += G_cᵀ · X_c
// for one chunk of rows, G_c (rows x V, bf16: the chunk's logit gradient) and X_c (rows x D,
// bf16) both row-major. Every chunk's GEMM reads and writes the whole float accumulator (8 V D
// bytes): cuBLAS's epilogue does that while the tensor cores wait (3.5 ms a chunk at V = 256000,
// D = 2304 and 2048 rows on an H200, against 3.0 for the same products written once in bf16;
// accumulate_gemm.cuh). Here the epilogue hands each tile to the tensor memory accelerator as an
// add into the accumulator (cp.reduce.async.bulk.tensor ... add: the L2 adds), and the warps go on
// to the next tile's products while it drains. One add per element per chunk, chunks in stream
// order: the sums are the same run to run. Included only by nvcc (cuda/linear.cuh).
//
// The kernel: persistent CTAs (one per SM) of three warpgroups, as stats_gemm.cuh. Warpgroup 0's
// first thread loads, for each 64-row k-block, G's 64 rows x 128 weight rows and X's 64 rows x 192
// columns by tensor copies (128-byte swizzle; both operands MN-major, which wgmma reads with its
// transpose bits) into three stages; warpgroups 1 and 2 each multiply 64 of the tile's 128 weight
// rows by its 192 columns (wgmma m64n192k16). At a tile's end each consumer warpgroup stages its
// 64 x 192 floats (48 KiB) and its first thread issues six 32-column tensor adds (or stores, for
// the first chunk), read out while the next tile is computed. Tiles walk a weight row tile's
// D / 192 column tiles in turn, so the CTAs in flight share G's tiles in L2; X_c (9.4 MB at 2048
// x 2304) stays in L2 throughout.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend.cuh"
#include "wgmma.cuh"

namespace xent {
namespace cuda_detail {
namespace dw_gemm {

using namespace hopper;

/// 128 x 192 tiles: the stages and a whole tile's staging fit beside each other (3 x 40 KiB + 2 x
/// 48 KiB), so a tile's adds drain while the next tile is computed. With 128 x 256 tiles only half
/// a tile fitted beside three stages, and each warpgroup waited in its epilogue until the tensor
/// copies had read the first half: adds 4.57 ms against 3.75 for stores of the same tiles at
/// V = 256000, D = 2304, 2048 rows (H200, 5850231).
constexpr int tile_m = 128, tile_n = 192, tile_k = 64, stages = 3;
constexpr int threads = 384;  // producer warpgroup, two consumer warpgroups
/// Operand boxes: 64 elements of M (or N), 128 bytes, by the k-block's 64 rows.
constexpr int box = 64, box_bytes = box * tile_k * 2;
constexpr int a_bytes = tile_m * tile_k * 2, b_bytes = tile_n * tile_k * 2;
constexpr int stage_bytes = a_bytes + b_bytes;
/// The epilogue's boxes: 32 floats (128 bytes, the swizzle's row) by a warpgroup's 64 rows, six
/// to a warpgroup's 64 x 192 products.
constexpr int out_cols = 32, out_box_bytes = 64 * out_cols * 4, out_boxes = tile_n / out_cols;
constexpr int staging_bytes = out_boxes * out_box_bytes;
constexpr int acc_regs = tile_n / 2;  // wgmma's accumulators per consumer thread
constexpr int smem_bytes = stages * stage_bytes + 2 * staging_bytes + 1024;  // + the alignment
static_assert(smem_bytes + 128 <= 227 * 1024, "sm_90's shared memory per CTA (static included)");

/// The launch's sizes: acc is m x n (V x D), the inner sums k (the chunk's rows) long; `add`:
/// add into acc (else overwrite it).
struct args {
  int m, n, k;
  bool add;
};

/// One consumer warpgroup's epilogue: its 64 x 192 products (wgmma's accumulator layout: thread
/// lane of warp w holds rows 16 w + lane / 4 and + 8, columns 8 j + 2 (lane % 4) + {0, 1} in
/// d[4 j + {0, 1}] and d[4 j + {2, 3}]) to acc rows row0.., columns col0.., through `staging`: six
/// boxes of 64 rows x 32 floats in the tensor copy's 128-byte swizzle (16-byte chunk c of row r at
/// chunk c ^ (r % 8): a warp's eight rows of float2 stores fall in distinct banks, two wavefronts
/// for its 256 bytes). Thread 0 of the warpgroup issues the copies; before the staging is written
/// again, a tile later, it waits until they have read it.
__device__ __forceinline__ void add_tile(const float (&d)[acc_regs], unsigned char* staging,
                                         const CUtensorMap* acc_map, int row0, int col0, int cols,
                                         bool add, int barrier) {
  const int t = static_cast<int>(threadIdx.x) % 128, lane = t % 32, warp = t / 32;
  const int r = 16 * warp + lane / 4;
  if (t == 0) bulk_stores_wait<0>();  // the previous tile's copies have read the staging
  named_barrier_sync(barrier, 128);
#pragma unroll
  for (int j = 0; j < tile_n / 8; ++j) {
    unsigned char* out = staging + (j / 4) * out_box_bytes;
    const int chunk = 2 * (j % 4) + (lane % 4) / 2;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = r + 8 * e;
      *reinterpret_cast<float2*>(out + row * 128 + ((chunk ^ (row & 7)) << 4) + 8 * (lane % 2)) =
          make_float2(d[4 * j + 2 * e], d[4 * j + 2 * e + 1]);
    }
  }
  fence_async_shared();
  named_barrier_sync(barrier, 128);
  if (t == 0) {
#pragma unroll
    for (int b = 0; b < out_boxes; ++b) {
      const int col = col0 + out_cols * b;
      if (col >= cols) break;  // past D: the tensor copy would write nothing
      if (add)
        tma_store_2d<true>(acc_map, col, row0, staging + b * out_box_bytes);
      else
        tma_store_2d<false>(acc_map, col, row0, staging + b * out_box_bytes);
    }
    bulk_commit();
  }
}

/// acc (a.m x a.n) = or += Gᵀ X over every 128 x 192 tile. One CTA per SM. AB: the operands'
/// dtype, bf16 (the wgmma form here); a template so that the header may be included anywhere.
template <class AB>
__global__ void __launch_bounds__(threads, 1)
    dw_gemm_kernel(const __grid_constant__ CUtensorMap g_map,
                   const __grid_constant__ CUtensorMap x_map,
                   const __grid_constant__ CUtensorMap acc_map, args a) {
  static_assert(std::is_same<AB, __nv_bfloat16>::value, "the wgmma form here is bf16's");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  // Static shared memory only in this build: ready() reads its presence.
  __shared__ unsigned long long full[stages], empty[stages];
  // 1024-byte aligned stages and staging: the swizzle's atoms.
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  auto stage_a = [&](int s) { return smem + s * stage_bytes; };
  auto stage_b = [&](int s) { return smem + s * stage_bytes + a_bytes; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbarrier_init(&full[s], 1);   // the producer's expect_tx; the copies' bytes
      mbarrier_init(&empty[s], 8);  // one arrival per consumer warp
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  const int m_tiles = (a.m + tile_m - 1) / tile_m, n_tiles = (a.n + tile_n - 1) / tile_n;
  const int tiles = m_tiles * n_tiles;
  const int k_blocks = (a.k + tile_k - 1) / tile_k;
  const int group = static_cast<int>(threadIdx.x) / 128;
  // Registers as in stats_gemm.cuh: 64 + 2 x 216 within the CTA's 504 per warpgroup slot.
  if (group == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 64;");
    if (threadIdx.x == 0) {
      int s = 0;
      unsigned phase = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int m0 = t / n_tiles * tile_m, n0 = t % n_tiles * tile_n;
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbarrier_wait(&empty[s], phase ^ 1);  // a fresh barrier's "previous phase" is complete
          mbarrier_arrive_expect(&full[s], stage_bytes);
          // Rows past the chunk and columns past V or D read as zeros: they add nothing.
#pragma unroll
          for (int q = 0; q < tile_m / box; ++q)
            tma_load_2d(stage_a(s) + q * box_bytes, &g_map, m0 + box * q, kb * tile_k, &full[s]);
#pragma unroll
          for (int q = 0; q < tile_n / box; ++q)
            tma_load_2d(stage_b(s) + q * box_bytes, &x_map, n0 + box * q, kb * tile_k, &full[s]);
          if (++s == stages) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
    const int c = group - 1;  // weight rows 64 c .. 64 c + 63 of each tile
    const bool leader = threadIdx.x % 32 == 0;
    unsigned char* const staging = smem + stages * stage_bytes + c * staging_bytes;
    float d[acc_regs];
    int s = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int m0 = t / n_tiles * tile_m, n0 = t % n_tiles * tile_n;
      int held = -1;  // the stage whose products are still in flight
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbarrier_wait(&full[s], phase);
        // A: this warpgroup's box of G (64 weight rows); B: X's three boxes of 64 columns.
        const std::uint64_t da = smem_descriptor_mn(stage_a(s) + c * box_bytes, box_bytes);
        const std::uint64_t db = smem_descriptor_mn(stage_b(s), box_bytes);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < tile_k / 16; ++k)  // 16 rows = two 1024-byte atoms = 128 units
          wgmma_m64n192k16<1, 1>(d, da + 128 * k, db + 128 * k, kb > 0 || k > 0);
        wgmma_commit();
        wgmma_wait<1>();  // the previous stage's products are done: release it
        fence_operands(d);
        if (held >= 0 && leader) mbarrier_arrive(&empty[held]);
        held = s;
        if (++s == stages) {
          s = 0;
          phase ^= 1;
        }
      }
      wgmma_wait<0>();
      fence_operands(d);
      if (held >= 0 && leader) mbarrier_arrive(&empty[held]);
      add_tile(d, staging, &acc_map, m0 + 64 * c, n0, a.n, a.add, 1 + c);
    }
    // The last tile's copies have finished before the CTA's shared memory goes.
    if (threadIdx.x % 128 == 0) bulk_stores_wait<0, true>();
  }
#else
  (void)g_map;
  (void)x_map;
  (void)acc_map;
  (void)a;
#endif
}

/// Whether this build runs the GEMM on device `dev` (its sm_90a body, which alone has static
/// shared memory, and the dynamic shared memory granted; as stats_gemm::ready).
inline bool ready(int dev) {
  const auto kernel = reinterpret_cast<const void*>(dw_gemm_kernel<__nv_bfloat16>);
  cudaFuncAttributes attr{};
  return prepare_cluster_kernel(kernel, dev, smem_bytes) &&
         cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.sharedSizeBytes > 0;
}

/// Whether the operands suit the tensor copies: 16-byte aligned addresses and row pitches (the
/// caller checks sizes against int).
inline bool fits(const void* g, std::int64_t ldg, const void* x, std::int64_t ldx, const float* acc,
                 std::int64_t ld_acc) {
  return aligned16(g, ldg * 2) && aligned16(x, ldx * 2) && aligned16(acc, ld_acc * 4);
}

/// Enqueues acc (m x n floats, leading dimension ld_acc) = (or, `add`, +=) Gᵀ X with G k x m
/// (leading dimension ldg) and X k x n (ldx), bf16, one CTA per SM; ready(device) and fits(...)
/// must hold, and k >= 1.
inline void launch(const char* fn, const __nv_bfloat16* g, std::int64_t ldg, const __nv_bfloat16* x,
                   std::int64_t ldx, float* acc, std::int64_t ld_acc, const args& a, int sms,
                   cudaStream_t stream) {
  const CUtensorMap gm =
      make_map(fn, "d_weight", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, g, a.k, a.m, ldg, box, tile_k);
  const CUtensorMap xm =
      make_map(fn, "hidden", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x, a.k, a.n, ldx, box, tile_k);
  const CUtensorMap am = make_map(fn, "d_weight", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, acc, a.m, a.n,
                                  ld_acc, out_cols, 64);
  const int tiles = (a.m + tile_m - 1) / tile_m * ((a.n + tile_n - 1) / tile_n);
  const int grid = tiles < sms ? tiles : sms;
  dw_gemm_kernel<__nv_bfloat16><<<grid, threads, smem_bytes, stream>>>(gm, xm, am, a);
  check_cuda(fn, cudaGetLastError());
}

}  // namespace dw_gemm
}  // namespace cuda_detail
}  // namespace xent
