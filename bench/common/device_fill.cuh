// Device-side fills for the CUDA benchmarks: random-looking logits and class ids generated on the
// GPU, so gigabytes of inputs cost a millisecond rather than a host upload.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <xent/cuda/block/dtype.cuh>

namespace xent_bench {

/// Normal-ish values from a hash of the index (sum of uniforms), so 4 GB fill in a millisecond.
template <class T>
__global__ void fill_kernel(T* out, std::int64_t n, std::uint64_t seed, float stddev) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    std::uint64_t h = (static_cast<std::uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    float s = 0.0f;
    for (int k = 0; k < 4; ++k) {
      h ^= h >> 31;
      h *= 0xBF58476D1CE4E5B9ull;
      h ^= h >> 29;
      s += static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    }
    out[i] = xent::cuda_detail::from_float<T>((s - 2.0f) * 1.7320508f * stddev);
  }
}

/// Class ids spread over [0, classes) by a multiplicative hash of the row. (A template, as every
/// kernel in a header: one definition however many units include it.)
template <class I>
__global__ void targets_kernel(I* out, std::int64_t n, std::int64_t classes) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    out[i] = static_cast<I>((static_cast<std::uint64_t>(i) * 2654435761ull) % classes);
}

}  // namespace xent_bench
