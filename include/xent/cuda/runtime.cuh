// Host runtime helpers of the CUDA backend: the error a failed CUDA call throws, and the facts
// of the current device that dispatch asks for.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace xent {

/// A CUDA runtime call failed while enqueueing work (a launch or a device query).
class cuda_error : public std::runtime_error {
 public:
  cuda_error(const char* fn, cudaError_t e)
      : std::runtime_error(std::string(fn) + ": CUDA error: " + cudaGetErrorString(e)), code_(e) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace cuda_detail {

/// Throws for a failed call, taking its error back from the runtime's last error first: the
/// exception reports it, and left there it would be reported again by the next check of whoever
/// runs next on this thread (the caller's framework, or xent's next call).
inline void check_cuda(const char* fn, cudaError_t e) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw cuda_error(fn, e);
}

struct device_facts {
  int id = 0;
  int sms = 0;
  int major = 0;
};

inline device_facts query_device(const char* fn) {
  device_facts f;
  check_cuda(fn, cudaGetDevice(&f.id));
  check_cuda(fn, cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, f.id));
  check_cuda(fn, cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, f.id));
  return f;
}

}  // namespace cuda_detail
}  // namespace xent
