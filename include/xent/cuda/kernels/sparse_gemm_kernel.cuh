// The sparse backward's GEMMs (linear_options::sparse_threshold, dispatch/linear_sparse.cuh): a
// tile GEMM that multiplies only the hot parts of a panel. A CTA runs one 64 x 256 output tile at
// a time and first lists, in order, the k-steps its flags leave hot (so each output's sum runs in
// the same order on every call: the results are deterministic); a cold output tile runs no step.
// The gradient use launches persistent CTAs over a list of its hot tiles (tile_list_kernel), the
// other two a CTA a tile (tile_gemm_kernel).
// The three uses, over a panel of classes [v0, v0 + P) and a sub-chunk of rows [r0, r0 + n):
//   gradient G = the logit gradient of L = X · W_panelᵀ (+ b) for hot (64-row, 256-class) tiles,
//           formed from L in the epilogue; a cold tile's gradient is zero (its dropped terms),
//           written only for a dense reader (d_bias's column sums: fill_kernel, by the dispatch);
//   d_hidden dx[rows] (+)= G · W_panel, K = the panel's classes, over each row tile's hot blocks;
//   d_weight dW[panel] (+)= Gᵀ · X, K = the rows, over each 64-class tile's hot row tiles.
// Flags are a byte per (64 global rows, 256 classes of the call); row tiles are aligned to global
// rows, so a CTA's rows may start before r0 or end after r0 + n (loaded as zeros, not stored).
//
// Tensor cores through mma.sync (sm_80 and later, block/mma.cuh), cp.async stages of 32 columns
// of K in shared memory padded by 16 bytes a row (ldmatrix then meets no bank conflict), eight
// warps of 32 x 64 each. The three uses take G, X and W in both majors: ldmatrix and its .trans
// form read either from one padded layout, where wgmma would need a second descriptor layout
// beside the K-major 128-byte swizzle block/wgmma.cuh builds (a faster kernel, not written yet).
// Included only by nvcc.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../block/async_copy.cuh"
#include "../block/dtype.cuh"
#include "../block/mma.cuh"
#include "../block/row_args.cuh"
#include "../block/tile_gradient.cuh"
#include "../cuda.cuh"

