// What a chunk of fused linear training costs in its three GEMMs, and which algorithm suits each.
// Each chunk of K rows computes the logits X_c Wᵀ, d_hidden = G W (float C) and acc (V x D,
// float) += G_cᵀ X_c (linear.cuh, chunk_grads); the last reads and writes the whole accumulator
// once per chunk, 8 V D bytes, against 2 V D K flops of products. For each shape this times every
// GEMM (d_weight with beta = 1 and, as the first chunk has it, beta = 0) by cublasGemmEx as the
// library calls it and by every algorithm cuBLASLt's heuristic offers (its tile, stages, split-K
// and swizzle beside its time): what chose cuda/dispatch/accumulate_gemm.cuh's tiles. Prints one
// JSON object per line (and writes them to $OUT/dw_gemm.json).
//   dw_gemm_bench [V D K ...]   (default: 256000 2304 2048, 256000 2304 4096, 128256 4096 2048)
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <xent/cuda/dispatch/accumulate_gemm.cuh>

#include "common/cuda_check.hpp"
#include "common/device_fill.cuh"

namespace {

using xent_bench::check;

/// Median of `reps` event-timed runs of `f` (ms), after two warm-up runs.
template <class F>
double time_ms(F&& f, int reps = 9) {
  xent_bench::event_timer timer;
  f();
  f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) t.push_back(timer.ms(f));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class A>
long long attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t which) {
  A v{};
  std::size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, which, &v, sizeof(v), &written) !=
      CUBLAS_STATUS_SUCCESS)
    return -1;
  return static_cast<long long>(v);
}

/// One column-major GEMM as cuBLAS sees it: C (m x n) = op_a(A) . op_b(B) + beta C, bf16 inputs.
struct gemm_problem {
  const char* name;
  cublasOperation_t ta, tb;
  int m, n, k, lda, ldb, ldc;
  const void *a, *b;
  void* c;
  cudaDataType_t c_type;
  float beta;
};

/// Times `p` by cublasGemmEx and by every algorithm cuBLASLt's heuristic offers for it.
void run_problem(cublasHandle_t handle, cublasLtHandle_t lt, const gemm_problem& p,
                 const std::string& shape, void* work, std::size_t work_bytes,
                 std::ofstream& json) {
  const float one = 1.0f;
  const double flops = 2.0 * p.m * p.n * static_cast<double>(p.k);
  const double ex = time_ms([&] {
    check(cublasGemmEx(handle, p.ta, p.tb, p.m, p.n, p.k, &one, p.a, CUDA_R_16BF, p.lda, p.b,
                       CUDA_R_16BF, p.ldb, &p.beta, p.c, p.c_type, p.ldc, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx");
  });
  char line[1024];
  std::snprintf(line, sizeof line,
                "{\"shape\": \"%s\", \"gemm\": \"%s\", \"beta\": %g, \"how\": \"gemm_ex\", \"ms\": "
                "%.4f, \"tflops\": %.1f}",
                shape.c_str(), p.name, p.beta, ex, flops / ex / 1e9);
  std::puts(line);
  json << line << "\n";

  xent::cuda_detail::lt_descriptors d;  // the library's owner of cuBLASLt's descriptors
  check(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &p.ta, sizeof p.ta),
        "ta");
  check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &p.tb, sizeof p.tb),
        "tb");
  const bool ta = p.ta != CUBLAS_OP_N, tb = p.tb != CUBLAS_OP_N;
  check(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_16BF, ta ? p.k : p.m, ta ? p.m : p.k, p.lda), "la");
  check(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_16BF, tb ? p.n : p.k, tb ? p.k : p.n, p.ldb), "lb");
  check(cublasLtMatrixLayoutCreate(&d.c, p.c_type, p.m, p.n, p.ldc), "lc");
  check(cublasLtMatmulPreferenceCreate(&d.pref), "pref");
  check(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &work_bytes, sizeof work_bytes),
        "pref ws");
  constexpr int want = 24;
  cublasLtMatmulHeuristicResult_t found[want];
  int count = 0;
  check(cublasLtMatmulAlgoGetHeuristic(lt, d.op, d.a, d.b, d.c, d.c, d.pref, want, found, &count),
        "heuristic");
  for (int i = 0; i < count; ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
    const cublasLtMatmulAlgo_t& algo = found[i].algo;
    bool failed = false;
    const double ms = time_ms([&] {
      if (cublasLtMatmul(lt, d.op, &one, p.a, d.a, p.b, d.b, &p.beta, p.c, d.c, p.c, d.c, &algo,
                         work, work_bytes, 0) != CUBLAS_STATUS_SUCCESS)
        failed = true;
    });
    std::snprintf(line, sizeof line,
                  "{\"shape\": \"%s\", \"gemm\": \"%s\", \"beta\": %g, \"how\": \"lt\", \"rank\": "
                  "%d, \"ms\": %.4f, \"tflops\": %.1f, \"failed\": %d, \"id\": %lld, \"tile\": "
                  "%lld, \"stages\": %lld, \"splitk\": %lld, \"swizzle\": %lld, \"workspace\": "
                  "%zu, \"waves\": %.3f}",
                  shape.c_str(), p.name, p.beta, i, ms, flops / ms / 1e9, failed ? 1 : 0,
                  attr<int>(algo, CUBLASLT_ALGO_CONFIG_ID),
                  attr<unsigned>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                  attr<unsigned>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                  attr<unsigned>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                  attr<unsigned>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), found[i].workspaceSize,
                  found[i].wavesCount);
    std::puts(line);
    json << line << "\n";
  }
}

