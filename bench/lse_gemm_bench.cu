// Measures the fused linear forward's Hopper GEMM (include/xent/cuda/kernels/stats_gemm_kernel.cuh)
// against cuBLAS on the issue's shapes: the X . W^T GEMM alone (cublasGemmEx, bf16 in and out,
// float accumulation: the issue's floor), the same GEMM by that kernel storing bf16 logits (its
// main loop's speed), and the kernel with its statistics epilogue plus the merge of the row
// partials (the forward's two launches, logits never written); the kernel both in clusters of one
// CTA and of two sharing each W tile (policy::stats_gemm_cluster is the library's choice). Checks
// first, against cuBLAS's float logits: the kernel's bf16 logits, and each row's LSE and target
// logit (of those logits rounded to bf16). Prints one JSON object per shape (and writes them to
// $OUT/lse_gemm.json).
//   lse_gemm_bench [N D V ...]   (default: 8192 4096 128256 and 16384 2304 256000)
// Needs an sm_90a build (CMake: xent_bench_lse_gemm, built when CMAKE_CUDA_ARCHITECTURES names
// 90a); elsewhere it says so and exits.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <xent/cuda/dispatch/stats_gemm.cuh>
#include <xent/xent.hpp>

#include "common/cuda_check.hpp"
#include "common/device_fill.cuh"

namespace {

namespace sg = xent::cuda_detail::stats_gemm;

using xent_bench::check;

/// Row LSE and target logit of float logits rounded to bf16 (the forward's statistics are of the
/// rounded logits, stats_gemm.cuh), one CTA per row, in double: the reference.
__global__ void reference_kernel(const float* logits, const std::int64_t* y, int cols, double* lse,
                                 double* target) {
  const float* row = logits + static_cast<std::int64_t>(blockIdx.x) * cols;
  auto at = [&](std::int64_t c) {
    return static_cast<double>(__bfloat162float(__float2bfloat16_rn(row[c])));
  };
  __shared__ double red[256];
  double m = -HUGE_VAL;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmax(m, at(c));
  red[threadIdx.x] = m;
  __syncthreads();
  for (int k = 128; k > 0; k >>= 1) {
    if (static_cast<int>(threadIdx.x) < k)
      red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + k]);
    __syncthreads();
  }
  m = red[0];
  __syncthreads();
  double s = 0.0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += exp(at(c) - m);
  red[threadIdx.x] = s;
  __syncthreads();
  for (int k = 128; k > 0; k >>= 1) {
    if (static_cast<int>(threadIdx.x) < k) red[threadIdx.x] += red[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    lse[blockIdx.x] = m + log(red[0]);
    target[blockIdx.x] = at(y[blockIdx.x]);
  }
}

template <class F>
std::vector<float> time_ms(F&& f, int reps) {
  xent_bench::event_timer timer;
  f();  // warm-up
  check(cudaDeviceSynchronize(), "warm-up");
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) t.push_back(timer.ms(f));
  std::sort(t.begin(), t.end());
  return t;
}

