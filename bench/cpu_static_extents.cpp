// xent_bench_cpu_static: the CPU backend's sweeps with the logits' columns a static extent
// (views.hpp; cpu/row_pass.hpp's for_each_chunk unrolls the chunk loop and fixes every chunk's
// length) against the same calls through run-time sized views, on the seed shapes.
//
//   xent_bench_cpu_static --benchmark_repetitions=7 --benchmark_report_aggregates_only=true
//
// Lines: {forward, forward_backward}/{static, dynamic}/NxV/T/real_time for N x V in 32 x 32000,
// 128 x 32000, 32 x 50257 and T = 1, 2 threads (xent::cpu{T}), timed in real time. forward: int64
// class ids, mean, outputs loss + LSE; forward_backward: the same plus the float gradient to a
// separate buffer (the cached-exponential path). One input set, so a line measures the sweeps with
// the logits in cache (4 to 16 MiB), where a loop's overhead shows most. Counters: items_per_second
// (logits elements); the median over the repetitions is the figure to compare, static against
// dynamic of the same line.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include <xent/xent.hpp>

#include "common/random_fill.hpp"

namespace {

namespace xb = xent_bench;

template <std::int64_t N, std::int64_t V>
struct inputs {
  std::vector<float> logits = std::vector<float>(N * V);
  std::vector<float> grad = std::vector<float>(N * V);
  std::vector<std::int64_t> targets = std::vector<std::int64_t>(N);
  std::vector<float> lse = std::vector<float>(N);
  float loss = 0;

  inputs() {
    xb::fill_normalish(logits.data(), N * V, 1);
    for (std::int64_t n = 0; n < N; ++n) targets[n] = (n * 7919) % V;
  }
};

template <bool Static, bool Fused, std::int64_t N, std::int64_t V>
void run(benchmark::State& state) {
  static inputs<N, V> in;
  const xent::cpu exec(static_cast<int>(state.range(0)));
  xent::forward_outputs out;
  out.loss = &in.loss;
  out.lse = {in.lse.data(), N};
  for (auto _ : state) {
    if constexpr (Static) {
      using shape = xent::extents<N, V>;
      const xent::matrix_view<const float, shape> x(in.logits.data());
      const xent::vector_view<const std::int64_t, xent::extent<N>> t(in.targets.data());
      if constexpr (Fused)
        xent::forward_backward(exec, x, t, xent::options{}, xent::upstream{}, out,
                               xent::matrix_view<float, shape>(in.grad.data()));
      else
        xent::forward(exec, x, t, xent::options{}, out);
    } else {
      const xent::matrix_view<const float> x(in.logits.data(), N, V);
      const xent::vector_view<const std::int64_t> t(in.targets.data(), N);
      if constexpr (Fused)
        xent::forward_backward(exec, x, t, xent::options{}, xent::upstream{}, out,
                               xent::matrix_view<float>(in.grad.data(), N, V));
      else
        xent::forward(exec, x, t, xent::options{}, out);
    }
    benchmark::DoNotOptimize(in.loss);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * N * V);
}

#define XENT_STATIC_LINES(N, V)                     \
  BENCHMARK(run<true, false, N, V>)                 \
      ->Name("forward/static/" #N "x" #V)           \
      ->Arg(1)                                      \
      ->Arg(2)                                      \
      ->UseRealTime();                              \
  BENCHMARK(run<false, false, N, V>)                \
      ->Name("forward/dynamic/" #N "x" #V)          \
      ->Arg(1)                                      \
      ->Arg(2)                                      \
      ->UseRealTime();                              \
  BENCHMARK(run<true, true, N, V>)                  \
      ->Name("forward_backward/static/" #N "x" #V)  \
      ->Arg(1)                                      \
      ->Arg(2)                                      \
      ->UseRealTime();                              \
  BENCHMARK(run<false, true, N, V>)                 \
      ->Name("forward_backward/dynamic/" #N "x" #V) \
      ->Arg(1)                                      \
      ->Arg(2)                                      \
      ->UseRealTime()

XENT_STATIC_LINES(32, 32000);
XENT_STATIC_LINES(128, 32000);
XENT_STATIC_LINES(32, 50257);

}  // namespace

BENCHMARK_MAIN();