namespace xent {
namespace cuda_detail {
namespace sparse_gemm {

constexpr int bm = 64, bn = 256, bk = 32, stages = 4, threads = 256, pad = 8;
/// A flag's rows and classes: the output tiles' rows and (gradient, d_weight's 64-class tiles
/// inside one) classes line up with them.
constexpr int flag_rows = 64, flag_cols = 256;
constexpr int warps = threads / 32;

/// Shared memory of one stage's operand tile: `Outer` rows of `Inner` contiguous elements, padded.
template <int Outer, int Inner>
constexpr int tile_bytes = Outer*(Inner + pad) * 2;
/// A stage holds at most a 64 x 32 (either major) and a 256 x 32 tile (either major).
constexpr int stage_bytes = tile_bytes<bm, bk> + tile_bytes<bn, bk>;
/// Dynamic shared memory of a launch whose step lists hold up to `list` entries.
constexpr int smem_bytes(int list) { return stages * stage_bytes + (list + warps) * 4; }

/// Writes `value` over rows [r0, r0 + 64) x columns [c0, c0 + 256) of a row-major matrix (rows
/// x cols, ld apart), clipped to it: a warp a row at a time, 16-byte stores where the row's
/// alignment allows. A cold tile's whole output, so it leaves at the copy roof.
template <class O>
__device__ void fill_tile(O* out, std::int64_t ld, std::int64_t rows, std::int64_t cols,
                          std::int64_t r0, std::int64_t c0, O value) {
  constexpr int per = 16 / sizeof(O);
  vec_t<O, per> v;
#pragma unroll
  for (int k = 0; k < per; ++k) v.v[k] = value;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  for (int i = warp; i < bm; i += warps) {
    const std::int64_t r = r0 + i;
    if (r < 0 || r >= rows) continue;
    O* row = out + r * ld;
    for (int j = lane * per; j < bn; j += 32 * per) {
      const std::int64_t c = c0 + j;
      if (c + per <= cols && reinterpret_cast<std::uintptr_t>(row + c) % 16 == 0)
        store_vec<O, per>(row + c, v);
      else
        for (std::int64_t k = c; k < c + per && k < cols; ++k) row[k] = value;
    }
  }
}

/// Writes `value` (rounded to T) over rows [0, rows) x columns [0, cols) of `out` (ld apart, rows
/// 16-byte aligned), 16 bytes a thread: the cold tiles' gradient of a panel sub-chunk before its
/// hot tiles are written over them.
template <class T>
XENT_KERNEL void fill_kernel(T* out, std::int64_t ld, std::int64_t rows, std::int64_t cols,
                             float value) {
  constexpr int per = 16 / sizeof(T);
  const T x = from_float<T>(value);
  vec_t<T, per> v;
#pragma unroll
  for (int k = 0; k < per; ++k) v.v[k] = x;
  const std::int64_t vectors = (cols + per - 1) / per;
  for (std::int64_t i = blockIdx.x * std::int64_t{threads} + threadIdx.x; i < rows * vectors;
       i += std::int64_t{gridDim.x} * threads) {
    const std::int64_t r = i / vectors, c = i % vectors * per;
    T* o = out + r * ld;
    if (c + per <= cols)
      store_vec<T, per>(o + c, v);
    else
      for (std::int64_t k = c; k < cols; ++k) o[k] = x;
  }
}

/// Elements c and c + 1 (of `cols`) of an output row at `o` (element c), by one store where both
/// exist and the pair is aligned.
template <class O>
__device__ __forceinline__ void store_pair(O* o, std::int64_t c, std::int64_t cols, O v0, O v1) {
  if (c + 1 < cols && reinterpret_cast<std::uintptr_t>(o) % (2 * sizeof(O)) == 0) {
    vec_t<O, 2> v;
    v.v[0] = v0;
    v.v[1] = v1;
    store_vec<O, 2>(o, v);
  } else {
    if (c < cols) o[0] = v0;
    if (c + 1 < cols) o[1] = v1;
  }
}

/// A row-major operand in global memory: `rows` x `cols` elements, `ld` apart.
template <class T>
struct operand {
  const T* data;
  std::int64_t ld;
  std::int64_t rows, cols;
};

/// Rows [r0, r0 + Outer) x columns [c0, c0 + Inner) of `src` into `dst` (rows Inner + pad apart),
/// by 16-byte cp.async; what lies outside the operand (r0 may be negative) reads as zeros. The
/// operand's rows are 16-byte aligned and its columns a multiple of 8 (the dispatch checks).
template <int Outer, int Inner, class T>
__device__ __forceinline__ void load_tile(T* dst, const operand<T>& src, std::int64_t r0,
                                          std::int64_t c0) {
  constexpr int vectors = Inner / 8, count = Outer * vectors;
  static_assert(count % threads == 0, "whole vectors per thread");
#pragma unroll
  for (int i = 0; i < count / threads; ++i) {
    const int v = static_cast<int>(threadIdx.x) + i * threads;
    const int row = v / vectors, col = v % vectors * 8;
    const std::int64_t r = r0 + row, c = c0 + col;
    const bool inside = r >= 0 && r < src.rows && c < src.cols;
    const T* from = inside ? src.data + r * src.ld + c : src.data;
    const int bytes = inside ? static_cast<int>(c + 8 <= src.cols ? 16 : (src.cols - c) * 2) : 0;
    copy16_async(dst + row * (Inner + pad) + col, from, bytes);
  }
}

/// Appends, in order, each i in [0, n) with hot(i) to `list` (`counts`: Threads / 32 ints of
/// shared memory) and returns how many: every thread of the CTA (Threads of them) calls it and
/// gets the count.
template <int Threads = threads, class Hot, class Index>
__device__ Index compact(Index n, Hot hot, int* list, int* counts) {
  constexpr int warps_ = Threads / 32;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  Index total = 0;
  for (Index base = 0; base < n; base += Threads) {
    const Index i = base + static_cast<Index>(threadIdx.x);
    const bool h = i < n && hot(i);
    const unsigned ballot = __ballot_sync(0xffffffffu, h);
    if (lane == 0) counts[warp] = __popc(ballot);
    __syncthreads();
    Index before = total, sum = 0;
#pragma unroll
    for (int w = 0; w < warps_; ++w) {
      before += w < warp ? counts[w] : 0;
      sum += counts[w];
    }
    if (h) list[before + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int>(i);
    total += sum;
    __syncthreads();
  }
  return total;
}

/// The flags of one sub-chunk and panel: flag(rt, b) for global row tile rt and the panel's
/// block b (its class tile v0 / 256 + b).
struct flags_view {
  const unsigned char* data;
  std::int64_t ld;           ///< blocks of the call's vocabulary
  std::int64_t first_block;  ///< v0 / 256
  __device__ bool hot(std::int64_t rt, std::int64_t b) const {
    return data[rt * ld + first_block + b] != 0;
  }
};

/// The sub-chunk [r0, r0 + n) as global row tiles: tile i covers relative rows
/// [first * 64 - r0 + 64 i, + 64).
struct row_tiles {
  std::int64_t r0, n;
  __device__ std::int64_t first() const { return r0 / flag_rows; }
  __device__ std::int64_t count() const { return (r0 + n - 1) / flag_rows - first() + 1; }
  __device__ std::int64_t rel_row(std::int64_t i) const { return (first() + i) * flag_rows - r0; }
};

/// An output tile: M tile m, N tile n.
struct tile {
  std::int64_t m, n;
};

/// The tile of CTA `id` of an m_tiles x n_tiles launch, grouped as Triton orders GEMM tiles: each
/// group of `group` M tiles (the last one fewer) runs through every N tile with its M tiles
/// fastest, so the group's M-side operand stays in L2 while each N tile is read once a group.
__device__ __forceinline__ tile grouped_tile(std::int64_t id, std::int64_t m_tiles,
                                             std::int64_t n_tiles, std::int64_t group) {
  const std::int64_t span = group * n_tiles, first = id / span * group;
  const std::int64_t rows = m_tiles - first < group ? m_tiles - first : group;
  return {first + id % span % rows, id % span / rows};
}

/// The logit gradient of the hot tiles (the cold ones' is 0, exactly their dropped terms: the
/// dispatch's), from L = X · W_panelᵀ (+ bias) in float: the dense gradient pass's
/// g (alpha p_c - w_y [c = y]) with backward_row's constants (class ids, no smoothing or softcap:
/// check_sparse), so no logits are stored and no pass reads them back. Tile (m, n): row tile m of
/// the sub-chunk, block n of the panel; every tile it is given is hot (list_kernel's list).
template <class T, class Tgt>
struct gradient_op {
  static constexpr bool a_kmajor = true, b_kmajor = true;
  operand<T> x;   ///< the sub-chunk's hidden rows, n x D
  operand<T> w;   ///< the panel's weight rows, P x D
  const T* bias;  ///< the panel's, or null
  T* out;         ///< n x P logit gradient, ld_out apart
  std::int64_t ld_out;
  row_tiles tiles;
  row_args<T, T, Tgt> rows;  ///< the sub-chunk's rows as the dense pass gets them (vp_gradient)

  __device__ int prepare(const tile&, int*, int*) const {
    return static_cast<int>((x.cols + bk - 1) / bk);
  }
  __device__ std::int64_t k_at(int i, const int*) const { return std::int64_t{i} * bk; }
  __device__ std::int64_t m0(const tile& t) const { return tiles.rel_row(t.m); }
  __device__ std::int64_t n0(const tile& t) const { return t.n * bn; }
  __device__ void load(const tile& t, T* a, T* b, std::int64_t k) const {
    load_tile<bm, bk>(a, x, m0(t), k);
    load_tile<bn, bk>(b, w, n0(t), k);
  }
  /// A tile with no k-step (D = 0): its logits are the bias alone, through store's epilogue.
  __device__ void fill(const tile& t) const {
    for (int i = static_cast<int>(threadIdx.x); i < bm * bn / 2; i += threads)
      store(t, i / (bn / 2), i % (bn / 2) * 2, 0.0f, 0.0f);
  }
  /// Elements (row, col) and (row, col + 1) of a hot tile.
  __device__ void store(const tile& t, int row, int col, float v0, float v1) const {
    const std::int64_t r = m0(t) + row, c = n0(t) + col;
    if (r < 0 || r >= x.rows) return;
    if (bias) {
      v0 += c < w.rows ? to_float(bias[c]) : 0.0f;
      v1 += c + 1 < w.rows ? to_float(bias[c + 1]) : 0.0f;
    }
    // The logits rounded to T, as the exact order stores them: the LSE is of those (stats_gemm),
    // and p from unrounded ones would not sum to 1 (bf16's step at |z| = 30 is 0.125).
    v0 = to_float(from_float<T>(v0));
    v1 = to_float(from_float<T>(v1));
    const auto y = static_cast<std::int64_t>(rows.targets.ids[r]);
    if (skipped_target(rows, y)) {  // ignored or out of range: a zero row, as the dense pass's
      v0 = v1 = 0.0f;
    } else {
      const row_gradient rg = backward_row(rows, r, y, rows.lse_in[r], 0.0);
      const float ga = rg.g * rg.alpha, gw = rg.g * rg.w_y;
      v0 = ga * expf(v0 - rg.lse) - (c == rg.y ? gw : 0.0f);
      v1 = ga * expf(v1 - rg.lse) - (c + 1 == rg.y ? gw : 0.0f);
    }
    store_pair(out + r * ld_out + c, c, w.rows, from_float<T>(v0), from_float<T>(v1));
  }
};

/// dx[rows] = beta dx[rows] + G · W_panel over each row tile's hot blocks. Tile (m, n): row tile m
/// of the sub-chunk, columns [256 n, 256 n + 256) of D. A tile with no hot block adds nothing:
/// with beta 1 it is not written.
template <class T>
struct hidden_op {
  static constexpr bool a_kmajor = true, b_kmajor = false;
  operand<T> g;  ///< the sub-chunk's logit gradient, n x P
  operand<T> w;  ///< the panel's weight rows, P x D
  float* dx;     ///< the sub-chunk's rows of the N x D float sum, ldx apart
  std::int64_t ldx;
  float beta;
  flags_view flags;
  row_tiles tiles;

  __device__ int prepare(const tile& t, int* list, int* counts) const {
    const std::int64_t rt = tiles.first() + t.m;
    const int blocks = static_cast<int>((g.cols + flag_cols - 1) / flag_cols);
    const int steps = compact(
                          blocks, [&](int b) { return flags.hot(rt, b); }, list, counts) *
                      (flag_cols / bk);
    return steps == 0 && beta != 0.0f ? -1 : steps;
  }
  __device__ std::int64_t k_at(int i, const int* list) const {
    return std::int64_t{list[i / (flag_cols / bk)]} * flag_cols + i % (flag_cols / bk) * bk;
  }
  __device__ std::int64_t m0(const tile& t) const { return tiles.rel_row(t.m); }
  __device__ std::int64_t n0(const tile& t) const { return t.n * bn; }
  __device__ void load(const tile& t, T* a, T* b, std::int64_t k) const {
    load_tile<bm, bk>(a, g, m0(t), k);
    load_tile<bk, bn>(b, w, k, n0(t));
  }
  __device__ void fill(const tile& t) const {
    fill_tile(dx, ldx, g.rows, w.cols, m0(t), n0(t), 0.0f);
  }
  __device__ void store(const tile& t, int row, int col, float v0, float v1) const {
    const std::int64_t r = m0(t) + row, c = n0(t) + col;
    if (r < 0 || r >= g.rows) return;
    float* o = dx + r * ldx + c;
    if (beta != 0.0f) {
      v0 += c < w.cols ? o[0] : 0.0f;
      v1 += c + 1 < w.cols ? o[1] : 0.0f;
    }
    store_pair(o, c, w.cols, v0, v1);
  }
};

/// d_weight[panel] over each 64-class tile's hot row tiles: written in G (rounded once, beta 0)
/// or added into a float sum (`acc`, beta 0 or 1). Tile (m, n): classes [64 m, 64 m + 64) of
/// the panel, columns [256 n, 256 n + 256) of D. A tile with no hot row tile adds nothing: with
/// beta 1 it is not written.
template <class T, class O>
struct weight_op {
  static constexpr bool a_kmajor = false, b_kmajor = false;
  operand<T> g;  ///< the sub-chunk's logit gradient, n x P (Gᵀ is the A operand)
  operand<T> x;  ///< the sub-chunk's hidden rows, n x D
  O* out;        ///< P x D
  std::int64_t ld_out;
  float beta;
  flags_view flags;
  row_tiles tiles;

  __device__ int prepare(const tile& t, int* list, int* counts) const {
    const std::int64_t b = t.m * bm / flag_cols;
    const auto n = static_cast<int>(tiles.count());
    const int steps = compact(
                          n, [&](int i) { return flags.hot(tiles.first() + i, b); }, list, counts) *
                      (flag_rows / bk);
    return steps == 0 && beta != 0.0f ? -1 : steps;
  }
  __device__ std::int64_t k_at(int i, const int* list) const {
    return tiles.rel_row(list[i / (flag_rows / bk)]) + i % (flag_rows / bk) * bk;
  }
  __device__ std::int64_t m0(const tile& t) const { return t.m * bm; }
  __device__ std::int64_t n0(const tile& t) const { return t.n * bn; }
  __device__ void load(const tile& t, T* a, T* b, std::int64_t k) const {
    load_tile<bk, bm>(a, g, k, m0(t));
    load_tile<bk, bn>(b, x, k, n0(t));
  }
  __device__ void fill(const tile& t) const {
    fill_tile(out, ld_out, g.cols, x.cols, m0(t), n0(t), from_float<O>(0.0f));
  }
  __device__ void store(const tile& t, int row, int col, float v0, float v1) const {
    const std::int64_t r = m0(t) + row, c = n0(t) + col;
    if (r >= g.cols) return;
    O* o = out + r * ld_out + c;
    if (beta != 0.0f) {  // a float sum
      v0 += c < x.cols ? to_float(o[0]) : 0.0f;
      v1 += c + 1 < x.cols ? to_float(o[1]) : 0.0f;
    }
    store_pair(o, c, x.cols, from_float<O>(v0), from_float<O>(v1));
  }
};

/// Output tile `t` of `op` (a use above) by the whole CTA, `smem` its dynamic shared memory: the
/// tile's hot k-steps through `stages` cp.async stages. prepare answers the steps: 0 for a tile
/// with none, whose output op.fill writes (what an empty sum gives), -1 for one that writes
/// nothing.
template <class T, class Op>
__device__ void run_tile(const Op& op, const tile& t, unsigned char* smem) {
  namespace wm = warp_mma;
  int* const list = reinterpret_cast<int*>(smem + stages * stage_bytes);
  int* const counts = list;  // compact's scratch, read before the list is written past it
  const int prepared = op.prepare(t, list + warps, counts);
  if (prepared <= 0) {
    if (prepared == 0) op.fill(t);
    return;
  }
  const int steps = prepared;
  const int* const hot = list + warps;

  constexpr int a_bytes = Op::a_kmajor ? tile_bytes<bm, bk> : tile_bytes<bk, bm>;
  auto a_tile = [&](int s) { return reinterpret_cast<T*>(smem + s * stage_bytes); };
  auto b_tile = [&](int s) { return reinterpret_cast<T*>(smem + s * stage_bytes + a_bytes); };

  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int wm_ = warp / 4, wn = warp % 4;  // 2 x 4 warps of 32 x 64
  float acc[2][8][4] = {};

#pragma unroll
  for (int s = 0; s < stages - 1; ++s) {
    if (s < steps) op.load(t, a_tile(s), b_tile(s), op.k_at(s, hot));
    wm::copies_commit();
  }
  for (int i = 0; i < steps; ++i) {
    wm::copies_wait<stages - 2>();
    __syncthreads();
    const int next = i + stages - 1;
    if (next < steps) op.load(t, a_tile(next % stages), b_tile(next % stages), op.k_at(next, hot));
    wm::copies_commit();
    const T* a = a_tile(i % stages);
    const T* b = b_tile(i % stages);
#pragma unroll
    for (int ks = 0; ks < bk / 16; ++ks) {
      unsigned af[2][4], bf[8][2];
      const int mat = lane / 8, r = lane % 8;
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int m = wm_ * 32 + mi * 16;
        if constexpr (Op::a_kmajor)
          wm::ldmatrix_x4<false>(af[mi],
                                 a + (m + lane % 16) * (bk + pad) + ks * 16 + lane / 16 * 8);
        else
          wm::ldmatrix_x4<true>(af[mi],
                                a + (ks * 16 + r + mat / 2 * 8) * (bm + pad) + m + mat % 2 * 8);
      }
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int n = wn * 64 + p * 16;
        unsigned q[4];
        if constexpr (Op::b_kmajor)
          wm::ldmatrix_x4<false>(q, b + (n + r + mat / 2 * 8) * (bk + pad) + ks * 16 + mat % 2 * 8);
        else
          wm::ldmatrix_x4<true>(q, b + (ks * 16 + r + mat % 2 * 8) * (bn + pad) + n + mat / 2 * 8);
        bf[2 * p][0] = q[0];
        bf[2 * p][1] = q[1];
        bf[2 * p + 1][0] = q[2];
        bf[2 * p + 1][1] = q[3];
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nj = 0; nj < 8; ++nj) wm::mma_16816<T>(acc[mi][nj], af[mi], bf[nj]);
    }
  }
  wm::copies_wait<0>();

#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int nj = 0; nj < 8; ++nj) {
      const int row = wm_ * 32 + mi * 16 + lane / 4, col = wn * 64 + nj * 8 + lane % 4 * 2;
      op.store(t, row, col, acc[mi][nj][0], acc[mi][nj][1]);
      op.store(t, row + 8, col, acc[mi][nj][2], acc[mi][nj][3]);
    }
}

/// One output tile per CTA, m_tiles x n_tiles of them in groups of `group` M tiles
/// (grouped_tile).
template <class T, class Op>
__global__ void __launch_bounds__(threads, 2)
    tile_gemm_kernel(const Op op, std::int64_t m_tiles, std::int64_t n_tiles, std::int64_t group) {
  extern __shared__ __align__(16) unsigned char smem[];
  run_tile<T>(op, grouped_tile(blockIdx.x, m_tiles, n_tiles, group), smem);
}

/// The tiles listed in items[0, *count) (each m * n_tiles + n), taken one at a time from the
/// shared counter *next by persistent CTAs: a panel whose tiles are mostly cold launches no CTA
/// for them (a CTA's start and end held each of them ~26 us on an H100 where its work took ~2).
/// Each tile's result is its own whatever CTA computes it.
template <class T, class Op>
__global__ void __launch_bounds__(threads, 2)
    tile_list_kernel(const Op op, const int* items, const int* count, int* next,
                     std::int64_t n_tiles) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int item;
  for (;;) {
    if (threadIdx.x == 0) item = atomicAdd(next, 1);
    __syncthreads();
    const int i = item;
    if (i >= *count) return;
    const std::int64_t code = items[i];
    run_tile<T>(op, tile{code / n_tiles, code % n_tiles}, smem);
    __syncthreads();  // the stages and `item` are the next tile's
  }
}

}  // namespace sparse_gemm
}  // namespace cuda_detail
}  // namespace xent
