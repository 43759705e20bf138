// The pieces of a Hopper (sm_90a) GEMM kernel: tensor maps and copies (TMA), wgmma's shared-memory
// descriptor and its m64n256k16 form, and its fences; the fused linear forward's statistics GEMM
// (stats_gemm.cuh) is built from them. The instructions exist only in sm_90a code
// (__CUDA_ARCH_FEAT_SM90_ALL); elsewhere the bodies are empty and no kernel reaches them. Included
// only by nvcc.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../../error.hpp"
#include "async_copy.cuh"

namespace xent {
namespace cuda_detail {
namespace hopper {

/// A 2-D tensor copy of the box at (column c0, row c1) of `map` into shared memory, counted on
/// `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            unsigned long long* bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(shared_address(bar))
      : "memory");
#else
  (void)dst;
  (void)map;
  (void)c0;
  (void)c1;
  (void)bar;
#endif
}

/// A 2-D tensor copy of a box in shared memory to (column c0, row c1) of `map`, committed as a
/// bulk group of its own (bulk_stores_wait waits for it); the box's parts outside the tensor are
/// not written. The writers of the box fenced it to the async proxy (fence_async_shared) and met
/// the issuing thread at a barrier first.
__device__ __forceinline__ void tma_store_2d([[maybe_unused]] const CUtensorMap* map,
                                             [[maybe_unused]] int c0, [[maybe_unused]] int c1,
                                             [[maybe_unused]] const void* src) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(shared_address(src))
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

/// tma_load_2d into the same shared-memory offset of every CTA of the cluster in `mask`, each
/// copy counted on the mbarrier at `bar`'s offset in that CTA.
__device__ __forceinline__ void tma_load_2d_multicast([[maybe_unused]] void* dst,
                                                      [[maybe_unused]] const CUtensorMap* map,
                                                      [[maybe_unused]] int c0,
                                                      [[maybe_unused]] int c1,
                                                      [[maybe_unused]] unsigned long long* bar,
                                                      [[maybe_unused]] std::uint16_t mask) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
      "cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(shared_address(bar)),
      "h"(mask)
      : "memory");
#endif
}

/// Every thread of every CTA of the cluster. Not .aligned: a producer thread may arrive apart
/// from the rest of its warp.
__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
#endif
}

/// The wgmma descriptor of a K-major tile in shared memory as the tensor copy's 128-byte swizzle
/// lays it out: rows of 128 bytes, 8-row atoms 1024 bytes apart (the stride byte offset).
__device__ __forceinline__ std::uint64_t smem_descriptor(const void* p) {
  const std::uint64_t addr = shared_address(p);
  return ((addr & 0x3FFFF) >> 4) | (std::uint64_t{1} << 16) | (std::uint64_t{1024 >> 4} << 32) |
         (std::uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

/// Keeps the accumulators' registers live across wgmma's asynchronous writes (the compiler may
/// not move their uses before wgmma_wait).
__device__ __forceinline__ void fence_operands(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/// D (64 x 256, float) += A (64 x 16, bf16, K-major) * B (256 x 16, bf16, K-major)^T, both
/// from shared memory; `accumulate` 0 overwrites D.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], std::uint64_t desc_a,
                                                 std::uint64_t desc_b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, "
      "%63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, "
      "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, "
      "%99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, "
      "%114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, "
      "%129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#else
  (void)d;
  (void)desc_a;
  (void)desc_b;
  (void)accumulate;
#endif
}

/// A 2-D tensor map of a row-major bf16 matrix (rows x cols, leading dimension ld elements) in
/// boxes of box_rows x 64 (128 bytes), 128-byte swizzled; rows and columns past the matrix read as
/// zeros. `arg`: the argument an error names.
inline CUtensorMap make_map(const char* fn, const char* arg, const void* p, std::int64_t rows,
                            std::int64_t cols, std::int64_t ld, int box_rows) {
  static const auto encode = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                           cudaEnableDefault, &q);
    return e == cudaSuccess && q == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f)
               : nullptr;
  }();
  if (!encode) throw error(fn, arg, "cuTensorMapEncodeTiled is missing from the CUDA driver");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r =
      encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(p), dims, strides, box,
             elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw error(fn, arg,
                "cuTensorMapEncodeTiled refused a " + std::to_string(rows) + " x " +
                    std::to_string(cols) + " operand (CUresult " + std::to_string(r) + ")");
  return map;
}

}  // namespace hopper
}  // namespace cuda_detail
}  // namespace xent
