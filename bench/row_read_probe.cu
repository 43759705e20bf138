// What a read of short rows costs before any cross-entropy work: the bf16 8192 x 32000 forward
// stayed at 84-86% of the copy roof while 16384 x 128256 reached 99%. With the flush that reads
// (common/l2_flush.cuh) that forward measured 93-94% on; this probe has not run with it yet
// (XENT_BENCH_FLUSH=write reproduces its earlier runs). This times reads of the same bytes in four
// ways, each 528 CTAs of 256 threads (four per SM on an H200) with four 16-byte loads in flight per
// thread, after the same L2 refresh as the benchmarks: the whole matrix as one flat stream; whole
// rows per CTA with nothing at a row's end; whole rows with a CTA-wide sum at each row's end (the
// forward's merge of its warps); whole rows with the forward's arithmetic (packed max, then exp2
// sum on a second sweep of registers) and the CTA-wide merge; the same with the next tile's loads
// issued before a tile's arithmetic (within a row, or across rows too). Against cudaMemcpyAsync's
// rate (read + written bytes per second), as the benchmarks' roof_pct; and the copy at the matrix's
// own size (its bytes read and written; the first of each shape writes a fresh allocation, which
// ran 10% slower on an H200: read the second). The matrix holds random bf16 values
// (PROBE_CONSTANT=1: a constant fill, for comparison). Prints one JSON object per line.
//   row_read_probe [rows cols ...]   (default: 8192 32000 and 16384 128256)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/cuda_check.hpp"
#include "common/l2_flush.cuh"

namespace {

using xent_bench::check;

constexpr int threads = 256, in_flight = 4;

enum class mode { flat, rows, rows_merge, rows_forward, forward_ahead, forward_ahead_rows };

__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.0f;
  if (threadIdx.x < 32) {
    s = lane < threads / 32 ? red[lane] : 0.0f;
    for (int o = 4; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  }
  __syncthreads();
  return s;
}

/// One row's statistics as the forward sweeps it: max on packed pairs, then the sum of exp2.
__device__ __forceinline__ float row_work(const uint4 (&v)[in_flight], int live, float& m) {
  __nv_bfloat162 mx = __float2bfloat162_rn(-1e30f);
#pragma unroll
  for (int k = 0; k < in_flight; ++k) {
    if (k >= live) break;
    const unsigned u[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) mx = __hmax2(mx, *reinterpret_cast<const __nv_bfloat162*>(&u[j]));
  }
  const float tile_max = fmaxf(__low2float(mx), __high2float(mx));
  const float new_m = fmaxf(m, tile_max);
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < in_flight; ++k) {
    if (k >= live) break;
    const unsigned u[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 p = *reinterpret_cast<const __nv_bfloat162*>(&u[j]);
      s += exp2f((__low2float(p) - new_m) * 1.4426950f) +
           exp2f((__high2float(p) - new_m) * 1.4426950f);
    }
  }
  m = new_m;
  return s;
}

