// The CUDA execution object and its workspace.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../detail/disjoint.hpp"

// cuBLAS's handle type (cublasHandle_t is `cublasContext*`), declared here so that the execution
// object carries one without every user of the cross-entropy core including cuBLAS.
struct cublasContext;

// Kernels in a header are instantiated in every translation unit that uses them: hidden visibility
// keeps two shared libraries that both include xent from resolving to each other's copies.
#define XENT_KERNEL __global__ __attribute__((visibility("hidden")))

namespace xent {

/// Runs on the GPU of the current device, in `stream`. Every call only enqueues work: nothing
/// synchronises with the host, nothing allocates, and each call can be captured in a CUDA graph.
///
/// `workspace` is caller-owned device memory of at least cuda_workspace_size(rows) bytes, needed
/// for the reduced loss and num_correct (CUB's two-phase temp storage); calls that need neither
/// accept a null workspace. A fused call on rows that do not start on 16-byte boundaries (V = 50257
/// in bf16, say) with no LSE output keeps each row's LSE there between its two kernels where the
/// workspace is given; without one it takes a slower kernel. Where it is given, long aligned rows'
/// forward and fused passes also take their rows from a queue there (row_queue.cuh: bf16 8192 x
/// 32000 fused 279 -> 260 us on an H200). Zero-fill it once before its first use
/// (cudaMemset): every call leaves its counters at zero again for the next, so no call spends a
/// launch on clearing it; calls that share one workspace must be ordered (one stream, or events).
///
/// `error_count`, when given, is a device int that every call adds the number of rows whose class
/// id is outside [0, V) and not ignore_index to. Such a row never reads or writes out of bounds:
/// its loss and LSE are NaN, its gradient row zero, and it is left out of the mean's normaliser.
/// Neither the error count nor the workspace may overlap a call's arguments (exec_writes below).
///
/// `cublas` is the caller's cuBLAS handle, which fused linear cross-entropy (linear.hpp,
/// cuda/linear.cuh) needs for its GEMMs and nothing else uses; xent never creates one. Bind it to
/// `stream` (cublasSetStream) before the call: a handle bound to another stream is switched to
/// `stream` for the call and back afterwards, and cuBLAS resets a handle's workspace to its default
/// pool whenever its stream is set. The GEMMs use the handle's own workspace (cublasSetWorkspace;
/// set one for CUDA graph capture, as cuBLAS advises).
struct cuda {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  int* error_count = nullptr;
  cublasContext* cublas = nullptr;
};

/// The cross-entropy calls (and the vocab-parallel ones) write the workspace, all
/// `workspace_bytes` of it counted, and the error count: neither may overlap an argument the call
/// reads or writes (detail/disjoint.hpp checks them with the call's own spans, from addresses
/// alone).
inline void exec_writes(detail::call_memory& mem, const cuda& exec) {
  mem.writes_bytes("exec.workspace", exec.workspace, exec.workspace ? exec.workspace_bytes : 0)
      .writes("exec.error_count", exec.error_count);
}

namespace cuda_detail {

/// The workspace layout: a header; the small-batch kernel's records (one 8-byte word per row,
/// its loss and a ready flag, zero between calls) at a fixed place for at most
/// workspace_records rows, so that no call of any row count writes there otherwise; then one
/// float and one flag per row (the row kernels' reduced loss); then one share of the reduced loss
/// per CTA (the streaming forward's: two doubles, at most one CTA per row).
struct workspace_header {
  /// Rows (or, in the streaming forward, CTAs) finished by the running call; the last resets it
  /// to 0. 64 bits: a call may have 2^32 rows or more (a 32-bit count would wrap and let a CTA
  /// finish the reduction early).
  unsigned long long rows_done;
  /// The mean's normaliser of the running call, where a kernel ahead of the row kernel sums it
  /// (normalizer_kernel, row_sums.cuh); the row kernel reads it after griddepcontrol.wait.
  double normalizer;
  /// Tickets the running row kernel has handed out from its queue of rows (row_queue.cuh); the
  /// launch's last take resets it to 0.
  unsigned long long rows_taken;
};

__host__ __device__ inline std::size_t align_up(std::size_t n, std::size_t a) {
  return (n + a - 1) / a * a;
}

/// The most rows a small-batch launch (small_rows_kernel.cuh) may have: 8 KiB of records.
constexpr std::int64_t workspace_records = 1024;

struct workspace_layout {
  std::size_t records = 0, row_loss = 0, correct = 0, shares = 0, total = 0;
  __host__ __device__ explicit workspace_layout(std::int64_t rows) {
    const auto n = static_cast<std::size_t>(rows);
    records = align_up(sizeof(workspace_header), 256);
    row_loss = records + sizeof(unsigned long long) * static_cast<std::size_t>(workspace_records);
    correct = align_up(row_loss + sizeof(float) * n, 256);
    shares = align_up(correct + n, 256);
    total = align_up(shares + 2 * sizeof(double) * n, 256);
  }
};

}  // namespace cuda_detail

/// Bytes of workspace a call over `rows` rows needs (cuda::workspace).
inline std::size_t cuda_workspace_size(std::int64_t rows) {
  return cuda_detail::workspace_layout(rows < 0 ? 0 : rows).total;
}

}  // namespace xent
