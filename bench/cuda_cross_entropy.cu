// CUDA benchmarks: forward, forward_backward (in place) and backward on the shapes of ANCHORS.md,
// timed with CUDA events (manual time), bytes/s of the minimum traffic and % of a device-to-device
// copy roof measured by this binary in this run (roof_pct: a 2 GiB cudaMemcpyAsync; copy_same_pct:
// a copy of the line's own traffic, which pays the same ramp and tail). Each timed call starts from
// freshly written random logits and a cold L2: a 256 MiB buffer is read or overwritten in between,
// untimed (XENT_BENCH_FLUSH; common/l2_flush.cuh says why the two differ).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <xent/xent.hpp>

#include "common/cuda_check.hpp"
#include "common/device_fill.cuh"
#include "common/l2_flush.cuh"
#include "common/traffic.hpp"

namespace {

using xent_bench::check;

using xent_bench::fill_kernel;
using xent_bench::targets_kernel;

/// Device buffers reused across benchmarks (the largest shape sizes them).
struct arena {
  void* logits = nullptr;
  void* grad = nullptr;
  std::size_t bytes = 0;
  std::int64_t* targets = nullptr;
  float* lse = nullptr;
  float* loss = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  void* flush = nullptr;
  static constexpr std::size_t flush_bytes = std::size_t{256} << 20;
  cudaEvent_t start{}, stop{};

  void reserve(std::size_t b, std::int64_t rows) {
    if (b > bytes) {
      cudaFree(logits);
      cudaFree(grad);
      check(cudaMalloc(&logits, b), "cudaMalloc logits");
      check(cudaMalloc(&grad, b), "cudaMalloc grad");
      bytes = b;
    }
    const std::size_t ws = xent::cuda_workspace_size(rows);
    if (ws > workspace_bytes) {
      cudaFree(workspace);
      cudaFree(targets);
      cudaFree(lse);
      check(cudaMalloc(&workspace, ws), "cudaMalloc workspace");
      check(cudaMemset(workspace, 0, ws), "cudaMemset workspace");  // xent::cuda's contract
      check(cudaMalloc(&targets, sizeof(std::int64_t) * rows), "cudaMalloc targets");
      check(cudaMalloc(&lse, sizeof(float) * rows), "cudaMalloc lse");
      workspace_bytes = ws;
    }
    if (!flush) {
      check(cudaMalloc(&flush, flush_bytes), "cudaMalloc flush");
      check(cudaMalloc(&loss, sizeof(float)), "cudaMalloc loss");
      check(cudaEventCreate(&start), "event");
      check(cudaEventCreate(&stop), "event");
    }
  }
};

arena& buffers() {
  static arena a;
  return a;
}

/// Leaves L2 cold before a timed call (l2_flush.cuh: XENT_BENCH_FLUSH says how).
void flush_l2(arena& a, std::uint64_t seed) { xent_bench::flush_l2(a.flush, a.flush_bytes, seed); }

/// Seconds of device time of `work`, between two events.
template <class Work>
double event_seconds(arena& a, Work&& work) {
  check(cudaEventRecord(a.start), "record");
  work();
  check(cudaEventRecord(a.stop), "record");
  check(cudaEventSynchronize(a.stop), "sync");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, a.start, a.stop), "elapsed");
  return ms * 1e-3;
}

/// Runs `work` between two events and reports its device time as the iteration's manual time;
/// returns it in seconds.
template <class Work>
double timed(benchmark::State& state, arena& a, Work&& work) {
  const double s = event_seconds(a, work);
  state.SetIterationTime(s);
  return s;
}

double& copy_roof() {  // bytes/s, read + written
  static double roof = 0.0;
  return roof;
}

void BM_copy_roof(benchmark::State& state) {
  const std::size_t bytes = std::size_t{2} << 30;
  arena& a = buffers();
  a.reserve(bytes, 1);
  double total = 0.0;
  for (auto _ : state)
    total += timed(state, a, [&] {
      check(cudaMemcpyAsync(a.grad, a.logits, bytes, cudaMemcpyDeviceToDevice), "copy");
    });
  copy_roof() = 2.0 * static_cast<double>(bytes) * state.iterations() / total;
  state.SetBytesProcessed(static_cast<std::int64_t>(2 * bytes) * state.iterations());
  state.counters["roof_pct"] = 100.0;
}