/// A row's LSE from every thread's (max, sum of exp2 relative to it): the row's max first, then
/// every thread's sum rescaled to it (the forward's merge of its warps). Every thread calls it.
__device__ __forceinline__ float row_lse(float m, float s, float* red) {
  float mm = m;
  for (int o = 16; o > 0; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mm;
  __syncthreads();
  float row_max = red[0];
  for (int w = 1; w < threads / 32; ++w) row_max = fmaxf(row_max, red[w]);
  __syncthreads();
  const float total = block_sum(s * exp2f((m - row_max) * 1.4426950f), red);
  return row_max + log2f(total) / 1.4426950f;
}

template <mode M>
__global__ void __launch_bounds__(threads)
    read_kernel(const uint4* data, long long rows, long long row_vectors, float* out) {
  __shared__ float red[threads / 32];
  unsigned acc = 0;
  if constexpr (M == mode::flat) {
    const long long total = rows * row_vectors;
    const long long stride = static_cast<long long>(gridDim.x) * threads * in_flight;
    for (long long base = static_cast<long long>(blockIdx.x) * threads * in_flight + threadIdx.x;
         base < total; base += stride) {
      uint4 v[in_flight];
#pragma unroll
      for (int k = 0; k < in_flight; ++k) {
        const long long i = base + static_cast<long long>(k) * threads;
        v[k] = i < total ? __ldcs(data + i) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int k = 0; k < in_flight; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
  } else {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
      const uint4* row = data + r * row_vectors;
      float m = -1e30f, s = 0.0f;
      for (long long base = threadIdx.x; base < row_vectors; base += threads * in_flight) {
        uint4 v[in_flight];
        int live = 0;
#pragma unroll
        for (int k = 0; k < in_flight; ++k) {
          const long long i = base + static_cast<long long>(k) * threads;
          if (i < row_vectors) {
            v[k] = __ldcs(row + i);
            live = k + 1;
          } else {
            v[k] = make_uint4(0, 0, 0, 0);
          }
        }
        if constexpr (M == mode::rows_forward) {
          const float old = m;
          const float t = row_work(v, live, m);
          s = s * exp2f((old - m) * 1.4426950f) + t;
        } else {
#pragma unroll
          for (int k = 0; k < in_flight; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
        }
      }
      if constexpr (M == mode::rows_merge) {
        const float total = block_sum(static_cast<float>(acc & 0xff), red);
        if (threadIdx.x == 0) out[r] = total;
      } else if constexpr (M == mode::rows_forward) {
        const float lse = row_lse(m, s, red);
        if (threadIdx.x == 0) out[r] = lse;
      }
    }
  }
  if (acc == 0x12345678u) out[0] = 1.0f;  // keeps the loads
}

/// The forward's arithmetic with the next tile's loads issued before this tile's arithmetic:
/// within a row (forward_ahead), or also across a row's end (forward_ahead_rows: the next row's
/// first tile loads during this row's last tile and its merge).
template <mode M>
__global__ void __launch_bounds__(threads)
    ahead_kernel(const uint4* data, long long rows, long long row_vectors, float* out) {
  __shared__ float red[threads / 32];
  constexpr long long span = static_cast<long long>(threads) * in_flight;
  const long long tiles = (row_vectors + span - 1) / span;
  auto load = [&](long long r, long long t, uint4(&v)[in_flight], int& live) {
    const uint4* row = data + r * row_vectors;
    live = 0;
#pragma unroll
    for (int k = 0; k < in_flight; ++k) {
      const long long i = t * span + threadIdx.x + static_cast<long long>(k) * threads;
      if (i < row_vectors) {
        v[k] = __ldcs(row + i);
        live = k + 1;
      } else {
        v[k] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  long long r = blockIdx.x, t = 0;
  if (r >= rows) return;
  uint4 cur[in_flight];
  int live = 0;
  load(r, t, cur, live);
  float m = -1e30f, s = 0.0f;
  for (;;) {
    long long nr = r, nt = t + 1;
    if (nt == tiles) {
      nt = 0;
      nr = r + gridDim.x;
    }
    uint4 nxt[in_flight];
    int next_live = 0;
    const bool early = nr < rows && (M == mode::forward_ahead_rows || nr == r);
    if (early) load(nr, nt, nxt, next_live);
    const float old = m;
    const float tile_sum = row_work(cur, live, m);
    s = s * exp2f((old - m) * 1.4426950f) + tile_sum;
    if (nt == 0) {  // the row's end: its merge, as rows_forward's
      const float lse = row_lse(m, s, red);
      if (threadIdx.x == 0) out[r] = lse;
      m = -1e30f;
      s = 0.0f;
    }
    if (nr >= rows) break;
    if (!early) load(nr, nt, nxt, next_live);
    r = nr;
    t = nt;
#pragma unroll
    for (int k = 0; k < in_flight; ++k) cur[k] = nxt[k];
    live = next_live;
  }
}

/// Random-looking bf16 values (a hash of the index), as the benchmarks' logits: a constant fill
/// changes neither the bytes nor the requests, but the data-dependent power does change with it.
__global__ void fill_random(unsigned* out, long long words, unsigned seed) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    // two bf16 in [-4, 4): sign, exponent 125..128, random mantissa
    const unsigned lo = (h & 0x807fu) | ((125u + ((h >> 8) & 3u)) << 7);
    const unsigned hi = ((h >> 16) & 0x807fu) | ((125u + ((h >> 24) & 3u)) << 7);
    out[i] = lo | (hi << 16);
  }
}

template <class F>
double median_ms(F&& f, void* refresh, std::size_t refresh_bytes, int reps = 15) {
  xent_bench::event_timer timer;
  std::vector<double> t;
  for (int i = 0; i < reps + 2; ++i) {
    xent_bench::flush_l2(refresh, refresh_bytes, static_cast<std::uint64_t>(i));  // as the bench
    const double ms = timer.ms(f);
    if (i >= 2) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<long long> shapes = {8192, 32000, 16384, 128256};
  if (argc > 2) {
    shapes.clear();
    for (int i = 1; i < argc; ++i) shapes.push_back(std::atoll(argv[i]));
  }
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), "device");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "sms");
  const std::size_t refresh_bytes = 256u << 20, copy_bytes = 2u << 30;
  void *refresh, *src, *dst;
  check(cudaMalloc(&refresh, refresh_bytes), "malloc");
  check(cudaMalloc(&src, copy_bytes), "malloc");
  check(cudaMalloc(&dst, copy_bytes), "malloc");
  check(cudaMemset(src, 1, copy_bytes), "memset");
  const double copy_ms = median_ms(
      [&] { check(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice), "copy"); },
      refresh, refresh_bytes);
  const double roof = 2.0 * copy_bytes / (copy_ms * 1e-3);
  std::printf("{\"what\": \"copy_roof\", \"GBps\": %.1f}\n", roof / 1e9);
  check(cudaFree(src), "free");
  check(cudaFree(dst), "free");
  for (std::size_t i = 0; i + 1 < shapes.size(); i += 2) {
    const long long rows = shapes[i], cols = shapes[i + 1];
    const long long row_vectors = cols / 8;  // bf16, whole vectors (cols a multiple of 8)
    const std::size_t bytes = static_cast<std::size_t>(rows * row_vectors) * 16;
    uint4* data;
    float* out;
    check(cudaMalloc(&data, bytes), "malloc");
    check(cudaMalloc(&out, sizeof(float) * rows), "malloc");
    const bool constant = std::getenv("PROBE_CONSTANT") != nullptr;
    if (constant)
      check(cudaMemset(data, 0x3c, bytes), "memset");
    else
      fill_random<<<4096, 256>>>(reinterpret_cast<unsigned*>(data),
                                 static_cast<long long>(bytes / 4), 7u);
    check(cudaDeviceSynchronize(), "fill");
    // The copy roof at this size: cudaMemcpyAsync of the matrix's bytes (read + written), which
    // pays the same ramp and tail as a pass over this matrix.
    void* copy;
    check(cudaMalloc(&copy, bytes), "malloc");
    auto copy_line = [&] {
      const double size_ms = median_ms(
          [&] { check(cudaMemcpyAsync(copy, data, bytes, cudaMemcpyDeviceToDevice), "copy"); },
          refresh, refresh_bytes);
      std::printf(
          "{\"shape\": \"%lldx%lld\", \"what\": \"copy_same_bytes\", \"us\": %.1f, "
          "\"roof_pct\": %.1f}\n",
          rows, cols, size_ms * 1e3, 100.0 * 2.0 * bytes / (size_ms * 1e-3) / roof);
    };
    const unsigned grid = static_cast<unsigned>(4 * sms);
    auto run = [&](const char* name, auto kernel) {
      const double ms = median_ms([&] { kernel<<<grid, threads>>>(data, rows, row_vectors, out); },
                                  refresh, refresh_bytes);
      check(cudaGetLastError(), name);
      std::printf(
          "{\"shape\": \"%lldx%lld\", \"what\": \"%s\", \"us\": %.1f, \"roof_pct\": %.1f}\n", rows,
          cols, name, ms * 1e3, 100.0 * bytes / (ms * 1e-3) / roof);
    };
    for (int rep = 0; rep < 2; ++rep) {
      copy_line();
      run("flat", read_kernel<mode::flat>);
      run("rows", read_kernel<mode::rows>);
      run("rows_merge", read_kernel<mode::rows_merge>);
      run("rows_forward", read_kernel<mode::rows_forward>);
      run("forward_ahead", ahead_kernel<mode::forward_ahead>);
      run("forward_ahead_rows", ahead_kernel<mode::forward_ahead_rows>);
    }
    check(cudaFree(copy), "free");
    check(cudaFree(data), "free");
    check(cudaFree(out), "free");
  }
  return 0;
}
