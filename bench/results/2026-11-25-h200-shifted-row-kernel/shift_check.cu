// Standalone check of policy::shifted_rows: in-place fused bf16/fp32 rows of 50257 classes (not
// 16-byte aligned), the tensor ending its allocation exactly, and one starting an element into
// it; float64 host oracle; run it under compute-sanitizer memcheck too.
#include <cuda_runtime.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <xent/xent.hpp>

#define CK(x)                                                          \
  do {                                                                 \
    cudaError_t e = (x);                                               \
    if (e != cudaSuccess) {                                            \
      std::printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); \
      std::exit(2);                                                    \
    }                                                                  \
  } while (0)

template <class T>
int run(std::int64_t N, std::int64_t V, std::int64_t offset) {
  std::mt19937_64 rng(N * 7 + offset);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<T> x(N * V);
  for (auto& v : x) v = T(normal(rng));
  std::vector<std::int64_t> y(N);
  for (std::int64_t n = 0; n < N; ++n) y[n] = n % 5 == 2 ? -100 : (n * 7919 + (n % 3) * 13) % V;
  y[1] = 0;
  y[3] = V - 1;
  T* buf;
  CK(cudaMalloc(&buf, (N * V + offset) * sizeof(T)));
  T* d = buf + offset;
  CK(cudaMemcpy(d, x.data(), N * V * sizeof(T), cudaMemcpyHostToDevice));
  std::int64_t* dy;
  CK(cudaMalloc(&dy, N * 8));
  CK(cudaMemcpy(dy, y.data(), N * 8, cudaMemcpyHostToDevice));
  float *dloss, *drows;
  CK(cudaMalloc(&dloss, 4));
  CK(cudaMalloc(&drows, N * 4));
  const std::size_t wsb = xent::cuda_workspace_size(N);
  void* ws;
  CK(cudaMalloc(&ws, wsb));
  CK(cudaMemset(ws, 0, wsb));
  int* derr;
  CK(cudaMalloc(&derr, 4));
  CK(cudaMemset(derr, 0, 4));
  xent::cuda exec{nullptr, ws, wsb, derr};
  xent::options opts;
  xent::forward_outputs out;
  out.loss = dloss;
  out.row_loss = {drows, N};
  const xent::matrix_view<T> L(d, N, V);
  xent::forward_backward(exec, L, xent::vector_view<const std::int64_t>(dy, N), opts,
                         xent::upstream{}, out, L);
  CK(cudaDeviceSynchronize());
  std::vector<T> g(N * V);
  CK(cudaMemcpy(g.data(), d, N * V * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> rows(N);
  CK(cudaMemcpy(rows.data(), drows, N * 4, cudaMemcpyDeviceToHost));
  float loss;
  CK(cudaMemcpy(&loss, dloss, 4, cudaMemcpyDeviceToHost));
  double W = 0, total = 0, worst_g = 0, worst_l = 0;
  for (std::int64_t n = 0; n < N; ++n) W += y[n] != -100;
  long bad = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    const bool ign = y[n] == -100;
    double m = -1e300, s = 0;
    for (std::int64_t c = 0; c < V; ++c) m = std::fmax(m, double(float(x[n * V + c])));
    for (std::int64_t c = 0; c < V; ++c) s += std::exp(double(float(x[n * V + c])) - m);
    const double lse = m + std::log(s);
    const double l = ign ? 0.0 : lse - double(float(x[n * V + y[n]]));
    total += l;
    worst_l = std::fmax(worst_l, std::fabs(rows[n] - l) / (std::fabs(l) + 1));
    for (std::int64_t c = 0; c < V; ++c) {
      const double want =
          ign ? 0.0 : (std::exp(double(float(x[n * V + c])) - lse) - (c == y[n])) / W;
      const double got = double(float(g[n * V + c]));
      const double err = std::fabs(got - want);
      worst_g = std::fmax(worst_g, err / (std::fabs(want) + 1e-12));
      if (err > 1e-2 * std::fabs(want) + 1e-10) {
        if (bad < 5)
          std::printf("  row %lld class %lld got %g want %g\n", (long long)n, (long long)c, got,
                      want);
        ++bad;
      }
    }
  }
  const double want_loss = total / W;
  const bool ok =
      bad == 0 && worst_l < 1e-5 && std::fabs(loss - want_loss) < 1e-5 * std::fabs(want_loss);
  std::printf(
      "%s %lld x %lld offset %lld: loss %.7f want %.7f, worst row loss rel %.2e, worst grad rel "
      "%.2e, bad %ld: %s\n",
      sizeof(T) == 4 ? "fp32" : "bf16", (long long)N, (long long)V, (long long)offset, loss,
      want_loss, worst_l, worst_g, bad, ok ? "ok" : "FAIL");
  cudaFree(buf);
  cudaFree(dy);
  cudaFree(dloss);
  cudaFree(drows);
  cudaFree(ws);
  cudaFree(derr);
  return ok ? 0 : 1;
}

int main() {
  int f = 0;
  f += run<Eigen::bfloat16>(300, 50257, 0);
  f += run<Eigen::bfloat16>(300, 50257, 1);
  f += run<Eigen::bfloat16>(401, 20001, 3);
  f += run<float>(150, 50257, 0);
  f += run<float>(150, 50257, 1);
  std::printf("%s\n", f ? "FAILED" : "ALL OK");
  return f;
}