/// How an SM-driven stream moves the copy roof's bytes (BM_copy_kernel), to set the kernels'
/// figures beside what a kernel can reach at all: 16-byte register loads and stores (out of
/// place, or in place as the fused pass writes), loads into registers with stores by bulk copy
/// from shared memory, or bulk copies both ways (the TMA's 1-D form, sm_90; out of place as the
/// backward from a saved LSE writes, or in place as the fused pass does).
enum class copy_mode {
  registers = 0,
  registers_in_place = 1,
  bulk_stores = 2,
  bulk_both = 3,
  bulk_both_in_place = 4
};

#ifndef XENT_BENCH_COPY_REGS  // 16-byte vectors per thread per step
#define XENT_BENCH_COPY_REGS 4
#endif
#ifndef XENT_BENCH_COPY_CTAS  // CTAs per SM
#define XENT_BENCH_COPY_CTAS 4
#endif
constexpr int copy_block = 256, copy_regs = XENT_BENCH_COPY_REGS;  // 16 KiB per CTA per step
constexpr unsigned copy_step = copy_block * copy_regs * 16;

/// The register modes: 16-byte loads, then 16-byte stores or a bulk store of the step.
template <copy_mode Mode, class Stage>
__device__ void copy_by_threads(const uint4* src, uint4* dst, std::size_t steps, Stage& stage) {
  constexpr int per_step = copy_block * copy_regs;
  std::size_t k = 0;
  for (std::size_t t = blockIdx.x; t < steps; t += gridDim.x, ++k) {
    uint4 v[copy_regs];
#pragma unroll
    for (int r = 0; r < copy_regs; ++r)
      v[r] = __ldcs(src + t * per_step + r * copy_block + threadIdx.x);
    if constexpr (Mode == copy_mode::bulk_stores) {
      const int s = static_cast<int>(k & 1);
      if (threadIdx.x == 0) xent::cuda_detail::bulk_stores_wait<1>();
      __syncthreads();
#pragma unroll
      for (int r = 0; r < copy_regs; ++r) stage[s][r * copy_block + threadIdx.x] = v[r];
      xent::cuda_detail::fence_async_shared();  // visible to the bulk copy
      __syncthreads();
      if (threadIdx.x == 0) xent::cuda_detail::bulk_store(dst + t * per_step, stage[s], copy_step);
    } else {
#pragma unroll
      for (int r = 0; r < copy_regs; ++r) dst[t * per_step + r * copy_block + threadIdx.x] = v[r];
    }
  }
  if (Mode == copy_mode::bulk_stores && threadIdx.x == 0) xent::cuda_detail::bulk_stores_wait<0>();
}

/// `steps` steps of copy_step bytes from src to dst, dealt to persistent CTAs in order.
template <copy_mode Mode>
__global__ void __launch_bounds__(copy_block)
    copy_kernel(const uint4* src, uint4* dst, std::size_t steps) {
  constexpr int per_step = copy_block * copy_regs;  // vectors
  // Two steps staged (static shared memory stops at 48 KiB: the bulk modes take 16 KiB steps).
  constexpr bool staged = copy_regs <= 4;
  __shared__ alignas(128) uint4 stage[2][staged ? per_step : 1];
  __shared__ unsigned long long landed[2];
  std::size_t k = 0;
  if constexpr (!staged && Mode != copy_mode::registers) {
    return;
  } else if constexpr (Mode == copy_mode::bulk_both) {
    if (threadIdx.x != 0) return;
    xent::cuda_detail::mbarrier_init(&landed[0], 1);
    xent::cuda_detail::mbarrier_init(&landed[1], 1);
    xent::cuda_detail::mbarrier_init_fence();
    for (std::size_t t = blockIdx.x; t < steps; t += gridDim.x, ++k) {
      const int s = static_cast<int>(k & 1);
      xent::cuda_detail::bulk_stores_wait<1>();  // the store that read this stage two steps ago is
                                                 // done with it
      xent::cuda_detail::mbarrier_arrive_expect(&landed[s], copy_step);
      xent::cuda_detail::bulk_copy(stage[s], src + t * per_step, copy_step, &landed[s]);
      xent::cuda_detail::mbarrier_wait(&landed[s], static_cast<unsigned>(k >> 1) & 1u);
      xent::cuda_detail::bulk_store(dst + t * per_step, stage[s], copy_step);
    }
    xent::cuda_detail::bulk_stores_wait<0>();
  } else {
    copy_by_threads<Mode>(src, dst, steps, stage);
  }
}

