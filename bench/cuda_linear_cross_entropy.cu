// xent_bench_cuda_linear: fused linear cross-entropy on CUDA (xent::linear_forward,
// xent::linear_forward_backward) against the GEMM floor measured by this binary in this run.
//
// Lines (manual time from CUDA events; bf16 hidden, weight and gradients; class ids, mean):
//   gemm_floor_forward/NxDxV    X · Wᵀ alone (cublasGemmEx, bf16 in and out, float accumulation)
//   gemm_floor_training/NxDxV   X · Wᵀ, then G · W and Gᵀ · X on that output as G: the three GEMMs
//                               of a training step, nothing else, each over all N rows at once
//   linear_forward/NxDxV        loss + LSE
//   linear_forward_backward/NxDxV   loss, d_hidden, d_weight (dw_accumulation::fp32)
//   linear_forward_backward_low_memory/NxDxV   the same in linear_order::low_memory
//   linear_forward_backward_trained/NxDxV   low_memory on trained-like inputs (trained_inputs:
//                               Zipf targets, hidden = a W[y] + noise, a set for a mean loss of
//                               2.5 nats), exact
//   linear_forward_backward_sparse/NxDxV    the same with sparse_threshold
//                               linear_sparse_threshold_bf16 (2^-12)
// Counters:
//   floor_ratio     this line's median time / its floor line's median time (the issue's targets:
//                   <= 1.03 for forward, <= 1.05 for forward_backward)
//   best_ratio      the same with each line's fastest call
//   TFLOPs          2 N V D (forward) or 6 N V D (training) per median second
//   chunk_rows      rows per chunk of the call (training: with the logits in d_weight when that
//                   holds more rows, cuda/dispatch/linear_plan.cuh)
// The time column is Google Benchmark's mean of the iterations; the ratios use the median (the
// device tool's METHOD.md), which a slow first call cannot move.
//   panel_cols      low-memory lines: weight rows per panel of the call's plan
//   extra_MiB       device memory a call needs beyond its inputs: workspace + gradients (+ the
//                   outputs' O(N) floats)
//   exact_ratio     (sparse lines) this line's median / the trained line's of the same shape
//   skipped_pct     (sparse lines) the gradient tiles skipped, % of all (sparse_counts)
//   dh_err, dw_err  (sparse lines) max |sparse - exact| / max |exact| of d_hidden, d_weight
//   loss            (trained and sparse lines) the call's mean loss
// The workspace is the size query's answer for the line's budget (default 256 MiB of chunk room, on
// top of the fixed buffers such as the V x D float d_weight accumulator; the low-memory lines' 256
// MiB in all where a panel of every row fits it; /budget_MiB:B lines give B).
#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>
#include <xent/xent.hpp>

#include "common/cuda_check.hpp"

namespace {

using xent_bench::check;

using bf16 = __nv_bfloat16;

/// Values from a hash of the index, scaled: hidden ~ U(-1, 1), weight ~ U(-1, 1) / sqrt(D), so
/// the logits have a spread like a trained head's.
__global__ void fill_kernel(bf16* out, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    std::uint64_t h = (static_cast<std::uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    out[i] =
        __float2bfloat16_rn((static_cast<float>(h >> 40) * (2.0f / 16777216.0f) - 1.0f) * scale);
  }
}

__global__ void targets_kernel(std::int64_t* out, std::int64_t n, std::int64_t classes) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    out[i] = static_cast<std::int64_t>((static_cast<std::uint64_t>(i) * 2654435761ull) % classes);
}

/// Trained-like hidden rows: x_n = a weight[y_n] + sigma noise, the noise ~ N(0, 1) from four
/// uniforms of a hash (Irwin-Hall, scaled to unit variance).
__global__ void trained_hidden_kernel(bf16* x, const bf16* w, const std::int64_t* y, std::int64_t n,
                                      std::int64_t d, float a, float sigma) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n * d;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    float u = 0.0f;
    for (std::uint64_t j = 0; j < 4; ++j) {
      std::uint64_t h = (static_cast<std::uint64_t>(i) * 4 + j + 77) * 0x9E3779B97F4A7C15ull;
      h ^= h >> 31;
      h *= 0xBF58476D1CE4E5B9ull;
      h ^= h >> 29;
      u += static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    }
    const float noise = (u - 2.0f) * 1.7320508f;
    x[i] = __float2bfloat16_rn(a * __bfloat162float(w[y[i / d] * d + i % d]) + sigma * noise);
  }
}

