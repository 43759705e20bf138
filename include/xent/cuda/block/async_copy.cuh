// Copies from global into shared memory that run while the CTA computes, and the mbarriers that
// say when they have landed. Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include "../tuning/policy.cuh"

namespace xent {
namespace cuda_detail {

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

/// cp.async of 16 bytes of which the first `src_bytes` are read and the rest zero-filled, so
/// nothing past a row's end is read. The source size is a register operand: the intrinsic's
/// constant form branched nine ways per vector.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(src_bytes)
               : "memory");
}

/// cp.async of 4 or 8 bytes (a target id, a saved LSE), tracked like the copies above.
template <int Bytes>
__device__ __forceinline__ void copy_small_async(void* dst, const void* src) {
  static_assert(Bytes == 4 || Bytes == 8, "cp.async.ca moves 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "n"(Bytes)
               : "memory");
}

// mbarriers and bulk copies. The bulk copy, expect_tx and try_wait are sm_90 instructions: below
// sm_90 their bodies are empty and no kernel reaches them. A phase of a "landed" barrier completes
// when its one arrival (the issuing thread's expect_tx) is in, every byte announced has been
// written by the bulk copy, and every cp.async the issuing thread tied to it has completed.

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals)
               : "memory");
}

/// Makes mbarrier initialisation visible to the async proxy and to the cluster; a CTA or
/// cluster barrier must follow before any use.
__device__ __forceinline__ void mbarrier_init_fence() {
#if XENT_CUDA_SM90_PTX
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
  asm volatile(
      "{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" ::"r"(shared_address(bar))
      : "memory");
}

/// Arrives on the mbarrier at `bar`'s offset in cluster CTA `rank` (sm_90), with the default
/// semantics (CUTLASS's ClusterBarrier does the same: the cluster-scope release form costs a
/// MEMBAR.ALL.GPU per arrive).
__device__ __forceinline__ void mbarrier_arrive_in([[maybe_unused]] unsigned long long* bar,
                                                   [[maybe_unused]] unsigned rank) {
#if XENT_CUDA_SM90_PTX
  unsigned addr = shared_address(bar);
  asm volatile("mapa.shared::cluster.u32 %0, %0, %1;" : "+r"(addr) : "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(addr) : "memory");
#endif
}

/// Arrives and announces `bytes` of transactions still to land in this phase.
__device__ __forceinline__ void mbarrier_arrive_expect(unsigned long long* bar, unsigned bytes) {
#if XENT_CUDA_SM90_PTX
  asm volatile(
      "{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }" ::"r"(
          shared_address(bar)),
      "r"(bytes)
      : "memory");
#else
  (void)bar;
  (void)bytes;
#endif
}

/// Ties every cp.async this thread issued so far to the barrier's current phase: the phase
/// cannot complete before they land (the pending count rises now and falls when they do).
__device__ __forceinline__ void mbarrier_track_copies(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(shared_address(bar))
               : "memory");
}

/// Waits until the phase of parity `parity` has completed, with acquire semantics at CTA scope
/// (copies into this CTA) or at cluster scope (`Cluster`: stores from other CTAs of the cluster).
template <bool Cluster = false>
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
#if XENT_CUDA_SM90_PTX
  const unsigned addr = shared_address(bar);
  unsigned done = 0;
  while (!done) {
    if constexpr (Cluster)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; "
          "selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(addr), "r"(parity)
          : "memory");
    else
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
          "selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(addr), "r"(parity)
          : "memory");
  }
#else
  (void)bar;
  (void)parity;
#endif
}

/// One bulk copy (the TMA's 1-D form) of `bytes` (a multiple of 16; both addresses 16-byte
/// aligned) that counts its bytes on `bar`: one instruction moves a whole chunk, where cp.async
/// took one per 16 bytes and per thread, with their address arithmetic.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
#if XENT_CUDA_SM90_PTX
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
#else
  (void)dst;
  (void)src;
  (void)bytes;
  (void)bar;
#endif
}

/// One bulk copy from this CTA's shared memory to global memory (`bytes` a multiple of 16, both
/// addresses 16-byte aligned), committed as a group of its own: a CTA's stores of a tile leave as
/// one transfer, which on an H200 streams closer to the copy roof than 16-byte stores from
/// registers. The writer threads fence their
/// shared-memory stores to the async proxy (fence_async_shared) and meet at a barrier first.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes) {
#if XENT_CUDA_SM90_PTX
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(shared_address(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#else
  (void)dst;
  (void)src;
  (void)bytes;
#endif
}

/// The 16-byte vectors of a staged tile of `count` elements that bulk copies move, [first,
/// whole): every whole vector, but, where rows are cut at their own 16-byte boundaries
/// (`Shifted`: lead_of) and the tile starts `lead` elements before its row, the first, which
/// thread 0 moves element by element from the lead-th, so no copy touches another row's bytes;
/// none where a shifted row's tile holds no element (count <= 0).
template <int Vec, bool Shifted>
__device__ __forceinline__ void bulk_span(int count, int lead, int& first, int& whole) {
  whole = !Shifted || count > 0 ? count / Vec * Vec : 0;
  first = Shifted && lead > 0 ? (Vec < whole ? Vec : whole) : 0;
}

/// Thread 0: a staged tile of `count` elements to `out` (16-byte aligned): [first, whole) by one
/// bulk copy (bulk_span), the lead's vector from its lead-th element and the elements past the
/// whole vectors one by one. The writers of the stage fenced and met at a barrier first.
template <bool Shifted, class G>
__device__ __forceinline__ void store_row_tile(G* out, const G* from, int count, int lead) {
  int first, whole;
  bulk_span<16 / static_cast<int>(sizeof(G)), Shifted>(count, lead, first, whole);
  if (whole > first)
    bulk_store(out + first, from + first, static_cast<unsigned>((whole - first) * sizeof(G)));
  for (int e = lead; e < first; ++e) out[e] = from[e];
  for (int e = Shifted && whole < lead ? lead : whole; e < count; ++e) out[e] = from[e];
}

/// Waits until at most N of this thread's bulk stores still read shared memory (`Done`: until at
/// most N are still in flight at all).
template <int N, bool Done = false>
__device__ __forceinline__ void bulk_stores_wait() {
#if XENT_CUDA_SM90_PTX
  if constexpr (Done)
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
  else
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
#endif
}

/// Makes this thread's shared-memory stores visible to bulk copies (the async proxy).
__device__ __forceinline__ void fence_async_shared() {
#if XENT_CUDA_SM90_PTX
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

}  // namespace cuda_detail
}  // namespace xent
