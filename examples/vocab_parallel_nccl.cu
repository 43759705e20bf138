// vocab_parallel_nccl: vocab-parallel cross-entropy with one process per GPU, as tensor-parallel
// training runs it. Each process holds a slice of the vocabulary of every row's logits, creates
// its NCCL communicator with ncclCommInitRank, and calls xent::vocab_parallel_forward_backward
// with an xent::nccl_group over it: every rank gets the loss of the whole vocabulary and the
// gradient of its own slice.
//
// Started by a launcher that sets the usual variables, on one node or several:
//   torchrun --nproc-per-node 2 --no-python build/examples/xent_vocab_parallel_nccl
//   mpirun -np 2 build/examples/xent_vocab_parallel_nccl
// (RANK / WORLD_SIZE / LOCAL_RANK from torchrun; OMPI_COMM_WORLD_* from Open MPI; PMI_RANK /
// PMI_SIZE from MPICH). The ranks share NCCL's unique id through a file that rank 0 writes and the
// others wait for, XENT_NCCL_ID_FILE (default /tmp/xent-nccl-id-<launcher job id, or user>):
// on several nodes, a path on a file system they share. Rank 0 removes it once the communicator
// exists; a run that died before then leaves it behind, to be deleted before the next.
//
// Options: --rows N (default 4096), --vocab V (128256), --dtype bf16|fp16|fp32 (bf16),
//          --steps S (20: timed calls after 3 warm-ups)
// Prints, on rank 0, the loss, the mean time per call and the bytes each rank exchanged; every
// rank checks its loss against rank 0's (the ranks' forward outputs are bitwise identical).
#include <cuda_runtime.h>
#include <nccl.h>

#include <xent/xent.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}

// The first of `names` that the environment sets, as an integer; `fallback` when none is.
int env_int(std::initializer_list<const char*> names, int fallback) {
  for (const char* n : names)
    if (const char* v = std::getenv(n)) return std::atoi(v);
  return fallback;
}

std::string id_file() {
  if (const char* f = std::getenv("XENT_NCCL_ID_FILE")) return f;
  for (const char* job : {"TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_JOBID", "SLURM_JOB_ID"})
    if (const char* v = std::getenv(job)) return std::string("/tmp/xent-nccl-id-") + v;
  const char* user = std::getenv("USER");
  return std::string("/tmp/xent-nccl-id-") + (user ? user : "run");
}

