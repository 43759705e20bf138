// Merging a row's partial statistics: across the lanes of a warp, the warps of a CTA and the CTAs
// of a cluster. Included only by nvcc.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstring>

#include "../../loss_math.hpp"
#include "../tuning/policy.cuh"
#include "async_copy.cuh"

namespace xent {
namespace cuda_detail {

/// Exchanges a trivially copyable partial with the lane `mask` away, word by word.
template <class P>
__device__ __forceinline__ P shuffle_xor(const P& v, int mask) {
  static_assert(sizeof(P) % 4 == 0, "partials are whole words");
  int w[sizeof(P) / 4];
  memcpy(w, &v, sizeof(P));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(P) / 4); ++i)
    w[i] = __shfl_xor_sync(0xffffffffu, w[i], mask);
  P r;
  memcpy(&r, w, sizeof(P));
  return r;
}

/// Lane 0's value in every lane of the warp.
template <class P>
__device__ __forceinline__ P shuffle_from_lane0(const P& v) {
  int w[sizeof(P) / 4];
  memcpy(w, &v, sizeof(P));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(P) / 4); ++i)
    w[i] = __shfl_sync(0xffffffffu, w[i], 0);
  P r;
  memcpy(&r, w, sizeof(P));
  return r;
}

/// Merge over groups of `Width` lanes (a power of two up to 32), a butterfly: every lane ends
/// with the merge of its group, the same bits in all of them (a merge is commutative bit for bit:
/// max, and sums of two terms).
template <int Width = 32, class P>
__device__ __forceinline__ P warp_merge(P v) {
#pragma unroll
  for (int mask = Width / 2; mask > 0; mask >>= 1) v.merge(shuffle_xor(v, mask));
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
  return v;
}

template <int Width = 32, class V>
__device__ __forceinline__ V warp_sum(V v) {  // float or double
#pragma unroll
  for (int mask = Width / 2; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

/// The same merge for row statistics without side outputs, max first: one shuffle per level for
/// the max, then the sums rescaled to it once (2^x on the special-function unit, ~2 ulp) and
/// added, where the general merge took two accurate exponentials per level.
template <int Width>
__device__ __forceinline__ row_partial warp_merge(row_partial v) {
  float m = v.lse.max;
#pragma unroll
  for (int mask = Width / 2; mask > 0; mask >>= 1)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, mask));
  float s = v.lse.sum;
  if (v.lse.max != m)  // an empty part (-inf) adds 0; NaN sums stay NaN
    s = v.lse.max == -HUGE_VALF ? 0.0f : s * exp2f((v.lse.max - m) * 1.4426950408889634f);
  row_partial r;
  r.lse = online_lse::of_block(m, warp_sum<Width>(s));
  r.target_logit = warp_sum<Width>(v.target_logit);
  r.dot = warp_sum<Width>(v.dot);
  r.mass = warp_sum<Width>(v.mass);
  return r;
}

/// Where a row's partials meet: each warp's, then each CTA's of the cluster. Warp partials and
/// results alternate between two slots (row parity); cluster slots and their mbarriers cycle
/// through four sets, so a CTA may send row i + 1's partial before it has received row i's
/// (see row_exchange).
template <class P, int Warps>
struct row_exchange_state {
  P warp_parts[2][Warps];
  P result[2];
  P slots[4][policy::cluster_max];
  unsigned long long arrived[4];
};

/// Round a count up to a power of two (the widths of the merges below).
__host__ __device__ constexpr int pow2_at_least(int n) {
  return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2);
}

#if XENT_CUDA_SM90_PTX
/// `Words` 32-bit words into `dst` in CTA `to` of the cluster (dst and `bar` name this CTA's
/// shared memory; the same offsets in CTA `to` are written): st.async stores count their bytes
/// on the receiver's mbarrier, so it learns of them without a cluster barrier or a memory fence.
template <int Words>
__device__ inline void push_words(void* dst, const unsigned (&w)[Words], unsigned long long* bar,
                                  int to) {
  unsigned slot = shared_address(dst);
  unsigned mbar = shared_address(bar);
  asm volatile("mapa.shared::cluster.u32 %0, %0, %1;" : "+r"(slot) : "r"(to));
  asm volatile("mapa.shared::cluster.u32 %0, %0, %1;" : "+r"(mbar) : "r"(to));
#pragma unroll
  for (int i = 0; i < Words; ++i)
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                     slot + 4 * i),
                 "r"(w[i]), "r"(mbar)
                 : "memory");
}

/// This CTA's partial into slot `from` of set `set` in CTA `to`.
template <class P, int Warps>
__device__ inline void send_partial(row_exchange_state<P, Warps>& x, int set, const P& v, int from,
                                    int to) {
  unsigned w[sizeof(P) / 4];
  memcpy(w, &v, sizeof(P));
  push_words(&x.slots[set][from], w, &x.arrived[set], to);
}

