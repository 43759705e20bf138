// Vocab-parallel forward_backward on the CUDA backend over NCCL: bf16 16384 x 128256 (or the
// shape given) split over the visible GPUs (Megatron's split), one thread per GPU, against the
// single-GPU xent::forward_backward on the whole matrix timed by this binary in this run.
//
//   xent_bench_cuda_vocab_parallel [rows cols [iterations [gpus]]]
//
// Timing: before each iteration every rank refreshes its logits and overwrites a 256 MiB buffer
// (a cold L2, as bench/cuda_cross_entropy.cu does), waits for that, and meets the other ranks at
// a host barrier; rank 0 then records CUDA events around its call on its stream. Its call ends
// only after the all-gather, which needs every rank's statistics, so the time covers the slowest
// rank's statistics pass, the collective, and rank 0's merge and gradient. The gradient is
// written in place, as in the single-GPU benchmark. Prints a table and one JSON line.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>
#include <xent/parallel/nccl_group.cuh>
#include <xent/xent.hpp>

#include "common/cuda_check.hpp"
#include "common/device_fill.cuh"

namespace {

using xent_bench::check;

void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, ncclGetErrorString(r));
    std::exit(1);
  }
}

using bf16 = __nv_bfloat16;
constexpr std::size_t flush_bytes = std::size_t{256} << 20;

/// One GPU's buffers for an N x cols bf16 matrix (gradient in place).
struct device_state {
  bf16* logits = nullptr;
  std::int64_t* targets = nullptr;
  float* loss = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  void* flush = nullptr;
  cudaStream_t stream{};
  cudaEvent_t start{}, stop{};