/// max |a - b| and max |b| over n elements into out[0], out[1] (non-negative floats order as
/// their bits do), for the sparse lines' errors against the exact gradients.
__global__ void max_diff_kernel(const bf16* a, const bf16* b, std::int64_t n, unsigned* out) {
  float diff = 0.0f, big = 0.0f;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    diff = fmaxf(diff, fabsf(x - y));
    big = fmaxf(big, fabsf(y));
  }
  atomicMax(out, __float_as_uint(diff));
  atomicMax(out + 1, __float_as_uint(big));
}

struct shape {
  std::int64_t n, d, v;
};

/// One shape's device buffers, its events and the process's cuBLAS handle.
struct problem {
  shape s;
  bf16 *x = nullptr, *w = nullptr, *dx = nullptr, *dw = nullptr, *logits = nullptr;
  std::int64_t* targets = nullptr;
  float *loss = nullptr, *lse = nullptr;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;
  xent_bench::event_timer timer;
  cublasHandle_t handle{};

  problem(const shape& s_, bool training, bool floor,
          std::size_t budget = xent::linear_default_budget,
          xent::linear_order order = xent::linear_order::fast)
      : s(s_) {
    const auto N = static_cast<std::size_t>(s.n), D = static_cast<std::size_t>(s.d),
               V = static_cast<std::size_t>(s.v);
    check(cudaMalloc(&x, sizeof(bf16) * N * D), "malloc x");
    check(cudaMalloc(&w, sizeof(bf16) * V * D), "malloc w");
    fill_kernel<<<4096, 256>>>(x, s.n * s.d, 1, 1.0f);
    fill_kernel<<<4096, 256>>>(w, s.v * s.d, 2, 1.0f / std::sqrt(static_cast<float>(s.d)));
    check(cudaMalloc(&targets, sizeof(std::int64_t) * N), "malloc targets");
    targets_kernel<<<1024, 256>>>(targets, s.n, s.v);
    check(cudaMalloc(&loss, sizeof(float)), "malloc loss");
    check(cudaMalloc(&lse, sizeof(float) * N), "malloc lse");
    if (training) {
      check(cudaMalloc(&dx, sizeof(bf16) * N * D), "malloc dx");
      check(cudaMalloc(&dw, sizeof(bf16) * V * D), "malloc dw");
    }
    if (floor) {
      check(cudaMalloc(&logits, sizeof(bf16) * N * V), "malloc logits");
    } else {
      const xent::cuda exec;
      const auto pass = training ? xent::linear_pass::training : xent::linear_pass::forward;
      xent::linear_options opts;
      opts.order = order;
      ws_bytes = xent::linear_workspace_size<bf16>(exec, {s.n, s.d, s.v}, pass, opts, budget).bytes;
      check(cudaMalloc(&ws, ws_bytes), "malloc workspace");
    }
    check(cublasCreate(&handle), "cublasCreate");
    check(cudaDeviceSynchronize(), "fill");
  }
  ~problem() {
    for (void* p : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(dx),
                    static_cast<void*>(dw), static_cast<void*>(logits), static_cast<void*>(targets),
                    static_cast<void*>(loss), static_cast<void*>(lse), ws})
      cudaFree(p);
    cublasDestroy(handle);
  }
  problem(const problem&) = delete;
  problem& operator=(const problem&) = delete;

  /// Device seconds of `work`, between two events.
  template <class Work>
  double timed(Work&& work) {
    return timer.ms(work) * 1e-3;
  }

  /// C (m x n, column-major) = op_a(A) op_b(B), bf16 in and out, float accumulation: the GEMMs a
  /// framework would call.
  void gemm(cublasOperation_t op_a, cublasOperation_t op_b, std::int64_t m, std::int64_t n,
            std::int64_t k, const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb,
            bf16* c, std::int64_t ldc) {
    const float alpha = 1.0f, beta = 0.0f;
    check(cublasGemmEx(handle, op_a, op_b, static_cast<int>(m), static_cast<int>(n),
                       static_cast<int>(k), &alpha, a, CUDA_R_16BF, static_cast<int>(lda), b,
                       CUDA_R_16BF, static_cast<int>(ldb), &beta, c, CUDA_R_16BF,
                       static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx");
  }
};

std::string name(const shape& s) {
  return std::to_string(s.n) + "x" + std::to_string(s.d) + "x" + std::to_string(s.v);
}

/// The median and the fastest of a line's call times, in seconds.
struct times {
  std::vector<double> all;
  double median() const {
    std::vector<double> v = all;
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }
  double best() const { return all.empty() ? 0.0 : *std::min_element(all.begin(), all.end()); }
};

/// Each floor line's times, for the ratios (keyed "forward/NxDxV" etc.).
std::map<std::string, times>& floors() {
  static std::map<std::string, times> table;
  return table;
}

/// Each of the state's iterations of `work` timed by p's events, after one warm-up call.
template <class Work>
times timed_calls(benchmark::State& state, problem& p, Work&& work) {
  work();
  check(cudaDeviceSynchronize(), "warm-up");
  times t;
  for (auto _ : state) {
    t.all.push_back(p.timed(work));
    state.SetIterationTime(t.all.back());
  }
  return t;
}

/// The last call's loss; a loss that is not finite makes the line an error.
float checked_loss(benchmark::State& state, const problem& p) {
  float loss = 0.0f;
  check(cudaMemcpy(&loss, p.loss, sizeof(float), cudaMemcpyDeviceToHost), "loss");
  if (!std::isfinite(loss)) state.SkipWithError("loss is not finite");
  return loss;
}

void report(benchmark::State& state, const std::string& key, const times& t, double flops) {
  state.counters["TFLOPs"] = flops / t.median() * 1e-12;
  const auto it = floors().find(key);
  if (it != floors().end()) {
    state.counters["floor_ratio"] = t.median() / it->second.median();
    state.counters["best_ratio"] = t.best() / it->second.best();
  }
}

/// Makes p's inputs trained-like (bench/cpu_linear_cross_entropy.cpp's recipe): targets drawn
/// from a Zipf distribution over the class ids (p(k) ~ 1 / (k + 1)), hidden = a W[y] + 0.3 noise,
/// a bisected so the mean loss of the first 256 rows is 2.5 nats. Returns a.
double make_trained(problem& p) {
  const shape s = p.s;
  std::vector<double> cdf(static_cast<std::size_t>(s.v));
  double total = 0.0;
  for (std::int64_t k = 0; k < s.v; ++k) cdf[k] = total += 1.0 / static_cast<double>(k + 1);
  std::vector<std::int64_t> y(static_cast<std::size_t>(s.n));
  std::uint64_t state = 12345;
  for (auto& t : y) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(state >> 11) * (1.0 / 9007199254740992.0) * total;
    t = std::min<std::int64_t>(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin(), s.v - 1);
  }
  check(cudaMemcpy(p.targets, y.data(), sizeof(std::int64_t) * y.size(), cudaMemcpyHostToDevice),
        "targets");
  const std::int64_t rows = std::min<std::int64_t>(s.n, 256);
  xent::cuda exec;
  exec.cublas = p.handle;
  const std::size_t bytes =
      xent::linear_workspace_size<bf16>(exec, {rows, s.d, s.v}, xent::linear_pass::forward).bytes;
  void* ws = nullptr;
  check(cudaMalloc(&ws, bytes), "malloc trained workspace");
  auto hidden = [&](double a, std::int64_t n) {
    trained_hidden_kernel<<<4096, 256>>>(p.x, p.w, p.targets, n, s.d, static_cast<float>(a), 0.3f);
  };
  auto mean_loss = [&](double a) {
    hidden(a, rows);
    xent::forward_outputs out;
    out.loss = p.loss;
    xent::linear_forward(exec, xent::matrix_view<const bf16>(p.x, rows, s.d),
                         xent::matrix_view<const bf16>(p.w, s.v, s.d),
                         xent::vector_view<const bf16>{},
                         xent::vector_view<const std::int64_t>(p.targets, rows),
                         xent::linear_options{}, out, {ws, bytes});
    float loss = 0.0f;
    check(cudaMemcpy(&loss, p.loss, sizeof(float), cudaMemcpyDeviceToHost), "trained loss");
    return static_cast<double>(loss);
  };
  double lo = 0.0, hi = 64.0;  // the loss falls as a grows
  for (int i = 0; i < 16; ++i) {
    const double mid = 0.5 * (lo + hi);
    (mean_loss(mid) > 2.5 ? lo : hi) = mid;
  }
  hidden(0.5 * (lo + hi), s.n);
  check(cudaDeviceSynchronize(), "trained inputs");
  cudaFree(ws);
  return 0.5 * (lo + hi);
}