/// Arms this CTA's mbarrier of `set` for `bytes` incoming and waits (acquire at cluster scope)
/// for the phase of parity `parity`.
template <class P, int Warps>
__device__ inline void await_partials(row_exchange_state<P, Warps>& x, int set, unsigned bytes,
                                      unsigned parity) {
  mbarrier_arrive_expect(&x.arrived[set], bytes);
  mbarrier_wait<true>(&x.arrived[set], parity);
}
#endif

/// A row's statistics merged over the CTA and the cluster, in steps that let a CTA overlap one
/// row's cluster round trip with the next row's sweeps:
///   publish (every warp, lane 0) -> barrier -> send (warp 0: merges the warps, pushes the CTA's
///   partial to every rank) ... receive (warp 0: waits for every rank's partial of that row,
///   merges them in a fixed tree into `result`) -> barrier -> result (every thread).
/// The barriers may be named producer/consumer ones (bar.arrive / bar.sync) so that only warp 0
/// waits for the partials and only the gradient waits for the result.
/// Every thread of every CTA of the row gets the same bits. Row `exchange` (rows that crossed the
/// cluster so far) uses cluster set exchange % 4: a CTA sends into a set again four rows later,
/// after it has received the rows in between from every rank, which each rank sends only after
/// reading its own slots of the set's previous use.
template <class P, int Block>
struct row_exchange {
  static constexpr int warps = Block / 32;
  static_assert(warps <= 32, "one warp merges the warps");
  row_exchange_state<P, warps>& x;
  int cluster_size;

  /// Sets up the mbarriers (one arrival per phase: this CTA's own expect_tx), thread 0; the caller
  /// fences and syncs the cluster before the first row (mbarrier_init_fence).
  __device__ void init() {
    for (int s = 0; s < 4; ++s) mbarrier_init(&x.arrived[s], 1);
  }
  __device__ void publish(const P& warp_total, int slot) {
    if (threadIdx.x % 32 == 0) x.warp_parts[slot][threadIdx.x / 32] = warp_total;
  }
  /// Warp 0, after the barrier that follows publish.
  __device__ void send(int slot, int exchange) {
    const int lane = threadIdx.x % 32;
    // Lanes 0..warps-1 merge; lane 0's result goes to every lane, since lane r sends to rank r.
    const P block = shuffle_from_lane0(
        warp_merge<pow2_at_least(warps)>(lane < warps ? x.warp_parts[slot][lane] : P{}));
#if XENT_CUDA_SM90_PTX
    if (cluster_size > 1) {
      const int rank = static_cast<int>(cooperative_groups::this_cluster().block_rank());
      if (lane < cluster_size) send_partial(x, exchange % 4, block, rank, lane);
      return;
    }
#endif
    (void)exchange;
    if (lane == 0) x.result[slot] = block;
    __syncwarp();  // the warp may read the result next
  }
  /// Warp 0: the row sent as `exchange` from slot `slot`, into result[slot].
  __device__ void receive(int slot, int exchange) {
#if XENT_CUDA_SM90_PTX
    if (cluster_size > 1) {
      const int lane = threadIdx.x % 32, set = exchange % 4;
      if (lane == 0)
        await_partials(x, set, static_cast<unsigned>(cluster_size * sizeof(P)),
                       static_cast<unsigned>(exchange / 4) & 1u);
      __syncwarp();  // lane 0 saw the phase complete; its acquire covers the warp after this
      asm volatile("fence.acq_rel.cta;" ::: "memory");
      const P row = warp_merge<policy::cluster_max>(lane < cluster_size ? x.slots[set][lane] : P{});
      if (lane == 0) x.result[slot] = row;
      __syncwarp();  // the warp may read the result next
    }
#else
    (void)slot;
    (void)exchange;
#endif
  }
  /// Every thread, after the barrier that follows receive.
  __device__ P result(int slot) const { return x.result[slot]; }
};

/// Named barriers (ids 1..15; __syncthreads is 0) for producer/consumer hand-offs inside a CTA:
/// producers arrive without waiting, consumers wait until `threads` have arrived or waited. The
/// id is a compile-time constant, so the kernel reserves only the barriers it names.
template <int Id>
__device__ __forceinline__ void named_barrier_sync(int threads) {
  asm volatile("bar.sync %0, %1;" ::"n"(Id), "r"(threads) : "memory");
}
template <int Id>
__device__ __forceinline__ void named_barrier_arrive(int threads) {
  asm volatile("bar.arrive %0, %1;" ::"n"(Id), "r"(threads) : "memory");
}

/// Row `i`'s parts handed over inside a CTA of `Block` threads by named barrier First + i % 2: the
/// consumer waits for them, the producers arrive and move on. Without split barriers
/// (policy::split_barriers: the sanitizer build) a full CTA barrier.
template <int First, int Block, bool Split>
__device__ __forceinline__ void parity_handoff(long long i, bool consumer) {
  if (!Split)
    __syncthreads();
  else if (consumer)
    i & 1 ? named_barrier_sync<First + 1>(Block) : named_barrier_sync<First>(Block);
  else
    i & 1 ? named_barrier_arrive<First + 1>(Block) : named_barrier_arrive<First>(Block);
}

}  // namespace cuda_detail
}  // namespace xent
