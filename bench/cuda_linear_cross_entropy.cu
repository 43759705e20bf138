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

void report(benchmark::State& state, const std::string& key, const times& t, double flops) {
  state.counters["TFLOPs"] = flops / t.median() * 1e-12;
  const auto it = floors().find(key);
  if (it != floors().end()) {
    state.counters["floor_ratio"] = t.median() / it->second.median();
    state.counters["best_ratio"] = t.best() / it->second.best();
  }
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
  work();  // warm-up
  check(cudaDeviceSynchronize(), "warm-up");
  times t;
  for (auto _ : state) {
    t.all.push_back(p.timed(work));
    state.SetIterationTime(t.all.back());
  }
  float loss = 0.0f;
  check(cudaMemcpy(&loss, p.loss, sizeof(float), cudaMemcpyDeviceToHost), "loss");
  if (!std::isfinite(loss)) state.SkipWithError("loss is not finite");
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