/// The current device's multiprocessors (the copy kernels' persistent grids).
int sm_count() {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "device");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "sms");
  return sms;
}

/// The copy roof's 2 GiB by copy_kernel (copy_mode in the argument), as a % of that roof.
void BM_copy_kernel(benchmark::State& state) {
  const auto mode = static_cast<copy_mode>(state.range(0));
  const std::size_t bytes = std::size_t{2} << 30;
  arena& a = buffers();
  a.reserve(bytes, 1);
  const int sms = sm_count();
  const auto* src = static_cast<const uint4*>(a.logits);
  const bool in_place =
      mode == copy_mode::registers_in_place || mode == copy_mode::bulk_both_in_place;
  auto* dst = static_cast<uint4*>(in_place ? a.logits : a.grad);
  const std::size_t steps = bytes / copy_step;
  if (mode >= copy_mode::bulk_stores && copy_regs > 4) {
    state.SkipWithError("bulk modes take steps of at most 16 KiB");
    return;
  }
  auto launch = [&] {
    switch (mode) {
      case copy_mode::registers:
      case copy_mode::registers_in_place:
        copy_kernel<copy_mode::registers>
            <<<sms * XENT_BENCH_COPY_CTAS, copy_block>>>(src, dst, steps);
        break;
      case copy_mode::bulk_stores:
        copy_kernel<copy_mode::bulk_stores>
            <<<sms * XENT_BENCH_COPY_CTAS, copy_block>>>(src, dst, steps);
        break;
      case copy_mode::bulk_both:
      case copy_mode::bulk_both_in_place:
        copy_kernel<copy_mode::bulk_both>
            <<<sms*(6 * 4 / copy_regs), copy_block>>>(src, dst, steps);  // 6 x 32 KiB of stages
        break;
    }
    check(cudaGetLastError(), "copy kernel");
  };
  launch();
  check(cudaDeviceSynchronize(), "warm-up");
  double total = 0.0;
  for (auto _ : state) total += timed(state, a, launch);
  const double rate = 2.0 * static_cast<double>(bytes) * state.iterations() / total;
  state.SetBytesProcessed(static_cast<std::int64_t>(2 * bytes) * state.iterations());
  state.counters["roof_pct"] = copy_roof() > 0 ? 100.0 * rate / copy_roof() : 0.0;
}

/// backward_in_place: the backward from a saved LSE with the gradient over the logits, as the
/// fused pass writes it (backward's grad may be the logits).
enum class op { forward, forward_backward, backward, backward_in_place };

/// Reduction R: mean (the default), sum (no normaliser) or none (each row's loss only, no sum
/// across rows). E: the views' extents, run-time sized by default; static (the line's shape)
/// for the seed shapes' compile-time launch plan.
template <class T, op Op, xent::reduction R = xent::reduction::mean,
          class E = xent::dynamic_extents>