  device_state(std::int64_t rows, std::int64_t cols, std::int64_t vocab, std::size_t ws_bytes) {
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    check(cudaMalloc(&logits, sizeof(bf16) * static_cast<std::size_t>(rows * cols + 1)), "logits");
    check(cudaMalloc(&targets, sizeof(std::int64_t) * static_cast<std::size_t>(rows + 1)), "ids");
    check(cudaMalloc(&loss, sizeof(float)), "loss");
    check(cudaMalloc(&workspace, ws_bytes), "workspace");
    check(cudaMemset(workspace, 0, ws_bytes), "workspace");  // xent::cuda's contract
    workspace_bytes = ws_bytes;
    check(cudaMalloc(&flush, flush_bytes), "flush");
    check(cudaEventCreate(&start), "event");
    check(cudaEventCreate(&stop), "event");
    xent_bench::targets_kernel<<<1024, 256, 0, stream>>>(targets, rows, vocab);
    check(cudaStreamSynchronize(stream), "targets");
  }
  ~device_state() {
    cudaFree(logits);
    cudaFree(targets);
    cudaFree(loss);
    cudaFree(workspace);
    cudaFree(flush);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }
  /// Fresh logits (the previous iteration overwrote them with the gradient) and a cold L2.
  void refresh(std::int64_t elements, std::uint64_t seed) {
    xent_bench::fill_kernel<bf16><<<4096, 256, 0, stream>>>(logits, elements, seed, 2.0f);
    check(cudaMemsetAsync(flush, static_cast<int>(seed & 0xff), flush_bytes, stream), "flush");
    check(cudaStreamSynchronize(stream), "refresh");
  }
  float elapsed_ms() {
    check(cudaEventSynchronize(stop), "sync");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    return ms;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// xent::forward_backward over the whole matrix on device 0: the median of `iterations` calls.
double single_gpu_ms(std::int64_t rows, std::int64_t cols, int iterations) {
  check(cudaSetDevice(0), "device 0");
  device_state d(rows, cols, cols, xent::cuda_workspace_size(rows));
  const xent::cuda exec{d.stream, d.workspace, d.workspace_bytes, nullptr};
  const xent::matrix_view<bf16> x(d.logits, rows, cols);
  xent::forward_outputs out;
  out.loss = d.loss;
  std::vector<double> times;
  for (int i = -1; i < iterations; ++i) {  // i = -1: warm-up (module load, first launch)
    d.refresh(rows * cols, static_cast<std::uint64_t>(i + 2));
    check(cudaEventRecord(d.start, d.stream), "record");
    xent::forward_backward(exec, x, xent::vector_view<const std::int64_t>(d.targets, rows),
                           xent::options{}, xent::upstream{}, out, x);
    check(cudaEventRecord(d.stop, d.stream), "record");
    const double ms = d.elapsed_ms();
    if (i >= 0) times.push_back(ms);
  }
  return median(times);
}

/// The vocab-parallel call over `gpus` GPUs: rank 0's median time.
double vocab_parallel_ms(std::int64_t rows, std::int64_t vocab, int iterations, int gpus) {
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(gpus));
  std::vector<int> devices(static_cast<std::size_t>(gpus));
  for (int r = 0; r < gpus; ++r) devices[r] = r;
  check(ncclCommInitAll(comms.data(), gpus, devices.data()), "ncclCommInitAll");
  xent::inprocess_group barrier_group(gpus);  // its all_gather is the host barrier
  std::vector<double> times;
  barrier_group.run([&](xent::inprocess_group::communicator host) {
    const int r = host.rank();
    check(cudaSetDevice(r), "device");
    const std::int64_t first = vocab * r / gpus, cols = vocab * (r + 1) / gpus - first;
    device_state d(rows, cols, vocab, xent::cuda_vocab_parallel_workspace_size(rows, gpus));
    const xent::nccl_group group(comms[r], d.stream);
    const xent::cuda exec{d.stream, d.workspace, d.workspace_bytes, nullptr};
    const xent::matrix_view<bf16> x(d.logits, rows, cols);
    xent::forward_outputs out;
    out.loss = d.loss;
    for (int i = -1; i < iterations; ++i) {
      d.refresh(rows * cols, static_cast<std::uint64_t>(i + 2 + 1000 * r));
      char in = 0, all[64];
      host.all_gather(&in, all, 1);  // every rank's inputs are ready
      if (r == 0) check(cudaEventRecord(d.start, d.stream), "record");
      xent::vocab_parallel_forward_backward(exec, group, x, xent::vocab_shard{first, vocab},
                                            xent::vector_view<const std::int64_t>(d.targets, rows),
                                            xent::options{}, xent::upstream{}, out, x);
      if (r == 0) check(cudaEventRecord(d.stop, d.stream), "record");
      check(cudaStreamSynchronize(d.stream), "call");
      if (r == 0 && i >= 0) times.push_back(d.elapsed_ms());
    }
  });
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  return median(times);
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t rows = argc > 2 ? std::atoll(argv[1]) : 16384;
  const std::int64_t vocab = argc > 2 ? std::atoll(argv[2]) : 128256;
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 20;
  int gpus = 0;
  check(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
  if (argc > 4) gpus = std::min(gpus, std::atoi(argv[4]));
  if (gpus < 1) {
    std::fprintf(stderr, "no GPU\n");
    return 1;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  const double single = single_gpu_ms(rows, vocab, iterations);
  const double split = vocab_parallel_ms(rows, vocab, iterations, gpus);
  // What each rank sends per row (the header is per call, not per row) and receives: the records
  // of class ids without argmax (parallel/records.hpp), as the timed calls exchange.
  const xent::options plain{};
  const double sent_per_row =
      static_cast<double>(xent::record_layout::statistics(false, plain, false).bytes());
  const double header = static_cast<double>(
      xent::vocab_parallel_exchange_bytes(xent::cuda{}, 0, false, plain, false));
  std::printf("%s x %d, bf16 %lld x %lld forward_backward (in place), median of %d\n", prop.name,
              gpus, static_cast<long long>(rows), static_cast<long long>(vocab), iterations);
  std::printf("  single GPU xent::forward_backward      %9.3f ms\n", single);
  std::printf("  vocab-parallel over %d GPU(s), rank 0   %9.3f ms   ratio %.3f\n", gpus, split,
              split / single);
  std::printf(
      "  exchanged per row: %.0f bytes sent, %.0f received per rank (+ %.0f-byte header "
      "per rank per call)\n",
      sent_per_row, sent_per_row * gpus, header);
  std::printf(
      "{\"gpu\": \"%s\", \"gpus\": %d, \"rows\": %lld, \"vocab\": %lld, \"iterations\": %d, "
      "\"single_gpu_ms\": %.4f, \"vocab_parallel_ms\": %.4f, \"ratio\": %.4f, "
      "\"bytes_sent_per_row_per_rank\": %.0f, \"bytes_received_per_row_per_rank\": %.0f}\n",
      prop.name, gpus, static_cast<long long>(rows), static_cast<long long>(vocab), iterations,
      single, split, split / single, sent_per_row, sent_per_row * gpus);
  return 0;
}