/// Each exact trained line's median time, for the sparse lines' exact_ratio.
std::map<std::string, double>& trained_times() {
  static std::map<std::string, double> table;
  return table;
}

/// Training in the low-memory order on trained-like inputs: exact (`tau` 0) or sparse. A sparse
/// line also runs the exact call once, for its gradients' errors.
void trained_line(benchmark::State& state, shape s, float tau) {
  problem p(s, true, false, xent::linear_default_budget, xent::linear_order::low_memory);
  const std::int64_t N = s.n, D = s.d, V = s.v;
  state.counters["a"] = make_trained(p);
  xent::cuda exec;
  exec.cublas = p.handle;
  xent::linear_options opts;
  opts.order = xent::linear_order::low_memory;
  // The sparse call's workspace: the flags' bytes on top.
  std::size_t bytes = p.ws_bytes;
  void* ws = p.ws;
  xent::linear_sparse_counts* counts = nullptr;
  if (tau > 0.0f) {
    opts.sparse_threshold = tau;
    bytes =
        xent::linear_workspace_size<bf16>(exec, {N, D, V}, xent::linear_pass::training, opts).bytes;
    check(cudaMalloc(&ws, bytes), "malloc sparse workspace");
    check(cudaMalloc(&counts, sizeof(*counts)), "malloc counts");
    opts.sparse_counts = counts;
  }
  xent::forward_outputs out;
  out.loss = p.loss;
  const xent::matrix_view<const bf16> X(p.x, N, D), W(p.w, V, D);
  const xent::vector_view<const std::int64_t> y(p.targets, N);
  xent::linear_grads<bf16> grads;
  grads.d_hidden = {p.dx, N, D};
  grads.d_weight = {p.dw, V, D};
  auto work = [&] {
    xent::linear_forward_backward(exec, X, W, xent::vector_view<const bf16>{}, y, opts,
                                  xent::upstream{}, out, grads, {ws, bytes});
  };
  const times t = timed_calls(state, p, work);
  state.counters["loss"] = checked_loss(state, p);
  report(state, "training/" + name(s), t, 8.0 * N * D * V);
  state.counters["extra_MiB"] =
      (static_cast<double>(bytes) + static_cast<double>(sizeof(bf16)) * (N * D + V * D) +
       4.0 * (N + 1)) /
      (1 << 20);
  if (tau == 0.0f) {
    trained_times()[name(s)] = t.median();
    return;
  }
  const auto exact = trained_times().find(name(s));
  if (exact != trained_times().end()) state.counters["exact_ratio"] = t.median() / exact->second;
  xent::linear_sparse_counts c{};
  check(cudaMemcpy(&c, counts, sizeof(c), cudaMemcpyDeviceToHost), "counts");
  state.counters["skipped_pct"] = 100.0 * static_cast<double>(c.skipped) /
                                  static_cast<double>(std::max<std::int64_t>(c.tiles, 1));
  // The exact gradients into the problem's floor buffers' place: fresh ones.
  bf16 *dx = nullptr, *dw = nullptr;
  unsigned* m = nullptr;
  check(cudaMalloc(&dx, sizeof(bf16) * N * D), "malloc exact dx");
  check(cudaMalloc(&dw, sizeof(bf16) * V * D), "malloc exact dw");
  check(cudaMalloc(&m, 4 * sizeof(unsigned)), "malloc max");
  check(cudaMemset(m, 0, 4 * sizeof(unsigned)), "zero max");
  xent::linear_options exact_opts;
  exact_opts.order = xent::linear_order::low_memory;
  xent::linear_grads<bf16> exact_grads;
  exact_grads.d_hidden = {dx, N, D};
  exact_grads.d_weight = {dw, V, D};
  xent::linear_forward_backward(exec, X, W, xent::vector_view<const bf16>{}, y, exact_opts,
                                xent::upstream{}, xent::forward_outputs{}, exact_grads,
                                {p.ws, p.ws_bytes});
  max_diff_kernel<<<1024, 256>>>(p.dx, dx, N * D, m);
  max_diff_kernel<<<1024, 256>>>(p.dw, dw, V * D, m + 2);
  unsigned h[4];
  check(cudaMemcpy(h, m, sizeof(h), cudaMemcpyDeviceToHost), "max");
  auto ratio = [](unsigned diff, unsigned big) {
    float a = 0.0f, b = 0.0f;
    std::memcpy(&a, &diff, 4);
    std::memcpy(&b, &big, 4);
    return b > 0.0f ? static_cast<double>(a) / b : 0.0;
  };
  state.counters["dh_err"] = ratio(h[0], h[1]);
  state.counters["dw_err"] = ratio(h[2], h[3]);
  for (void* q : {static_cast<void*>(dx), static_cast<void*>(dw), static_cast<void*>(m),
                  static_cast<void*>(counts), ws})
    cudaFree(q);
}

