// Warp-level tensor-core pieces (sm_80 and later): ldmatrix into mma.sync's m16n8k16 fragments,
// plain or transposed, the bf16 / fp16 mma itself, and cp.async's group fences. The sparse
// backward's tile GEMM (kernels/sparse_gemm_kernel.cuh) is built from them: its operands come in
// both majors, and ldmatrix's .trans form reads either from one shared-memory layout. Below sm_80
// the bodies are empty and no kernel reaches them. Included only by nvcc.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "async_copy.cuh"

namespace xent {
namespace cuda_detail {
namespace warp_mma {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define XENT_WARP_MMA 1
#else
#define XENT_WARP_MMA 0
#endif

/// Four 8 x 8 matrices of 16-bit elements: lanes 8i to 8i + 7 give matrix i's row addresses.
/// `Trans` loads each transposed.
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#if XENT_WARP_MMA
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0;
#endif
}

/// D (16 x 8, float) += A (16 x 16) * B (16 x 8) in T (bf16 or fp16), fragments as mma.sync's
/// row.col form holds them.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2]) {
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                "mma.sync m16n8k16 takes bf16 or fp16");
#if XENT_WARP_MMA
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  (void)d;
  (void)a;
  (void)b;
#endif
}

/// Closes the group of this thread's cp.async copies issued since the last commit.
__device__ __forceinline__ void copies_commit() {
#if XENT_WARP_MMA
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

/// Waits until at most `Pending` of this thread's committed groups are still in flight.
template <int Pending>
__device__ __forceinline__ void copies_wait() {
#if XENT_WARP_MMA
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
#endif
}

}  // namespace warp_mma
}  // namespace cuda_detail
}  // namespace xent
