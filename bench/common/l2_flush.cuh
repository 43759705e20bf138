// How the CUDA benchmarks empty L2 before a timed call: by reading a buffer larger than L2 (the
// default), or by overwriting it as triton's do_bench does for the anchors' figures.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda_check.hpp"

namespace xent_bench {

/// XENT_BENCH_FLUSH=read, write or none (read unless set). write: cudaMemsetAsync over the buffer;
/// L2 is then full of its dirty lines, which the timed call writes back to HBM as its own reads
/// evict them (up to L2's 60 MB on an H200: a tenth of the 524 MB that a bf16 8192 x 32000
/// forward reads). read: a kernel reads the buffer, so what the refresh wrote (the logits) is
/// written back before the call and L2 holds clean lines: the call moves only its own bytes, as
/// the copy roof's back-to-back copies do. none: no flush, so what the refresh last wrote (a
/// small batch's logits, all of them) is still in L2, as an LM head's GEMM leaves them for the
/// loss in training; not how the anchors were timed.
enum class flush_mode { read, write, none };

inline flush_mode flush_setting() {
  static const flush_mode m = [] {
    const char* v = std::getenv("XENT_BENCH_FLUSH");
    const std::string s = v ? v : "";
    return s == "write" ? flush_mode::write : s == "none" ? flush_mode::none : flush_mode::read;
  }();
  return m;
}

inline const char* flush_name() {
  switch (flush_setting()) {
    case flush_mode::write:
      return "write";
    case flush_mode::none:
      return "none";
    default:
      return "read";
  }
}

/// Reads n vectors through L2 (ld.global.cg: cached in L2 only). The sum's one unlikely store
/// keeps the loads live. (A template, as every kernel in a header.)
template <class V>
__global__ void read_flush_kernel(const V* p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const V v = __ldcg(p + i);
    acc += v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

/// Leaves L2 cold before a timed call, on the default stream: `buffer` (`bytes`, a multiple of 16,
/// several times L2) read or overwritten with a byte of `seed` (flush_setting()).
inline void flush_l2(void* buffer, std::size_t bytes, std::uint64_t seed) {
  if (flush_setting() == flush_mode::none) return;
  if (flush_setting() == flush_mode::write) {
    check(cudaMemsetAsync(buffer, static_cast<int>(seed & 0xff), bytes), "flush");
  } else {
    read_flush_kernel<<<4096, 256>>>(static_cast<const uint4*>(buffer), bytes / 16,
                                     static_cast<unsigned*>(buffer));
    check(cudaGetLastError(), "flush");
  }
}

}  // namespace xent_bench
