// The fused linear training's d_weight GEMM into a float sum over chunks (dw_accumulation::fp32's
// accumulator, or a float d_weight from bf16 / fp16 inputs), by cuBLASLt with a tile chosen for it.
// Each chunk adds G_cᵀ · X_c into the V x D float accumulator, so the GEMM reads and writes 8 V D
// bytes beside its 2 V D K flops (K: the chunk's rows). cublasGemmEx's heuristic gives it 192 x 192
// tiles, one CTA per SM, whose epilogue reads and writes the accumulator while the tensor cores
// wait; 128 x 160 tiles, two CTAs per SM, overlap one CTA's epilogue with the other's main loop.
// H200, bench/dw_gemm_bench.cu, V = 256000, D = 2304, K = 2048, two machines: cublasGemmEx 3.86 /
// 4.30 ms, 128 x 160 3.50 / 3.55 ms, 128 x 128 3.50 / 3.55 ms (the heuristic's other six 3.8-4.3
// ms); at K = 4096 128 x 160 7.26 ms against 7.28. On two more H200s: 128 x 160 3.49 / 3.19 ms
// against 3.13 / 3.08 for the chunk's logits GEMM (the same flops, bf16 written once); a wgmma
// kernel of ours whose epilogue added into the accumulator by TMA reduce-adds took 4.57 / 4.87 (the
// L2's float adds bound it). Included only by nvcc.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace xent {
namespace cuda_detail {

/// Tiles the accumulating GEMM prefers, best first (the measurements above); otherwise the
/// heuristic's first choice.
constexpr cublasLtMatmulTile_t accumulate_gemm_tiles[] = {CUBLASLT_MATMUL_TILE_128x160,
                                                          CUBLASLT_MATMUL_TILE_128x128};

/// Owns cuBLASLt's descriptors of one GEMM.
class lt_descriptors {
 public:
  lt_descriptors() = default;
  lt_descriptors(const lt_descriptors&) = delete;
  lt_descriptors& operator=(const lt_descriptors&) = delete;
  ~lt_descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
};

/// acc (column-major m x n floats, leading dimension ldc) = A · Bᵀ + beta acc, with A column-major
/// m x k (lda) and B column-major n x k (ldb), bf16 or fp16 (`type`), float accumulation, on
/// `stream` with `work_bytes` of device memory at `work` lent to it (linear_plan's lt_work), by
/// cuBLASLt through `handle` (a cuBLAS handle is a cuBLASLt handle: PyTorch passes its own so).
/// Returns false, having enqueued nothing, when cuBLASLt offers no algorithm: the caller then
/// takes cublasGemmEx. Host work only (descriptors and the heuristic): no device memory is
/// allocated and nothing waits on the stream.
inline bool accumulate_gemm(cublasHandle_t handle, cudaStream_t stream, cudaDataType_t type,
                            std::int64_t m, std::int64_t n, std::int64_t k, const void* a,
                            std::int64_t lda, const void* b, std::int64_t ldb, float beta,
                            float* acc, std::int64_t ldc, void* work, std::size_t work_bytes) {
  if (m == 0 || n == 0 || k == 0) return false;  // cublasGemmEx's caller handles empty products
  const auto lt = reinterpret_cast<cublasLtHandle_t>(handle);
  lt_descriptors d;
  const cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_T;
  auto ok = [](cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; };
  if (!ok(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
      !ok(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) ||
      !ok(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)) ||
      !ok(cublasLtMatrixLayoutCreate(&d.a, type, static_cast<std::uint64_t>(m),
                                     static_cast<std::uint64_t>(k), lda)) ||
      !ok(cublasLtMatrixLayoutCreate(&d.b, type, static_cast<std::uint64_t>(n),
                                     static_cast<std::uint64_t>(k), ldb)) ||
      !ok(cublasLtMatrixLayoutCreate(&d.c, CUDA_R_32F, static_cast<std::uint64_t>(m),
                                     static_cast<std::uint64_t>(n), ldc)) ||
      !ok(cublasLtMatmulPreferenceCreate(&d.pref)) ||
      !ok(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &work_bytes, sizeof work_bytes)))
    return false;
  // Each operand's own alignment: the heuristic assumes 256 bytes unless told, and an algorithm
  // chosen for that may fault on a chunk of the caller's hidden rows or a float d_weight that
  // starts elsewhere (a view into a larger buffer). Aligned operands (xent's workspace,
  // cudaMalloc's tensors) keep the default.
  auto alignment = [](const void* p) {
    std::uint32_t bytes = 256;
    while (bytes > 1 && reinterpret_cast<std::uintptr_t>(p) % bytes != 0) bytes /= 2;
    return bytes;
  };
  auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attr, std::uint32_t bytes) {
    return ok(cublasLtMatmulPreferenceSetAttribute(d.pref, attr, &bytes, sizeof bytes));
  };
  if (!prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(a)) ||
      !prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(b)) ||
      !prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(acc)) ||
      !prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(acc)))
    return false;
  constexpr int offered = 16;
  cublasLtMatmulHeuristicResult_t found[offered];
  int count = 0;
  if (!ok(cublasLtMatmulAlgoGetHeuristic(lt, d.op, d.a, d.b, d.c, d.c, d.pref, offered, found,
                                         &count)) ||
      count == 0)
    return false;
  auto tile_of = [](const cublasLtMatmulAlgo_t& algo) {
    std::uint32_t tile = CUBLASLT_MATMUL_TILE_UNDEFINED;
    std::size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile,
                                         &written);
    return tile;
  };
  const cublasLtMatmulAlgo_t* chosen = nullptr;
  for (const cublasLtMatmulTile_t want : accumulate_gemm_tiles) {
    for (int i = 0; i < count && !chosen; ++i)
      if (found[i].state == CUBLAS_STATUS_SUCCESS && tile_of(found[i].algo) == want)
        chosen = &found[i].algo;
    if (chosen) break;
  }
  if (!chosen) chosen = &found[0].algo;
  const float alpha = 1.0f;
  return ok(cublasLtMatmul(lt, d.op, &alpha, a, d.a, b, d.b, &beta, acc, d.c, acc, d.c, chosen,
                           work, work_bytes, stream));
}

}  // namespace cuda_detail
}  // namespace xent