void floor_line(benchmark::State& state, shape s, bool training) {
  problem p(s, training, true);
  const std::int64_t N = s.n, D = s.d, V = s.v;
  auto work = [&] {
    // L (N x V) = X · Wᵀ; as G: dX = G · W, dW = Gᵀ · X (row-major, as cuda/linear.cuh maps them).
    p.gemm(CUBLAS_OP_T, CUBLAS_OP_N, V, N, D, p.w, D, p.x, D, p.logits, V);
    if (training) {
      p.gemm(CUBLAS_OP_N, CUBLAS_OP_N, D, N, V, p.w, D, p.logits, V, p.dx, D);
      p.gemm(CUBLAS_OP_N, CUBLAS_OP_T, D, V, N, p.x, D, p.logits, V, p.dw, D);
    }
  };
  work();  // warm-up: cuBLAS's heuristics and module loads
  times t;
  for (auto _ : state) {
    t.all.push_back(p.timed(work));
    state.SetIterationTime(t.all.back());
  }
  floors()[std::string(training ? "training/" : "forward/") + name(s)] = t;
  report(state, "", t, (training ? 6.0 : 2.0) * N * D * V);
  state.counters["extra_MiB"] =
      static_cast<double>(sizeof(bf16)) * (N * V + (training ? N * D + V * D : 0)) / (1 << 20);
}

