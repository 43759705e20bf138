// xent::nccl_group: the communicator (parallel/communicator.hpp) of a CUDA vocab-parallel call on
// NCCL. Compiled only where NCCL is installed (nccl.h; link with -lnccl); the umbrella header
// includes it when XENT_HAS_NCCL is defined (xent's CMake defines it where it finds NCCL).
//
//   ncclComm_t comm = ...;  // the caller's: ncclCommInitRank / ncclCommInitAll / a split
//   xent::nccl_group group(comm, stream);
//   xent::vocab_parallel_forward_backward(xent::cuda{stream, ws, ws_bytes}, group, logits_shard,
//                                         {first, vocab}, targets, opts, up, out, grad_shard);
//
// xent never creates, splits or destroys communicators, and never starts processes or threads.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace xent {

/// An NCCL call failed while xent enqueued work. what() names xent's function, the NCCL call and
/// NCCL's reason (with the communicator's last error, when NCCL has one).
class nccl_error : public std::runtime_error {
 public:
  nccl_error(const char* fn, const char* call, ncclResult_t result, ncclComm_t comm = nullptr)
      : std::runtime_error(std::string(fn) + ": " + call +
                           " failed: " + ncclGetErrorString(result) + detail(comm)),
        code_(result) {}
  ncclResult_t code() const noexcept { return code_; }

 private:
  static std::string detail(ncclComm_t comm) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    if (last && *last) return std::string(" (") + last + ")";
#else
    (void)comm;
#endif
    return {};
  }
  ncclResult_t code_;
};

/// One rank of an NCCL communicator, and the stream its collectives are enqueued on: the stream
/// of the xent::cuda execution object of the calls it serves (checked by those calls). Cheap to
/// copy; it does not own the communicator, which must outlive it.
class nccl_group {
 public:
  /// Asks NCCL for this rank and the rank count (host-side queries: no device work, no sync).
  nccl_group(ncclComm_t comm, cudaStream_t stream) : comm_(comm), stream_(stream) {
    check("ncclCommUserRank", ncclCommUserRank(comm_, &rank_));
    check("ncclCommCount", ncclCommCount(comm_, &size_));
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  cudaStream_t stream() const { return stream_; }
  ncclComm_t comm() const { return comm_; }

  /// Enqueues ncclAllGather of `bytes` bytes per rank (as ncclUint8) on stream(), and returns
  /// without waiting for it. Every rank must pass the same `bytes` (NCCL does not check it).
  void all_gather(const void* send, void* recv, std::size_t bytes) const {
    const ncclResult_t r = ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_);
    if (r != ncclSuccess)
      throw nccl_error("xent::nccl_group::all_gather", "ncclAllGather", r, comm_);
  }

 private:
  void check(const char* call, ncclResult_t r) const {
    if (r != ncclSuccess) throw nccl_error("xent::nccl_group", call, r, comm_);
  }
  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0;
  int size_ = 0;
};

}  // namespace xent
