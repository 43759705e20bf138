// The communicators the CUDA vocab-parallel tests run ranks on, and the runners that start them:
//   - staged_group: R ranks as threads on ONE GPU, the all-gather staged through the host (a test
//     communicator: it synchronises the rank's stream first). It runs on any machine with a GPU
//     and checks everything but the stream ordering of a real collective;
//   - an NCCL group (xent::nccl_group) over devices 0..count-1 of this process (nccl_comms), one
//     thread per rank, where NCCL is (XENT_HAS_NCCL).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <thread>
#include <vector>
#include <xent/parallel/inprocess_group.hpp>

#include "cuda/device_util.cuh"

#if defined(XENT_HAS_NCCL)
#include <nccl.h>

#include <xent/parallel/nccl_group.cuh>
#endif

namespace xent_test {

/// A test communicator: ranks are threads sharing one GPU, each with its own stream; all_gather
/// waits for the rank's stream, then exchanges the bytes through the host (inprocess_group).
class staged_group {
 public:
  staged_group(xent::inprocess_group::communicator comm, cudaStream_t stream)
      : comm_(comm), stream_(stream) {}
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  cudaStream_t stream() const { return stream_; }
  /// The same rank, its collective enqueued on another stream.
  staged_group on(cudaStream_t stream) const { return staged_group(comm_, stream); }
  void all_gather(const void* send, void* recv, std::size_t bytes) const {
    std::vector<unsigned char> mine(bytes), all(bytes * static_cast<std::size_t>(size()));
    check(cudaMemcpyAsync(mine.data(), send, bytes, cudaMemcpyDeviceToHost, stream_));
    check(cudaStreamSynchronize(stream_));
    comm_.all_gather(mine.data(), all.data(), bytes);
    check(cudaMemcpyAsync(recv, all.data(), all.size(), cudaMemcpyHostToDevice, stream_));
    check(cudaStreamSynchronize(stream_));
  }

 private:
  static void check(cudaError_t e) {
    if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
  }
  xent::inprocess_group::communicator comm_;
  cudaStream_t stream_;
};

/// Runs f(group) for every rank of `ranks` threads on the current GPU, each with its own
/// non-blocking stream and a staged_group over it; returns when all have returned (a rank's
/// exception comes out as inprocess_group::run lets it).
template <class F>
void on_staged_ranks(int ranks, F&& f) {
  int device = 0;
  cudaGetDevice(&device);
  xent::inprocess_group group(ranks);
  group.run([&](xent::inprocess_group::communicator comm) {
    cudaSetDevice(device);  // the device is per thread
    cudaStream_t stream;
    ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    f(staged_group(comm, stream));
    cudaStreamDestroy(stream);
  });
}

inline int visible_gpus() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

#if defined(XENT_HAS_NCCL)

/// Communicators over devices 0..count-1 (one process, ncclCommInitAll), destroyed at the end.
struct nccl_comms {
  std::vector<ncclComm_t> comms;
  explicit nccl_comms(int count) : comms(static_cast<std::size_t>(count)) {
    std::vector<int> devices(static_cast<std::size_t>(count));
    for (int d = 0; d < count; ++d) devices[d] = d;
    const ncclResult_t r = ncclCommInitAll(comms.data(), count, devices.data());
    EXPECT_EQ(r, ncclSuccess) << ncclGetErrorString(r);
    if (r != ncclSuccess) comms.clear();
  }
  ~nccl_comms() {
    for (ncclComm_t c : comms) ncclCommDestroy(c);
  }
};

/// Runs f(group) for every rank r of `nc` on device r, one thread per rank, each with its own
/// non-blocking stream and an xent::nccl_group over it; rethrows a rank's exception. A rank that
/// fails says so at once on stderr: the other ranks wait in their collective for it and may never
/// return (the device script runs these tests under a time limit).
template <class F>
void on_nccl_ranks(const nccl_comms& nc, F&& f) {
  const int ranks = static_cast<int>(nc.comms.size());
  std::vector<std::exception_ptr> failures(nc.comms.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        cudaSetDevice(r);
        cudaStream_t stream;
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        f(xent::nccl_group(nc.comms[r], stream));
        cudaStreamDestroy(stream);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "NCCL rank %d failed: %s\n", r, e.what());
        failures[r] = std::current_exception();
      } catch (...) {
        std::fprintf(stderr, "NCCL rank %d failed\n", r);
        failures[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : failures)
    if (e) std::rethrow_exception(e);
}

#endif

}  // namespace xent_test