void xent_line(benchmark::State& state, shape s, bool training, std::size_t budget,
               xent::linear_order order = xent::linear_order::fast) {
  problem p(s, training, false, budget, order);
  const std::int64_t N = s.n, D = s.d, V = s.v;
  xent::cuda exec;
  exec.cublas = p.handle;
  xent::linear_options opts;
  opts.order = order;
  xent::forward_outputs out;
  out.loss = p.loss;
  out.lse = {p.lse, N};
  const xent::matrix_view<const bf16> X(p.x, N, D), W(p.w, V, D);
  const xent::vector_view<const std::int64_t> y(p.targets, N);
  xent::linear_grads<bf16> grads;
  grads.d_hidden = {p.dx, N, D};
  grads.d_weight = {p.dw, V, D};
  const xent::linear_workspace ws{p.ws, p.ws_bytes};
  auto work = [&] {
    if (training)
      xent::linear_forward_backward(exec, X, W, xent::vector_view<const bf16>{}, y, opts,
                                    xent::upstream{}, out, grads, ws);
    else
      xent::linear_forward(exec, X, W, xent::vector_view<const bf16>{}, y, opts, out, ws);
  };
  const times t = timed_calls(state, p, work);
  checked_loss(state, p);
  report(state, std::string(training ? "training/" : "forward/") + name(s), t,
         (training ? 6.0 : 2.0) * N * D * V);
  // The call's own plan: the size query cannot know d_weight's address (the logits' room there).
  const auto pass = training ? xent::linear_pass::training : xent::linear_pass::forward;
  const std::size_t room = xent::cuda_detail::linear_logits_room<bf16>(
      pass, opts.accumulate, grads.d_weight.data, V, D, grads.d_weight.ld);
  state.counters["chunk_rows"] = static_cast<double>(
      order == xent::linear_order::low_memory
          ? xent::cuda_detail::plan_low_memory<bf16, bf16>({N, D, V}, p.ws_bytes).panel.chunk_rows
          : xent::cuda_detail::plan_linear<bf16, bf16>({N, D, V}, pass, opts.accumulate, p.ws_bytes,
                                                       room)
                .chunk_rows);
  if (order == xent::linear_order::low_memory)
    state.counters["panel_cols"] = static_cast<double>(
        xent::cuda_detail::plan_low_memory<bf16, bf16>({N, D, V}, p.ws_bytes).cols);
  state.counters["extra_MiB"] =
      (static_cast<double>(p.ws_bytes) +
       (training ? static_cast<double>(sizeof(bf16)) * (N * D + V * D) : 0.0) + 4.0 * (N + 1)) /
      (1 << 20);
}