// Rank 0 makes the id and publishes it by an atomic rename; the others wait for the file.
ncclUniqueId share_id(int rank) {
  ncclUniqueId id;
  const std::string path = id_file();
  if (rank == 0) {
    check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    const std::string tmp = path + ".tmp";
    std::ofstream(tmp, std::ios::binary).write(id.internal, sizeof(id.internal));
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      throw std::runtime_error("cannot write " + path);
    return id;
  }
  for (int waited_ms = 0;; waited_ms += 50) {
    std::ifstream in(path, std::ios::binary);
    if (in.read(id.internal, sizeof(id.internal))) return id;
    if (waited_ms > 120000) throw std::runtime_error("no NCCL id in " + path + " after 120 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Logits of row n, class c: the same function on every rank, so each rank builds its own slice.
float logit(std::int64_t n, std::int64_t c) {
  std::uint64_t h = static_cast<std::uint64_t>(n) * 0x9E3779B97F4A7C15ull ^
                    static_cast<std::uint64_t>(c) * 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<float>(h % 20000) / 2000.0f - 5.0f;
}

template <class T>
int run(int rank, int ranks, std::int64_t rows, std::int64_t vocab, int steps, ncclComm_t comm,
        cudaStream_t stream) {
  // This rank's slice: Megatron's even split, the last rank taking the remainder.
  const std::int64_t per = vocab / ranks;
  const std::int64_t first = per * rank;
  const std::int64_t cols = rank == ranks - 1 ? vocab - first : per;

  std::vector<T> host(static_cast<std::size_t>(rows * cols));
  for (std::int64_t n = 0; n < rows; ++n)
    for (std::int64_t c = 0; c < cols; ++c) host[n * cols + c] = T(logit(n, first + c));
  std::vector<std::int64_t> targets(rows);
  for (std::int64_t n = 0; n < rows; ++n) targets[n] = (n * 7919) % vocab;

  T* logits = nullptr;
  T* grad = nullptr;
  std::int64_t* y = nullptr;
  float* loss = nullptr;
  void* ws = nullptr;
  const std::size_t ws_bytes = xent::cuda_vocab_parallel_workspace_size(rows, ranks);
  check(cudaMalloc(&logits, host.size() * sizeof(T)), "cudaMalloc");
  check(cudaMalloc(&grad, host.size() * sizeof(T)), "cudaMalloc");
  check(cudaMalloc(&y, rows * sizeof(std::int64_t)), "cudaMalloc");
  check(cudaMalloc(&loss, sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&ws, ws_bytes), "cudaMalloc");
  check(cudaMemset(ws, 0, ws_bytes), "cudaMemset");  // zeroed once; every call leaves it so
  check(cudaMemcpy(logits, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  check(cudaMemcpy(y, targets.data(), rows * sizeof(std::int64_t), cudaMemcpyHostToDevice),
        "cudaMemcpy");

  const xent::cuda exec{stream, ws, ws_bytes};
  const xent::nccl_group group(comm, stream);
  const xent::matrix_view<const T> x(logits, rows, cols, cols);
  const xent::matrix_view<T> g(grad, rows, cols, cols);
  const xent::vector_view<const std::int64_t> t(y, rows);
  xent::forward_outputs out;
  out.loss = loss;
  auto call = [&] {
    xent::vocab_parallel_forward_backward(exec, group, x, {first, vocab}, t, xent::options{},
                                          xent::upstream{}, out, g);
  };

  for (int i = 0; i < 3; ++i) call();
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < steps; ++i) call();
  check(cudaEventRecord(stop, stream), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");

  // Every rank's loss equals rank 0's, bit for bit: gather them through the same communicator.
  float mine = 0;
  check(cudaMemcpy(&mine, loss, sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
  float* all = nullptr;
  check(cudaMalloc(&all, ranks * sizeof(float)), "cudaMalloc");
  check(ncclAllGather(loss, all, 1, ncclFloat32, comm, stream), "ncclAllGather");
  std::vector<float> losses(ranks);
  check(cudaMemcpyAsync(losses.data(), all, ranks * sizeof(float), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  int status = 0;
  for (int r = 0; r < ranks; ++r)
    if (std::memcmp(&losses[r], &losses[0], sizeof(float)) != 0) {
      std::fprintf(stderr, "rank %d: rank %d's loss %.9g differs from rank 0's %.9g\n", rank, r,
                   losses[r], losses[0]);
      status = 1;
    }
  if (rank == 0)
    std::printf(
        "%d ranks, %lld x %lld (%lld classes on rank 0): loss %.6f, %.3f ms per call, "
        "%zu bytes sent per rank per call\n",
        ranks, static_cast<long long>(rows), static_cast<long long>(vocab),
        static_cast<long long>(cols), mine, ms / steps,
        xent::vocab_parallel_exchange_bytes(exec, rows, false, xent::options{}, false));
  for (void* p : {static_cast<void*>(logits), static_cast<void*>(grad), static_cast<void*>(y),
                  static_cast<void*>(loss), ws, static_cast<void*>(all)})
    cudaFree(p);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t rows = 4096, vocab = 128256;
  int steps = 20;
  std::string dtype = "bf16";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rows")
      rows = std::atoll(argv[i + 1]);
    else if (a == "--vocab")
      vocab = std::atoll(argv[i + 1]);
    else if (a == "--steps")
      steps = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--dtype")
      dtype = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  const int rank = env_int({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}, 0);
  const int ranks = env_int({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1);
  const int local = env_int({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}, 0);
  try {
    check(cudaSetDevice(local), "cudaSetDevice");
    const ncclUniqueId id = share_id(rank);
    ncclComm_t comm;
    check(ncclCommInitRank(&comm, ranks, id, rank), "ncclCommInitRank");
    // Every rank has read the id once the communicator exists: no file is left for a later run.
    if (rank == 0) std::remove(id_file().c_str());
    cudaStream_t stream;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    int status = 2;
    if (dtype == "bf16")
      status = run<Eigen::bfloat16>(rank, ranks, rows, vocab, steps, comm, stream);
    else if (dtype == "fp16")
      status = run<Eigen::half>(rank, ranks, rows, vocab, steps, comm, stream);
    else if (dtype == "fp32")
      status = run<float>(rank, ranks, rows, vocab, steps, comm, stream);
    else
      std::fprintf(stderr, "--dtype must be bf16, fp16 or fp32\n");
    ncclCommDestroy(comm);
    cudaStreamDestroy(stream);
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}
