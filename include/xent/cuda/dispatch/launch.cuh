// Launch helpers of the dispatch layer: operand alignment tests, a kernel's cluster and
// shared-memory attributes, the cluster launch attribute and the occupancy query.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "../runtime.cuh"

namespace xent {
namespace cuda_detail {

inline bool aligned16(const void* p, std::int64_t ld_bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && ld_bytes % 16 == 0;
}
/// Whether every row of two matrices starts the same distance past a 16-byte boundary.
inline bool same_boundaries(const void* p, std::int64_t p_ld_bytes, const void* q,
                            std::int64_t q_ld_bytes) {
  return (reinterpret_cast<std::uintptr_t>(p) - reinterpret_cast<std::uintptr_t>(q)) % 16 == 0 &&
         (p_ld_bytes - q_ld_bytes) % 16 == 0;
}

/// Per kernel and device, asked once: whether its code was built for sm_90+ (clusters exist in
/// it) and the device lets it have `dynamic_smem` bytes of dynamic shared memory (a part with
/// less shared memory per block than an H100's, as sm_120's 99 KiB, refuses the wide row shape's
/// 192 KiB: the caller then takes another kernel rather than a launch that fails), after raising
/// its limit to that and allowing non-portable cluster sizes. The kernels compile their cluster,
/// bulk-copy and mbarrier paths under __CUDA_ARCH__ >= 900, which follows the PTX the code came
/// from (ptxVersion), not the machine code it became (binaryVersion): code JIT-compiled on an H100
/// from compute_80 PTX (a build for sm_80 alone) is sm_90 machine code without those paths, and
/// launched as if it had them it would skip its work (the small-batch and bulk backward kernels are
/// empty there). Function attributes belong to one device's context, so a process that calls xent
/// on several GPUs (one thread per GPU, as NCCL's single-process groups do) sets them on each: set
/// on device 0 alone, the first launch on device 1 asking for more than 48 KiB failed.
inline bool prepare_cluster_kernel(const void* kernel, int device, int dynamic_smem) {
  struct entry {
    const void* kernel;
    int device;
    bool clusters;
  };
  static std::mutex lock;
  static std::vector<entry> known;
  std::lock_guard<std::mutex> hold(lock);
  for (const entry& e : known)
    if (e.kernel == kernel && e.device == device) return e.clusters;
  // A refused call leaves its error for the next cudaGetLastError, where a later launch's check
  // would report it as its own: taken back at once.
  auto ok = [](cudaError_t e) {
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e == cudaSuccess;
  };
  cudaFuncAttributes attr{};
  const bool clusters =
      ok(cudaFuncGetAttributes(&attr, kernel)) &&
      ok(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_smem)) &&
      attr.ptxVersion >= 90 && attr.binaryVersion >= 90 &&
      ok(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  known.push_back({kernel, device, clusters});
  return clusters;
}

/// Raises `kernel`'s dynamic shared memory limit on the current device to `bytes`, once per
/// kernel, device and larger size (a kernel without clusters: prepare_cluster_kernel's twin).
inline void allow_smem(const char* fn, const void* kernel, int bytes) {
  struct entry {
    const void* kernel;
    int device, bytes;
  };
  static std::mutex lock;
  static std::vector<entry> known;
  int device = 0;
  check_cuda(fn, cudaGetDevice(&device));
  std::lock_guard<std::mutex> hold(lock);
  for (entry& e : known)
    if (e.kernel == kernel && e.device == device) {
      if (e.bytes < bytes) {
        check_cuda(
            fn, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        e.bytes = bytes;
      }
      return;
    }
  check_cuda(fn, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  // All of the SM's unified memory as shared memory: two CTAs of ~100 KiB (the sparse tile GEMM's)
  // fit an SM.
  check_cuda(fn, cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  known.push_back({kernel, device, bytes});
}

/// The launch attribute of a one-dimensional cluster of `cluster` CTAs.
inline cudaLaunchAttribute cluster_attribute(int cluster) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = static_cast<unsigned>(cluster);
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

/// How many clusters of `kernel` (`block` threads a CTA) fit on the device at once, for a launch
/// shaped like `cfg`: the occupancy query costs microseconds of host time, so answers are kept per
/// kernel (keyed by device, cluster size and shared memory).
inline int active_clusters(const char* fn, const void* kernel, int block,
                           const cudaLaunchConfig_t& cfg, const device_facts& dev) {
  struct entry {
    const void* kernel;
    int device, cluster;
    std::size_t smem;
    int active;
  };
  static std::mutex lock;
  static std::vector<entry> known;
  const int cluster = static_cast<int>(cfg.gridDim.x);
  {
    std::lock_guard<std::mutex> hold(lock);
    for (const entry& e : known)
      if (e.kernel == kernel && e.device == dev.id && e.cluster == cluster &&
          e.smem == cfg.dynamicSmemBytes)
        return e.active;
  }
  int active = 0;
  if (cluster > 1) {
    check_cuda(fn, cudaOccupancyMaxActiveClusters(&active, kernel, &cfg));
  } else {
    check_cuda(fn, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&active, kernel, block,
                                                                 cfg.dynamicSmemBytes));
    active *= dev.sms;
  }
  std::lock_guard<std::mutex> hold(lock);
  known.push_back({kernel, dev.id, cluster, cfg.dynamicSmemBytes, active});
  return active;
}

}  // namespace cuda_detail
}  // namespace xent