const shape shapes[] = {{1024, 1024, 32000}, {8192, 4096, 128256}, {16384, 2304, 256000}};

void register_all() {
  for (const shape& s : shapes)
    for (bool training : {false, true}) {
      const std::string suffix = name(s);
      // Floors first: each xent line's ratio reads its floor's best time.
      benchmark::RegisterBenchmark(
          (std::string(training ? "gemm_floor_training/" : "gemm_floor_forward/") + suffix).c_str(),
          [s, training](benchmark::State& st) { floor_line(st, s, training); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(15);
      // The default budget (256 MiB of chunk room), 1 GiB (fewer, larger GEMMs), and for training
      // 6 GiB: the d_weight GEMM's float accumulator is read and written once per chunk, so its
      // cost falls with the chunk, and 6 GiB holds 16384 x 256000 bf16 logits in one chunk (no
      // accumulator).
      for (std::size_t mib : {std::size_t{256}, std::size_t{1024}, std::size_t{6144}}) {
        if (mib == 6144 && !training) continue;
        const std::string budget = mib == 256 ? "" : "/budget_MiB:" + std::to_string(mib);
        benchmark::RegisterBenchmark(
            (std::string(training ? "linear_forward_backward/" : "linear_forward/") + suffix +
             budget)
                .c_str(),
            [s, training, mib](benchmark::State& st) { xent_line(st, s, training, mib << 20); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->Iterations(15);
      }
      // The low-memory order (issue target: extra beyond the gradients at most 256 MiB), at the
      // default budget; its floor is the same three GEMMs.
      if (training)
        benchmark::RegisterBenchmark(("linear_forward_backward_low_memory/" + suffix).c_str(),
                                     [s](benchmark::State& st) {
                                       xent_line(st, s, true, xent::linear_default_budget,
                                                 xent::linear_order::low_memory);
                                     })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->Iterations(15);
      // The sparse backward on trained-like inputs against the exact low-memory call on them.
      if (training)
        for (float tau : {0.0f, xent::linear_sparse_threshold_bf16})
          benchmark::RegisterBenchmark(
              (std::string(tau == 0.0f ? "linear_forward_backward_trained/"
                                       : "linear_forward_backward_sparse/") +
               suffix)
                  .c_str(),
              [s, tau](benchmark::State& st) { trained_line(st, s, tau); })
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond)
              ->Iterations(15);
    }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
