// Diagnostics for the small-batch kernel (XENT_CUDA_SMALL_TIMELINE=1, off by default): thread 0
// of every CTA stamps its SM's clock as it passes each step of small_rows_kernel (start, its
// statistics in shared memory, the cluster ready, its partial sent, every rank's received, the
// row's total known, its gradient issued, the end), with the global timer at its start and end,
// into a device array that bench/cuda_cross_entropy.cu copies out after a line (XENT_TIMELINE_DIR)
// and bench/small_timeline.py reads. The stamps cost the kernel about 0.7 us at fp32 32 x 50257;
// they are for seeing where a launch's time goes (bench/results/cuda-notes.md), not for its
// figures. Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

namespace xent {
namespace cuda_detail {

#ifndef XENT_CUDA_SMALL_TIMELINE  // 1: diagnostics, every CTA's steps stamped (bench only)
#define XENT_CUDA_SMALL_TIMELINE 0
#endif
#if XENT_CUDA_SMALL_TIMELINE
/// When thread 0 of each CTA of the last small-batch launch passed each step, by its SM's
/// clock, and the global timer at its start and end; CTA (rank, row) at rank + row * cluster.
struct small_stamps {
  unsigned long long global_start, global_end;
  long long clock[8];  ///< steps 0-5 in order; 6, 7: warp 0's send and receive done (in 2-3)
  unsigned sm, rank, row, pad;
};
constexpr unsigned small_timeline_ctas = 8192;
static __device__ small_stamps small_timeline[small_timeline_ctas];
/// This CTA's stamps, or null past the array's end (a launch of more CTAs keeps its first ones).
__device__ __forceinline__ small_stamps* my_stamps() {
  const unsigned i = blockIdx.y * gridDim.x + blockIdx.x;
  return threadIdx.x == 0 && i < small_timeline_ctas ? &small_timeline[i] : nullptr;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define XENT_SMALL_STAMP(k)                                       \
  do {                                                            \
    if (small_stamps* st = my_stamps()) st->clock[k] = clock64(); \
  } while (0)
#else
#define XENT_SMALL_STAMP(k) \
  do {                      \
  } while (0)
#endif

}  // namespace cuda_detail
}  // namespace xent