/// A chunk of K rows of the fused linear training at vocabulary V and hidden size D: its three
/// GEMMs as linear.cuh calls them (row-major operands as column-major transposes).
void run_shape(cublasHandle_t handle, cublasLtHandle_t lt, long long V, long long D, long long K,
               std::ofstream& json) {
  __nv_bfloat16 *x, *w, *g;
  float *acc, *dx;
  void* work;
  const std::size_t work_bytes = 64u << 20;
  check(cudaMalloc(&x, sizeof(__nv_bfloat16) * K * D), "malloc x");
  check(cudaMalloc(&w, sizeof(__nv_bfloat16) * V * D), "malloc w");
  check(cudaMalloc(&g, sizeof(__nv_bfloat16) * K * V), "malloc g");
  check(cudaMalloc(&acc, sizeof(float) * V * D), "malloc acc");
  check(cudaMalloc(&dx, sizeof(float) * K * D), "malloc dx");
  check(cudaMalloc(&work, work_bytes), "malloc work");
  xent_bench::fill_kernel<<<1024, 256>>>(x, K * D, 1, 1.0f);
  xent_bench::fill_kernel<<<1024, 256>>>(w, V * D, 3, 0.02f);
  xent_bench::fill_kernel<<<1024, 256>>>(g, K * V, 2, 1e-3f);
  check(cudaMemset(acc, 0, sizeof(float) * V * D), "memset");
  check(cudaDeviceSynchronize(), "fill");
  const int v = static_cast<int>(V), d = static_cast<int>(D), k = static_cast<int>(K);
  const std::string shape = std::to_string(V) + "x" + std::to_string(D) + "x" + std::to_string(K);
  const gemm_problem problems[] = {
      // L (K x V row-major) = X_c . W^T
      {"logits", CUBLAS_OP_T, CUBLAS_OP_N, v, k, d, d, d, v, w, x, g, CUDA_R_16BF, 0.0f},
      // dX (K x D, float) = G . W
      {"d_hidden", CUBLAS_OP_N, CUBLAS_OP_N, d, k, v, d, v, d, w, g, dx, CUDA_R_32F, 0.0f},
      // acc (V x D, float) += G^T . X_c, and the first chunk's beta = 0
      {"d_weight", CUBLAS_OP_N, CUBLAS_OP_T, d, v, k, d, v, d, x, g, acc, CUDA_R_32F, 1.0f},
      {"d_weight", CUBLAS_OP_N, CUBLAS_OP_T, d, v, k, d, v, d, x, g, acc, CUDA_R_32F, 0.0f},
  };
  for (const gemm_problem& p : problems) run_problem(handle, lt, p, shape, work, work_bytes, json);
  cudaFree(x);
  cudaFree(w);
  cudaFree(g);
  cudaFree(acc);
  cudaFree(dx);
  cudaFree(work);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<long long> shapes = {256000, 2304, 2048, 256000, 2304, 4096, 128256, 4096, 2048};
  if (argc > 1) {
    shapes.clear();
    for (int i = 1; i < argc; ++i) shapes.push_back(std::atoll(argv[i]));
  }
  const char* out = std::getenv("OUT");
  std::ofstream json(std::string(out ? out : ".") + "/dw_gemm.json");
  cublasHandle_t handle;
  cublasLtHandle_t lt;
  check(cublasCreate(&handle), "cublasCreate");
  check(cublasLtCreate(&lt), "cublasLtCreate");
  for (std::size_t i = 0; i + 2 < shapes.size(); i += 3)
    run_shape(handle, lt, shapes[i], shapes[i + 1], shapes[i + 2], json);
  cublasLtDestroy(lt);
  cublasDestroy(handle);
  return 0;
}
