// Error checks of the CUDA benchmarks (a failed CUDA or cuBLAS call ends the run with its message:
// a benchmark has no caller to hand the error to), and their event timer.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace xent_bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

inline void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: %s\n", what, cublasGetStatusString(s));
    std::exit(1);
  }
}

/// Device time of work enqueued on the default stream, between two CUDA events.
class event_timer {
 public:
  event_timer() {
    check(cudaEventCreate(&start_), "event");
    check(cudaEventCreate(&stop_), "event");
  }
  ~event_timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  event_timer(const event_timer&) = delete;
  event_timer& operator=(const event_timer&) = delete;

  /// Milliseconds of `work`, waiting for it to finish.
  template <class Work>
  float ms(Work&& work) {
    check(cudaEventRecord(start_), "record");
    work();
    check(cudaEventRecord(stop_), "record");
    check(cudaEventSynchronize(stop_), "sync");
    float t = 0.0f;
    check(cudaEventElapsedTime(&t, start_, stop_), "elapsed");
    return t;
  }

 private:
  cudaEvent_t start_{}, stop_{};
};

}  // namespace xent_bench