std::string run_shape(int N, int D, int V, const xent::cuda_detail::device_facts& dev,
                      cublasHandle_t h) {
  using bf16 = __nv_bfloat16;
  bf16 *x, *w, *logits;
  float* ref;
  std::int64_t* y;
  check(cudaMalloc(&x, sizeof(bf16) * N * std::int64_t{D}), "x");
  check(cudaMalloc(&w, sizeof(bf16) * V * std::int64_t{D}), "w");
  check(cudaMalloc(&logits, sizeof(bf16) * N * std::int64_t{V}), "logits");
  check(cudaMalloc(&y, sizeof(std::int64_t) * N), "y");
  // Logits ~ N(0, 2^2): X ~ N(0, 1), W ~ N(0, 4 / D).
  xent_bench::fill_kernel<<<4096, 256>>>(x, N * std::int64_t{D}, 1, 1.0f);
  xent_bench::fill_kernel<<<4096, 256>>>(w, V * std::int64_t{D}, 2,
                                         2.0f / std::sqrt(static_cast<float>(D)));
  xent_bench::targets_kernel<<<(N + 255) / 256, 256>>>(y, std::int64_t{N}, std::int64_t{V});
  auto a = sg::shape_args<std::int64_t>(N, V, D);
  a.targets = y;
  float *target_logit, *lse, *loss;
  check(cudaMalloc(&a.partials, sizeof(sg::partial) * N * std::int64_t{a.col_tiles}), "parts");
  check(cudaMalloc(&target_logit, sizeof(float) * N), "z");
  check(cudaMalloc(&lse, sizeof(float) * N), "lse");
  check(cudaMalloc(&loss, sizeof(float) * N), "loss");
  a.target_logit = target_logit;
  const float one = 1.0f, zero = 0.0f;
  auto cublas_gemm = [&](void* out, cudaDataType_t type) {
    check(
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, V, N, D, &one, w, CUDA_R_16BF, D, x, CUDA_R_16BF,
                     D, &zero, out, type, V, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  };
  const char* fn = "lse_gemm_bench";
  // The merge's row arguments: every row's loss and LSE, default options.
  xent::cuda_detail::row_args<bf16, bf16, xent::cuda_detail::class_ids<std::int64_t>> m{};
  m.rows = N;
  m.cols = m.vocab = V;
  m.targets.ids = y;
  m.k = xent::make_loss_constants(xent::options{}, V, static_cast<float>(V));
  m.ignore_index = -100;
  m.row_loss = loss;
  m.lse_out = lse;
  // Each GEMM in clusters of one CTA and of two (stats_gemm_kernel's Cluster).
  auto plain = [&](int cluster) {
    sg::launch<sg::form::logits>(fn, x, D, w, D, a, dev, cluster, nullptr, logits, V);
  };
  auto forward = [&](int cluster) {
    sg::launch<sg::form::stats>(fn, x, D, w, D, a, dev, cluster, nullptr);
    sg::merge_kernel<<<(N * 32 + 255) / 256, 256>>>(m, a.partials, a.target_logit, a.col_tiles);
  };

  // Checks: the plain kernel's logits and the forward's LSE and target logit against cuBLAS's
  // float logits (a row at a time in double). The float reference needs N x V x 4 bytes.
  check(cudaMalloc(&ref, sizeof(float) * N * std::int64_t{V}), "reference");
  cublas_gemm(ref, CUDA_R_32F);
  double *ref_lse, *ref_z;
  check(cudaMalloc(&ref_lse, sizeof(double) * N), "ref lse");
  check(cudaMalloc(&ref_z, sizeof(double) * N), "ref z");
  reference_kernel<<<N, 256>>>(ref, y, V, ref_lse, ref_z);
  std::vector<double> rl(N), rz(N);
  check(cudaMemcpy(rl.data(), ref_lse, sizeof(double) * N, cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(rz.data(), ref_z, sizeof(double) * N, cudaMemcpyDeviceToHost), "copy");
  // Errors as the largest difference, a non-finite one counting as infinite.
  auto grow = [](double err, double diff) {
    return diff <= err ? err : diff > err ? diff : HUGE_VAL;
  };
  double logit_err = 0.0, logit_scale = 0.0, lse_err = 0.0, z_err = 0.0, mean_loss = 0.0;
  for (int cluster = 1; cluster <= 2; ++cluster) {
    // Outputs poisoned (NaN) first: a row or logit the kernels leave unwritten fails.
    check(cudaMemset(logits, 0xFF, sizeof(bf16) * N * std::int64_t{V}), "poison");
    check(cudaMemset(lse, 0xFF, sizeof(float) * N), "poison");
    check(cudaMemset(target_logit, 0xFF, sizeof(float) * N), "poison");
    plain(cluster);
    forward(cluster);
    check(cudaDeviceSynchronize(), "checks");
    // Logits: a sample of rows (every 97th) against the float reference.
    {
      std::vector<bf16> got(V);
      std::vector<float> want(V);
      for (int r = 0; r < N; r += 97) {
        check(cudaMemcpy(got.data(), logits + std::int64_t{r} * V, sizeof(bf16) * V,
                         cudaMemcpyDeviceToHost),
              "copy");
        check(cudaMemcpy(want.data(), ref + std::int64_t{r} * V, sizeof(float) * V,
                         cudaMemcpyDeviceToHost),
              "copy");
        for (int c = 0; c < V; ++c) {
          logit_err = grow(logit_err, std::fabs(static_cast<double>(__bfloat162float(got[c])) -
                                                static_cast<double>(want[c])));
          logit_scale = std::max(logit_scale, std::fabs(static_cast<double>(want[c])));
        }
      }
    }
    std::vector<float> gl(N), gz(N), gloss(N);
    check(cudaMemcpy(gl.data(), lse, sizeof(float) * N, cudaMemcpyDeviceToHost), "copy");
    check(cudaMemcpy(gz.data(), target_logit, sizeof(float) * N, cudaMemcpyDeviceToHost), "copy");
    check(cudaMemcpy(gloss.data(), loss, sizeof(float) * N, cudaMemcpyDeviceToHost), "copy");
    int first_bad = -1;
    mean_loss = 0.0;
    for (int r = 0; r < N; ++r) {
      const double dl = std::fabs(gl[r] - rl[r]), dz = std::fabs(gz[r] - rz[r]);
      lse_err = grow(lse_err, dl);
      z_err = grow(z_err, dz);
      // A target logit may round to the neighbouring bf16 where cuBLAS's sum and the kernel's
      // differ in the last float bits at a rounding boundary: one bf16 ulp (<= |z| / 128) allowed.
      if (first_bad < 0 && !(dl < 1e-3 && dz <= std::max(1e-3, std::fabs(rz[r]) / 128)))
        first_bad = r;
      mean_loss += gloss[r] / N;
    }
    if (first_bad >= 0)
      std::fprintf(stderr, "clusters of %d, row %d: lse %g (want %g), target logit %g (want %g)\n",
                   cluster, first_bad, gl[first_bad], rl[first_bad], gz[first_bad], rz[first_bad]);
  }
  check(cudaFree(ref), "free");
  check(cudaFree(ref_lse), "free");
  check(cudaFree(ref_z), "free");

  const int reps = 10;
  // cuBLAS before and after (the GPU's clocks drift over a run of seconds at full power): the
  // floor is the mean of the two medians.
  const auto t_cublas = time_ms([&] { cublas_gemm(logits, CUDA_R_16BF); }, reps);
  const auto t_plain = time_ms([&] { plain(1); }, reps);
  const auto t_forward = time_ms([&] { forward(1); }, reps);
  const auto t_plain2 = time_ms([&] { plain(2); }, reps);
  const auto t_forward2 = time_ms([&] { forward(2); }, reps);
  const auto t_cublas2 = time_ms([&] { cublas_gemm(logits, CUDA_R_16BF); }, reps);
  const double flops = 2.0 * N * static_cast<double>(D) * V;
  auto med = [](const std::vector<float>& t) { return static_cast<double>(t[t.size() / 2]); };
  const double floor_ms = (med(t_cublas) + med(t_cublas2)) / 2;
  char buf[2048];
  std::snprintf(
      buf, sizeof buf,
      "{\"shape\": \"%dx%dx%d\", \"cublas_ms\": %.3f, \"cublas_before_after_ms\": [%.3f, %.3f], "
      "\"plain_ms\": %.3f, "
      "\"forward_ms\": %.3f, \"cublas_tflops\": %.1f, \"plain_tflops\": %.1f, "
      "\"forward_tflops\": %.1f, \"plain_ratio\": %.4f, \"forward_ratio\": %.4f, "
      "\"pairs_plain_ms\": %.3f, \"pairs_forward_ms\": %.3f, \"pairs_plain_ratio\": %.4f, "
      "\"pairs_forward_ratio\": %.4f, \"logit_max_abs_err\": %.3g, \"logit_max_abs\": %.3g, "
      "\"lse_max_abs_err\": %.3g, "
      "\"target_logit_max_abs_err\": %.3g, \"mean_loss\": %.5f}",
      N, D, V, floor_ms, med(t_cublas), med(t_cublas2), med(t_plain), med(t_forward),
      flops / floor_ms / 1e9, flops / med(t_plain) / 1e9, flops / med(t_forward) / 1e9,
      med(t_plain) / floor_ms, med(t_forward) / floor_ms, med(t_plain2), med(t_forward2),
      med(t_plain2) / floor_ms, med(t_forward2) / floor_ms, logit_err, logit_scale, lse_err, z_err,
      mean_loss);
  for (void* p :
       {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(logits),
        static_cast<void*>(y), static_cast<void*>(a.partials), static_cast<void*>(target_logit),
        static_cast<void*>(lse), static_cast<void*>(loss)})
    check(cudaFree(p), "free");
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> dims;
  for (int i = 1; i < argc; ++i) dims.push_back(std::atoi(argv[i]));
  if (dims.empty()) dims = {8192, 4096, 128256, 16384, 2304, 256000};
  if (dims.size() % 3 != 0) {
    std::fprintf(stderr, "usage: lse_gemm_bench [N D V ...]\n");
    return 2;
  }
  const auto dev = xent::cuda_detail::query_device("lse_gemm_bench");
  if (!sg::ready<sg::form::stats, std::int64_t>(dev.id, 1) ||
      !sg::ready<sg::form::logits, std::int64_t>(dev.id, 1) ||
      !sg::ready<sg::form::stats, std::int64_t>(dev.id, 2) ||
      !sg::ready<sg::form::logits, std::int64_t>(dev.id, 2)) {
    std::printf("lse_gemm_bench: the GEMM needs an sm_90 GPU and an sm_90a build; skipped\n");
    return 0;
  }
  cublasHandle_t h;
  check(cublasCreate(&h), "cublasCreate");
  const char* out = std::getenv("OUT");
  std::ofstream json(std::string(out ? out : ".") + "/lse_gemm.json");
  json << "[\n";
  for (std::size_t i = 0; i < dims.size(); i += 3) {
    const std::string line = run_shape(dims[i], dims[i + 1], dims[i + 2], dev, h);
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    json << line << (i + 3 < dims.size() ? ",\n" : "\n");
  }
  json << "]\n";
  cublasDestroy(h);
  return 0;
}
