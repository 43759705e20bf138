// vocab_parallel_linear_traits<cuda>: vocab-parallel fused linear cross-entropy on the GPU, each
// rank a GPU with the caller's cuBLAS handle (exec.cublas) and a device communicator
// (parallel/nccl_group.cuh, or any type whose all_gather enqueues on the stream its stream()
// names). Included only by nvcc, with cuBLAS's header (xent.hpp). The call and its chunk steps
// are dispatch/vocab_parallel_linear.cuh's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../backend.hpp"
#include "../linear/options.hpp"
#include "cuda.cuh"
#include "dispatch/linear_plan.cuh"
#include "dispatch/vocab_parallel.cuh"
#include "dispatch/vocab_parallel_linear.cuh"
#include "instances.cuh"

namespace xent {

template <>
struct vocab_parallel_linear_traits<cuda> {
  /// The single-device call's bytes for this rank's shard (dispatch/linear_plan.cuh, or in the
  /// low-memory order dispatch/linear_panels.cuh's), plus the chunk's exchange
  /// (dispatch/vocab_parallel.cuh's vp_layout of chunk_rows rows without the reduction's head):
  /// (R + 1) blocks of a 32-byte header and at most 32 bytes per row (record_layout::largest:
  /// the options and outputs are not known here), and the rows' merged LSE and target mass, each
  /// 256-byte aligned.
  template <class T, class G>
  static std::size_t workspace_bytes(const cuda&, const linear_shape& shape, int ranks,
                                     linear_pass pass, dw_accumulation accumulate,
                                     linear_order order, std::int64_t chunk_rows) {
    return cuda_detail::make_vp_linear_plan<T, G>(shape, ranks, pass, accumulate, order, chunk_rows)
        .bytes;
  }

  /// The fewest chunk rows at which the low-memory order's panel takes every row of `shape`: from
  /// there a size query plans the whole workspace within its budget (vp_linear_sizes), as the
  /// single-device query does (linear_panels.cuh's query_low_memory).
  static std::int64_t low_memory_every_row(const linear_shape& shape) {
    return cuda_detail::vp_every_row_chunk(shape);
  }

  template <class T, class G, class Tgt>
  using call = cuda_detail::vp_linear_call<T, G, Tgt>;
};

}  // namespace xent
