// The small kernels of fused linear cross-entropy on CUDA, around the cuBLAS GEMMs and the
// cross-entropy core: the whole call's normaliser and per-row upstream gradient before the chunks,
// the bias broadcast into a chunk's logits, d_bias's column sums, float-to-dtype rounding, the
// reduced loss after the chunks, and soft targets' row mass for the low-memory order. Each is
// simple and memory-bound; none is on the GEMMs' scale.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../loss_math.hpp"
#include "../../options.hpp"
#include "../block/dtype.cuh"
#include "../block/row_sums.cuh"
#include "../cuda.cuh"

namespace xent {
namespace cuda_detail {

/// Threads of every linear kernel; the one-CTA kernels sum with block_sum<linear_threads>.
constexpr int linear_threads = 256;

/// One CTA, before the chunks: the mean's W over every row of the call into *normalizer (1 for
/// sum and none), and, when `row_up` is given, the upstream gradient of every row of a mean or sum
/// reduction, scale * *scale_ptr / W formed in double and rounded once as the core does, into
/// row_up[0, count). The chunks then run the core as reduction none with these rows, so W is the
/// whole call's, not a chunk's, and nothing waits on the host.
template <class Tgt>
XENT_KERNEL void linear_prologue_kernel(Tgt targets, std::int64_t rows, std::int64_t cols,
                                        std::int64_t ignore_index, const float* weights,
                                        reduction reduce, double* normalizer, float scale,
                                        const float* scale_ptr, float* row_up, std::int64_t count) {
  const double w = reduce == reduction::mean
                       ? mean_normalizer<linear_threads>(targets, rows, cols, ignore_index, weights)
                       : 1.0;
  if (threadIdx.x == 0) *normalizer = w;
  if (!row_up) return;
  const float g = static_cast<float>(scalar_upstream(scale, scale_ptr, reduce, w));
  for (std::int64_t i = threadIdx.x; i < count; i += linear_threads) row_up[i] = g;
}

/// One CTA, after the chunks: the reduced loss (sum of the row losses in a fixed order, divided
/// by *normalizer for mean) and num_correct (rows not ignored whose argmax is their class id).
template <class Tgt>
XENT_KERNEL void linear_finish_kernel(Tgt targets, std::int64_t rows, std::int64_t cols,
                                      std::int64_t ignore_index, const float* row_loss,
                                      const std::int64_t* argmax, const double* normalizer,
                                      reduction reduce, float* loss, std::int64_t* num_correct) {
  double sum = 0.0, hits = 0.0;
  for (std::int64_t n = threadIdx.x; n < rows; n += linear_threads) {
    if (loss) sum += static_cast<double>(row_loss[n]);
    if constexpr (!Tgt::soft) {
      if (num_correct) {
        const auto y = static_cast<std::int64_t>(targets.ids[n]);
        // An ignored or out-of-range row's argmax is -1, which may equal its target: not counted.
        if (y != ignore_index && y >= 0 && y < cols && argmax[n] == y) hits += 1.0;
      }
    }
  }
  write_totals<linear_threads>(sum, hits, reduce == reduction::mean ? *normalizer : 1.0, loss,
                               num_correct);
}

/// op(r, c) for every element of a rows x cols matrix: a thread per column (consecutive threads,
/// consecutive addresses), a CTA row per grid row, striding over rows past the grid's 65535.
template <class Op>
XENT_KERNEL void rows_kernel(Op op, std::int64_t rows, std::int64_t cols) {
  const std::int64_t c = blockIdx.x * std::int64_t{linear_threads} + threadIdx.x;
  if (c >= cols) return;
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y) op(r, c);
}

template <class Op>
void launch_rows_kernel(const Op& op, std::int64_t rows, std::int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const dim3 grid(static_cast<unsigned>((cols + linear_threads - 1) / linear_threads),
                  static_cast<unsigned>(rows < 65535 ? rows : 65535));
  rows_kernel<<<grid, linear_threads, 0, stream>>>(op, rows, cols);
}

/// Every row of a chunk's logits set to the bias, which the X · Wᵀ GEMM then adds to (beta = 1),
/// so the sum is rounded to the logits' dtype once.
template <class T>
struct fill_bias_op {
  T* out;
  std::int64_t ld;
  const T* bias;
  __device__ void operator()(std::int64_t r, std::int64_t c) const { out[r * ld + c] = bias[c]; }
};

/// dst = src rounded to dst's dtype, each row times row_scale[r] first where that is given (the
/// scaled-probabilities path's d_hidden, scaled_probs.cuh). dst may be src: each element is read,
/// then written, by one thread.
template <class G>
struct round_op {
  const float* src;
  std::int64_t src_ld;
  G* dst;
  std::int64_t dst_ld;
  const float* row_scale = nullptr;
  /// Elements [c, c + N) of row r, moved as one load and one store (N = 4: 16-byte loads, which
  /// need src's and dst's addresses there aligned to N elements).
  template <int N>
  __device__ void elements(std::int64_t r, std::int64_t c) const {
    const vec_t<float, N> v = load_vec<float, N>(src + r * src_ld + c);
    const float scale = row_scale ? row_scale[r] : 1.0f;
    vec_t<G, N> out;
#pragma unroll
    for (int i = 0; i < N; ++i) out.v[i] = from_float<G>(row_scale ? scale * v.v[i] : v.v[i]);
    store_vec<G, N>(dst + r * dst_ld + c, out);
  }
  __device__ void operator()(std::int64_t r, std::int64_t c) const { elements<1>(r, c); }
};

/// round_op over rows x cols four elements at a time (16-byte loads, one store of four): a
/// thread per four consecutive elements of the flattened rows, striding over the grid. The
/// element-per-thread rows_kernel moved d_weight's float accumulator (256000 x 2304) at 2.65 TB/s
/// on an H200, 1.34 ms of every training call;
/// rows_kernel's CTAs also cover a row of 2304 columns with 9 x 256 threads, each doing one.
template <class G>
XENT_KERNEL void round_quads_kernel(round_op<G> op, std::int64_t rows, std::int64_t quads) {
  const std::int64_t total = rows * quads, stride = std::int64_t{gridDim.x} * linear_threads;
  for (std::int64_t q = blockIdx.x * std::int64_t{linear_threads} + threadIdx.x; q < total;
       q += stride) {
    const std::int64_t r = q / quads;
    op.template elements<4>(r, (q - r * quads) * 4);
  }
}

/// round_op over rows x cols: four elements per thread where every row starts 16-byte aligned in
/// src and aligned to four elements in dst, else an element per thread.
template <class G>
void launch_round(const round_op<G>& op, std::int64_t rows, std::int64_t cols,
                  cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const auto aligned = [](const void* p, std::size_t bytes) {
    return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
  };
  if (cols % 4 != 0 || op.src_ld % 4 != 0 || op.dst_ld % 4 != 0 || !aligned(op.src, 16) ||
      !aligned(op.dst, 4 * sizeof(G))) {
    launch_rows_kernel(op, rows, cols, stream);
    return;
  }
  // Enough CTAs to fill every SM many times over (eight of 256 threads each on 132 SMs), few
  // enough that each strides over several quads.
  constexpr std::int64_t most_ctas = 4096;
  const std::int64_t quads = cols / 4, ctas = (rows * quads + linear_threads - 1) / linear_threads;
  round_quads_kernel<<<static_cast<unsigned>(ctas < most_ctas ? ctas : most_ctas), linear_threads,
                       0, stream>>>(op, rows, quads);
}

/// dst = (dst + src) rounded to dst's dtype, or src rounded when `first` (dst holds no sum yet).
template <class G>
struct add_rounded_op {
  const float* src;
  std::int64_t src_ld;
  G* dst;
  std::int64_t dst_ld;
  bool first;
  __device__ void operator()(std::int64_t r, std::int64_t c) const {
    G& d = dst[r * dst_ld + c];
    const float s = src[r * src_ld + c];
    d = from_float<G>(first ? s : to_float(d) + s);
  }
};

/// sums[c] (+)= sum over rows of g[r, c], in float, rows in order: a thread per column, so the
/// loads of a warp are consecutive and the result does not depend on the launch.
template <class T>
XENT_KERNEL void column_sums_kernel(const T* g, std::int64_t ld, std::int64_t rows,
                                    std::int64_t cols, float* sums, bool first) {
  const std::int64_t c = blockIdx.x * std::int64_t{linear_threads} + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (std::int64_t r = 0; r < rows; ++r) s += to_float(g[r * ld + c]);
  sums[c] = first ? s : sums[c] + s;
}

/// Each row's target mass sum_c w_c t'_c, t'_c = keep t_c + smooth, over all `cols` classes of
/// soft targets (the low-memory order's panels each see part of a row, so the gradient takes it
/// from here): a warp per row, its lanes strided over the classes and summed by shuffles in a
/// fixed order.
template <class S>
XENT_KERNEL void soft_mass_kernel(soft_probs<S> targets, std::int64_t rows, std::int64_t cols,
                                  const float* weights, float keep, float smooth, float* mass) {
  const std::int64_t row = (blockIdx.x * std::int64_t{linear_threads} + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= rows) return;  // a warp's lanes share its row: whole warps leave
  float s = 0.0f;
  for (std::int64_t c = lane; c < cols; c += 32)
    s += (weights ? weights[c] : 1.0f) *
         (keep * to_float(targets.probs[row * targets.ld + c]) + smooth);
  s = warp_sum(s);
  if (lane == 0) mass[row] = s;
}

}  // namespace cuda_detail
}  // namespace xent
