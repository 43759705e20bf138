// The launcher of the fused linear forward's Hopper GEMM (kernels/stats_gemm_kernel.cuh): whether
// this build and device run it, and its launch.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../block/wgmma.cuh"
#include "../kernels/stats_gemm_kernel.cuh"
#include "../runtime.cuh"
#include "launch.cuh"

namespace xent {
namespace cuda_detail {
namespace stats_gemm {

/// Whether this build runs the GEMM with clusters of `cluster` on device `dev`: its sm_90a body
/// was compiled for the code the device runs (it alone has static shared memory) and the device
/// grants the dynamic shared memory (prepare_cluster_kernel: once per kernel and device, no stream
/// work, so it may run under graph capture).
template <form F, class I>
bool ready(int dev, int cluster) {
  const auto kernel = cluster == 2 ? reinterpret_cast<const void*>(stats_gemm_kernel<F, 2, I>)
                                   : reinterpret_cast<const void*>(stats_gemm_kernel<F, 1, I>);
  cudaFuncAttributes attr{};
  return prepare_cluster_kernel(kernel, dev, smem_bytes) &&
         cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.sharedSizeBytes > 0;
}

/// Enqueues the GEMM over X (a.rows x a.depth, leading dimension ldx) and W (a.cols x a.depth,
/// leading dimension ldw), one CTA per SM of `dev` in clusters of `cluster`; ready<F, I>(dev.id,
/// cluster) must hold.
///
/// The attributes are set here, on the address launched: nvcc 13 gives each translation unit its
/// own host stub of a kernel template, bound to that unit's copy of the kernel
/// (-static-global-template-stub, on by default), while the linker keeps one copy of each host
/// template, so a `ready` of one unit may prepare its copy and a `launch` of another launch the
/// other with the default 48 KiB limit (cudaLaunchKernelEx: invalid argument).
template <form F, class I>
void launch(const char* fn, const void* x, std::int64_t ldx, const void* w, std::int64_t ldw,
            const args<I>& a, const device_facts& dev, int cluster, cudaStream_t stream,
            void* logits = nullptr, std::int64_t ld_logits = 0) {
  static_assert(tile_k == 64, "make_map's boxes are 64 columns (128 bytes) wide");
  void (*const kernel)(CUtensorMap, CUtensorMap, CUtensorMap, args<I>) =
      cluster == 2 ? stats_gemm_kernel<F, 2, I> : stats_gemm_kernel<F, 1, I>;
  if (!prepare_cluster_kernel(reinterpret_cast<const void*>(kernel), dev.id, smem_bytes))
    throw error(fn, "exec", "the sm_90a GEMM's attributes were refused on this device");
  const CUtensorMap xm = make_map(fn, "hidden", x, a.rows, a.depth, ldx, tile_m);
  const CUtensorMap wm = make_map(fn, "weight", w, a.cols, a.depth, ldw, tile_n / cluster);
  // form::stats: no logits (an unused map, the hidden one); otherwise rows x cols bf16, leading
  // dimension ld_logits, stored in boxes of 128 rows x 64 columns.
  const CUtensorMap lm =
      F == form::stats ? xm : make_map(fn, "logits", logits, a.rows, a.cols, ld_logits, tile_m);
  // Groups of `cluster` row tiles, each at every column tile; at most one CTA per SM.
  const std::int64_t groups = (a.rows + std::int64_t{tile_m} * cluster - 1) /
                              (std::int64_t{tile_m} * cluster) * a.col_tiles;
  const int clusters = static_cast<int>(groups < dev.sms / cluster ? groups : dev.sms / cluster);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * cluster), 1, 1);
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1] = {cluster_attribute(cluster)};
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(fn, cudaLaunchKernelEx(&cfg, kernel, xm, wm, lm, a));
}

}  // namespace stats_gemm
}  // namespace cuda_detail
}  // namespace xent