void BM_cross_entropy(benchmark::State& state) {
  const std::int64_t rows = state.range(0), cols = state.range(1);
  const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(rows * cols);
  arena& a = buffers();
  a.reserve(bytes, rows);
  T* logits = static_cast<T*>(a.logits);
  T* grad = static_cast<T*>(a.grad);
  targets_kernel<<<1024, 256>>>(a.targets, rows, cols);
  xent::cuda exec;
  exec.workspace = a.workspace;
  exec.workspace_bytes = a.workspace_bytes;
  const xent::matrix_view<T, E> L(logits, rows, cols);
  const xent::vector_view<const std::int64_t, xent::extent<E::rows>> y(a.targets, rows);
  xent::options opts;
  opts.reduce = R;
  constexpr bool rows_only = R == xent::reduction::none;
  xent::forward_outputs out;
  out.loss = rows_only ? nullptr : a.loss;
  (rows_only ? out.row_loss : out.lse) = {a.lse, rows};
  auto call = [&] {
    if constexpr (Op == op::forward)
      xent::forward(exec, L, y, opts, out);
    else if constexpr (Op == op::forward_backward)
      xent::forward_backward(exec, L, y, opts, xent::upstream{}, out, L);  // in place
    else
      xent::backward(exec, L, y, opts, xent::vector_view<const float>(a.lse, rows),
                     xent::upstream{},
                     xent::matrix_view<T, E>(Op == op::backward ? grad : logits, rows, cols));
  };
  std::uint64_t seed = 1;
  auto refresh = [&] {
    fill_kernel<T><<<4096, 256>>>(logits, rows * cols, seed++, 2.0f);
    if (Op == op::backward || Op == op::backward_in_place) xent::forward(exec, L, y, opts, out);
    flush_l2(a, seed);
  };
  refresh();
  call();  // warm-up: module load, first-launch costs
  check(cudaDeviceSynchronize(), "warm-up");
  double total = 0.0;
  for (auto _ : state) {
    refresh();
    total += timed(state, a, call);
  }
  const auto p = Op == op::forward ? xent_bench::pass::forward : xent_bench::pass::forward_backward;
  const std::int64_t traffic = xent_bench::min_traffic_bytes(p, rows, cols, sizeof(T));
  xent_bench::report_traffic(state, traffic, rows * cols, total, copy_roof());
  // copy_same_pct: against a copy of this line's size, cudaMemcpyAsync moving the same bytes (half
  // read, half written) after the same refresh, as many times: whether the 2 GiB roof, which
  // amortises a pass's ramp and tail, is fair to a smaller matrix. (H200: at bf16 8192 x 32000 the
  // same-size copy ran at 98-99.6% of the 2 GiB copy's rate, a read of the matrix with no work at
  // 90-93%; bench/row_read_probe.cu) One untimed copy first: the first write of a fresh allocation
  // ran 10% slower there.
  auto copy_traffic = [&] {
    check(cudaMemcpyAsync(a.grad, a.logits, static_cast<std::size_t>(traffic / 2),
                          cudaMemcpyDeviceToDevice),
          "copy");
  };
  copy_traffic();
  double copy_total = 0.0;
  for (std::int64_t i = 0; i < state.iterations(); ++i) {
    refresh();
    copy_total += event_seconds(a, copy_traffic);
  }
  state.counters["copy_same_pct"] = 100.0 * copy_total / total;
  // The loss of one call on logits of a fixed seed: the same (to float rounding) for every
  // variant of a kernel (bench/cuda_variants.sh compares builds by it), never non-finite.
  seed = 0;
  refresh();
  call();
  float loss = 0.0f;  // reduction none: row 0's
  check(cudaMemcpy(&loss, rows_only ? a.lse : a.loss, sizeof(float), cudaMemcpyDeviceToHost),
        "loss");
  state.counters["loss"] = loss;
  if (!std::isfinite(loss)) state.SkipWithError("the loss is not finite");
}

__global__ void empty_kernel() {}

/// The seed shapes' refresh between timed calls, as BM_cross_entropy's for fp32 logits: new
/// random logits, then the flush that leaves L2 cold.
void refresh_small(arena& a, std::int64_t elements, std::uint64_t& seed) {
  fill_kernel<float><<<4096, 256>>>(static_cast<float*>(a.logits), elements, seed++, 2.0f);
  flush_l2(a, seed);
}

/// The harness's floor for the seed shapes: an empty kernel of the small-batch kernel's geometry
/// for fp32 32 x 32000 (32 rows x 9 CTAs of 256 threads, in clusters of 9 or without clusters),
/// after the same refresh and timed between the same events. A seed-shape line's time above this
/// is the kernel's own.
void BM_launch_floor(benchmark::State& state) {
  const bool clusters = state.range(0) != 0;
  const std::int64_t rows = 32, cols = 32000;
  arena& a = buffers();
  a.reserve(sizeof(float) * static_cast<std::size_t>(rows * cols), rows);
  check(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
        "cluster attribute");
  cudaLaunchAttribute attr[1] = {xent::cuda_detail::cluster_attribute(9)};
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(9, static_cast<unsigned>(rows), 1);
  cfg.blockDim = dim3(256, 1, 1);
  cfg.attrs = attr;
  cfg.numAttrs = clusters ? 1 : 0;
  auto launch = [&] { check(cudaLaunchKernelEx(&cfg, empty_kernel), "launch"); };
  std::uint64_t seed = 1;
  launch();
  check(cudaDeviceSynchronize(), "warm-up");
  for (auto _ : state) {
    refresh_small(a, rows * cols, seed);
    timed(state, a, launch);
  }
  state.counters["cluster"] = clusters ? 9 : 1;
}

/// The seed shapes' floor for moving their bytes, after the same refresh, timed between the same
/// events: every fp32 logit read once and written back in place by copy_kernel, one 16 KiB step
/// per CTA (the last rounded up past the logits) from registers (mode 0, the fused pass's own
/// pattern) or by bulk copies both ways (1); the same steps dealt to four persistent CTAs per SM,
/// each overlapping one step's stores with the next one's loads (2); or the driver's
/// device-to-device copy into the gradient buffer (3, cudaMemcpyAsync). Each does what a fused
/// pass must at the least (one read, one write, no cluster); a fused line's time above the
/// fastest is what the statistics, the cluster exchange and the dependent gradient stores add.
/// roof_pct: the fused pass's minimum traffic against the 2 GiB copy roof, as on the fused lines.
void BM_pass_floor(benchmark::State& state) {
  const std::int64_t rows = state.range(0), cols = state.range(1);
  const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(rows * cols);
  const std::size_t steps = (bytes + copy_step - 1) / copy_step;
  arena& a = buffers();
  a.reserve(steps * copy_step, rows);
  auto* p = static_cast<uint4*>(a.logits);
  const auto mode = state.range(2);
  if (mode == 1 && copy_regs > 4) {
    state.SkipWithError("bulk modes take steps of at most 16 KiB");
    return;
  }
  const int sms = sm_count();
  const auto grid = static_cast<unsigned>(mode == 2 ? sms * XENT_BENCH_COPY_CTAS : steps);
  auto launch = [&] {
    if (mode == 3) {
      check(cudaMemcpyAsync(a.grad, a.logits, bytes, cudaMemcpyDeviceToDevice), "copy");
      return;
    }
    if (mode == 1)
      copy_kernel<copy_mode::bulk_both><<<grid, copy_block>>>(p, p, steps);
    else
      copy_kernel<copy_mode::registers><<<grid, copy_block>>>(p, p, steps);
    check(cudaGetLastError(), "copy kernel");
  };
  std::uint64_t seed = 1;
  launch();
  check(cudaDeviceSynchronize(), "warm-up");
  double total = 0.0;
  for (auto _ : state) {
    refresh_small(a, rows * cols, seed);
    total += timed(state, a, launch);
  }
  xent_bench::report_traffic(
      state, xent_bench::min_traffic_bytes(xent_bench::pass::forward_backward, rows, cols, 4),
      rows * cols, total, copy_roof());
}

/// The timed seconds a line of microsecond calls takes. Each call follows an untimed L2 flush and
/// refresh (about 100 us) and Google Benchmark sizes its loop by the timed seconds, so its default
/// half second ran a seed-shape line for about 10 s a repetition; 20 ms is thousands of calls.
constexpr double small_min_time = 0.02;

void shapes(benchmark::internal::Benchmark* b, bool seed_shapes, bool training_shapes) {
  if (seed_shapes) {
    b->Args({32, 32000})->Args({128, 32000})->Args({32, 50257})->Args({32, 50256});
    b->MinTime(small_min_time);
  }
  if (training_shapes) b->Args({8192, 32000})->Args({16384, 128256})->Args({4096, 262144});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK(BM_copy_roof)->UseManualTime()->Unit(benchmark::kMicrosecond)->Iterations(20);
BENCHMARK(BM_copy_kernel)
    ->DenseRange(0, 4)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->Iterations(20);
BENCHMARK(BM_launch_floor)
    ->Arg(0)
    ->Arg(1)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(small_min_time);
BENCHMARK(BM_pass_floor)
    ->ArgsProduct({{32}, {32000, 50257}, {0, 1, 2, 3}})
    ->ArgsProduct({{128}, {32000}, {0, 1, 2, 3}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(small_min_time);

#define XENT_CUDA_BENCH(T, OP, SEED, TRAIN)                                                  \
  BENCHMARK_TEMPLATE(BM_cross_entropy, T, OP)->Apply([](benchmark::internal::Benchmark* b) { \
    shapes(b, SEED, TRAIN);                                                                  \
  })

XENT_CUDA_BENCH(float, op::forward_backward, true, false);
XENT_CUDA_BENCH(float, op::forward, true, false);
// The seed shapes by reduction: what the mean's normaliser and the cross-row sum cost there.
#define XENT_CUDA_SEED_BENCH(OP, R)                  \
  BENCHMARK_TEMPLATE(BM_cross_entropy, float, OP, R) \
      ->Apply([](benchmark::internal::Benchmark* b) { shapes(b, true, false); })
XENT_CUDA_SEED_BENCH(op::forward_backward, xent::reduction::sum);
XENT_CUDA_SEED_BENCH(op::forward, xent::reduction::sum);
XENT_CUDA_SEED_BENCH(op::forward_backward, xent::reduction::none);
XENT_CUDA_SEED_BENCH(op::forward, xent::reduction::none);
// The seed shapes as static extents (a launch plan fixed at compile time, dispatch/rows.cuh's
// try_small_rows) beside the run-time sized lines above.
#define XENT_CUDA_STATIC_SEED_BENCH(OP, N, V)                                                 \
  BENCHMARK_TEMPLATE(BM_cross_entropy, float, OP, xent::reduction::mean, xent::extents<N, V>) \
      ->Args({N, V})                                                                          \
      ->UseManualTime()                                                                       \
      ->Unit(benchmark::kMicrosecond)                                                         \
      ->MinTime(small_min_time)
XENT_CUDA_STATIC_SEED_BENCH(op::forward_backward, 32, 32000);
XENT_CUDA_STATIC_SEED_BENCH(op::forward_backward, 128, 32000);
XENT_CUDA_STATIC_SEED_BENCH(op::forward_backward, 32, 50257);
XENT_CUDA_STATIC_SEED_BENCH(op::forward, 32, 32000);
XENT_CUDA_STATIC_SEED_BENCH(op::forward, 128, 32000);
XENT_CUDA_STATIC_SEED_BENCH(op::forward, 32, 50257);
XENT_CUDA_BENCH(__nv_bfloat16, op::forward_backward, false, true);
XENT_CUDA_BENCH(__nv_bfloat16, op::forward, false, true);
XENT_CUDA_BENCH(__nv_bfloat16, op::backward, false, true);
XENT_CUDA_BENCH(__nv_bfloat16, op::backward_in_place, false, true);
// The shortest training rows by reduction: what the reduced loss costs the pass there (none),
// and how much of it is the mean's normaliser, which the fused pass needs before any gradient
// (sum needs none).
#define XENT_CUDA_SHORT_ROWS_BENCH(OP, R)                    \
  BENCHMARK_TEMPLATE(BM_cross_entropy, __nv_bfloat16, OP, R) \
      ->Args({8192, 32000})                                  \
      ->UseManualTime()                                      \
      ->Unit(benchmark::kMicrosecond)
XENT_CUDA_SHORT_ROWS_BENCH(op::forward, xent::reduction::none);
XENT_CUDA_SHORT_ROWS_BENCH(op::forward_backward, xent::reduction::none);
XENT_CUDA_SHORT_ROWS_BENCH(op::forward, xent::reduction::sum);
XENT_CUDA_SHORT_ROWS_BENCH(op::forward_backward, xent::reduction::sum);
// Lines of one dtype and pass over a list of shapes (`Shapes`: a function adding their Args).
#define XENT_CUDA_LINES(T, OP, Shapes)        \
  BENCHMARK_TEMPLATE(BM_cross_entropy, T, OP) \
      ->Apply(Shapes)                         \
      ->UseManualTime()                       \
      ->Unit(benchmark::kMicrosecond)
// Fused rows of 40-128 KiB besides 8192 x 32000: where policy::wide_from_bytes draws its line.
static void wide_line_shapes(benchmark::internal::Benchmark* b) {
  b->Args({8192, 20480})->Args({8192, 49152})->Args({8192, 65536});
}
XENT_CUDA_LINES(__nv_bfloat16, op::forward_backward, wide_line_shapes);
// 8192 x 32000 beside whole rounds of its 132 persistent clusters on an H100 / H200 (clusters of
// two CTAs, two CTAs per SM): 62 rows each (8184) and 63 (8316), where 8192 rows leave 8 clusters a
// 63rd row. H200, two rounds: 8192 rows 279 us (89.0-89.1% of the copy roof), 8184 282 (88.1), 8316
// 282 (89.2-89.4): the partial last round is not what keeps the pass under 90%.
static void row_round_shapes(benchmark::internal::Benchmark* b) {
  b->Args({8184, 32000})->Args({8316, 32000});
}
XENT_CUDA_LINES(__nv_bfloat16, op::forward_backward, row_round_shapes);
// GPT-2's vocabulary: rows that are not 16-byte aligned (50257 x 2 bytes) beside aligned ones of
// nearly the same length (50304, GPT-NeoX's padded vocabulary).
static void gpt2_shapes(benchmark::internal::Benchmark* b) {
  b->Args({8192, 50257})->Args({8192, 50304});
}
XENT_CUDA_LINES(__nv_bfloat16, op::forward_backward, gpt2_shapes);
XENT_CUDA_LINES(__nv_bfloat16, op::forward, gpt2_shapes);
XENT_CUDA_LINES(__nv_bfloat16, op::backward, gpt2_shapes);
// More fused calls on rows off 16-byte boundaries (policy::shifted_rows against the two kernels
// through the LSE): a short batch past the small-batch kernel's reach and short rows (a CTA
// each); fp32 8192 x 50257 below.
static void shifted_shapes(benchmark::internal::Benchmark* b) {
  b->Args({256, 50257})->Args({65536, 3001});
}
XENT_CUDA_LINES(__nv_bfloat16, op::forward_backward, shifted_shapes);
// Many short rows (6 KiB in bf16), aligned, each pass: what a row costs the kernels beside its
// bytes (65536 x 3001 above is the same rows off 16-byte boundaries).
static void short_batch_shapes(benchmark::internal::Benchmark* b) { b->Args({65536, 3008}); }
XENT_CUDA_LINES(__nv_bfloat16, op::forward_backward, short_batch_shapes);
XENT_CUDA_LINES(__nv_bfloat16, op::forward, short_batch_shapes);
XENT_CUDA_LINES(__nv_bfloat16, op::backward, short_batch_shapes);
// The same short rows off 16-byte boundaries (the fused line is with shifted_shapes above):
// policy::warp_rows_shifted_passes against the streaming kernels' shifted forms.
static void short_unaligned_shapes(benchmark::internal::Benchmark* b) { b->Args({65536, 3001}); }
XENT_CUDA_LINES(__nv_bfloat16, op::forward, short_unaligned_shapes);
XENT_CUDA_LINES(__nv_bfloat16, op::backward, short_unaligned_shapes);
// Rows of 12 and 24 KiB (the same bytes as 65536 x 3008): where policy::split_fused_kib and the
// warp-rows kernel's long form draw their lines, with 8192 x 20480 (40 KiB) and 8192 x 32000 above.
static void split_line_shapes(benchmark::internal::Benchmark* b) {
  b->Args({32768, 6016})->Args({16384, 12032});
}
XENT_CUDA_LINES(__nv_bfloat16, op::forward_backward, split_line_shapes);
XENT_CUDA_LINES(__nv_bfloat16, op::forward, split_line_shapes);
BENCHMARK_TEMPLATE(BM_cross_entropy, float, op::forward_backward)
    ->Args({8192, 16384})
    ->Args({8192, 32000})
    ->Args({8192, 50257})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_cross_entropy, float, op::forward_backward)
    ->Args({8192, 128256})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_cross_entropy, float, op::forward)
    ->Args({8192, 128256})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("flush", xent_bench::flush_name());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
