// The sparse backward of the low-memory order on one GPU (linear_options::sparse_threshold tau):
// tiles of 64 global rows x 256 classes, a byte of flags each in the workspace. linear_panels.cuh
// calls these steps in place of its dense gradient pass (forward_backward) or around it
// (linear_backward):
//   forward_backward: the statistics pass (the exact forward, unchanged) marks the hot tiles from
//     each chunk's logits and LSE after its row pass, or on Hopper's statistics GEMM from each
//     launch's row partials (a row's max over each 256 classes) and merged LSE (mark_hook); then
//     per panel sub-chunk the hot tiles' logit gradient alone, formed from the logits in the
//     GEMM's epilogue (sparse_gradient: zeros in the cold tiles, no dense gradient pass), then
//     d_weight, d_bias and d_hidden over the hot tiles alone (sparse_grads);
//   linear_backward (no statistics pass): each panel sub-chunk's logits whole (cuBLAS), its tiles
//     marked from them before the gradient pass, then sparse_grads.
// With F = 2 N V D: forward_backward does F + 3hF of the exact order's 4F (h the hot share),
// linear_backward F + 2hF of 3F. The GEMMs are kernels/sparse_gemm_kernel.cuh's; cuBLAS takes its
// sizes from the host, and a hot-tile count read back would synchronise every panel.
//
// What the kernels take (check_sparse refuses the rest, naming the argument): bf16 or fp16 hidden
// and weight, class-id targets, no label smoothing or softcap (a cold tile's gradient is then
// exactly its dropped probability terms), D and both leading dimensions multiples of 8 with
// 16-byte aligned rows, d_weight in T or float, an sm_80 or later GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../../detail/validate.hpp"
#include "../../error.hpp"
#include "../../linear/options.hpp"
#include "../../targets.hpp"
#include "../../views.hpp"
#include "../cuda.cuh"
#include "../kernels/linear_kernels.cuh"
#include "../kernels/sparse_gemm_kernel.cuh"
#include "../kernels/sparse_marks_kernel.cuh"
#include "../runtime.cuh"
#include "launch.cuh"
#include "linear_call.cuh"

namespace xent {
namespace cuda_detail {

/// The flags of a call of N rows and V classes: row tiles x blocks bytes.
inline std::int64_t sparse_row_tiles(std::int64_t rows) {
  return (rows + sparse_gemm::flag_rows - 1) / sparse_gemm::flag_rows;
}
inline std::int64_t sparse_blocks(std::int64_t cols) {
  return (cols + sparse_gemm::flag_cols - 1) / sparse_gemm::flag_cols;
}

/// The global row tiles that rows [r0, r0 + n) (n > 0) touch.
inline std::int64_t touched_row_tiles(std::int64_t r0, std::int64_t n) {
  return (r0 + n - 1) / sparse_gemm::flag_rows - r0 / sparse_gemm::flag_rows + 1;
}

/// The dtypes the tile GEMM takes (mma.sync's 16-bit operands); check_sparse refuses the others
/// before any launch, so their calls compile no tile GEMM.
template <class DT>
constexpr bool sparse_dtype =
    std::is_same<DT, __nv_bfloat16>::value || std::is_same<DT, __half>::value;

/// The hot-tile list of a panel sub-chunk of `rows` rows and `cols` classes: its entries (the
/// sub-chunk's row tiles, one more where it straddles them, times the panel's blocks), then a
/// count and a counter.
inline std::int64_t sparse_list_ints(std::int64_t rows, std::int64_t cols) {
  return (sparse_row_tiles(rows) + 1) * sparse_blocks(cols) + 2;
}

/// What a call's sparse steps share. Null flags: the call is exact.
struct sparse_state {
  unsigned char* flags = nullptr;
  int* list = nullptr;  ///< sparse_list_ints of the panel plan: hot logits tiles, count, counter
  int sms = 0;          ///< the GPU's SMs: the list's persistent CTAs are two an SM
  std::int64_t ld = 0;  ///< blocks of the call's vocabulary
  float log_tau = 0.0f;
  unsigned long long* counts = nullptr;  ///< linear_sparse_counts in device memory, or null
  bool marked = false;                   ///< flags from the statistics pass (forward_backward)
  explicit operator bool() const { return flags != nullptr; }
};

/// The tile GEMM's dynamic shared memory with step lists of `list` entries.
inline int sparse_smem(std::int64_t list) {
  return sparse_gemm::smem_bytes(static_cast<int>(std::min<std::int64_t>(list, 1 << 20)));
}

/// The most dynamic shared memory a CTA may ask for on sm_80 to sm_90 (227 KiB on Hopper; an
/// A100's 163 KiB is the smaller).
constexpr int sparse_smem_limit = 163 * 1024;

/// Refuses, before anything is enqueued and naming the argument, a sparse call the kernels do not
/// take (the file's comment lists what they take), and answers the device's facts. `rows`: a
/// panel sub-chunk's rows; `cols`: a panel's classes.
template <class T, class G, class Tgt>
device_facts check_sparse(const char* fn, matrix_view<const T> hidden, matrix_view<const T> weight,
                          const linear_options& opts, bool narrow_dw_blocks, std::int64_t rows,
                          std::int64_t cols) {
  using DT = device_t<T>;
  using DG = device_t<G>;
  const char* arg = "options.sparse_threshold";
  const std::string on = "the CUDA backend's sparse backward ";
  if constexpr (!sparse_dtype<DT>)
    throw error(fn, arg, on + "takes bf16 or fp16 hidden and weight (tensor-core tiles)");
  if constexpr (detail::target_traits<Tgt>::soft)
    throw error(fn, arg, on + "takes class-id targets, not soft targets");
  detail::require(opts.label_smoothing == 0.0f && opts.softcap == 0.0f, fn, arg,
                  [&] { return on + "takes no label_smoothing or softcap"; });
  const std::int64_t D = hidden.cols;
  auto rows_fit = [&](const auto& m) {
    return D % 8 == 0 &&
           (D == 0 || (m.ld % 8 == 0 && reinterpret_cast<std::uintptr_t>(m.data) % 16 == 0));
  };
  detail::require(rows_fit(hidden), fn, "hidden", [&] {
    return on + "needs D and the leading dimension multiples of 8 and rows 16-byte aligned";
  });
  detail::require(rows_fit(weight), fn, "weight", [&] {
    return on + "needs D and the leading dimension multiples of 8 and rows 16-byte aligned";
  });
  detail::require(
      !narrow_dw_blocks || std::is_same<DG, DT>::value || std::is_same<DG, float>::value, fn,
      "grads.d_weight", [&] { return on + "writes d_weight in the inputs' dtype or float"; });
  const std::int64_t list =
      std::max(touched_row_tiles(0, std::max<std::int64_t>(rows, 1)) + 1, sparse_blocks(cols));
  detail::require(sparse_smem(list) <= sparse_smem_limit, fn, arg, [&] {
    return on +
           "lists a CTA's steps in shared memory: at most 16,000 row tiles (about a million "
           "rows) a panel sub-chunk";
  });
  const device_facts dev = query_device(fn);
  detail::require(dev.major >= 8, fn, arg, [&] { return on + "needs an sm_80 or later GPU"; });
  return dev;
}

/// One launch of the tile GEMM over m_tiles x n_tiles output tiles, step lists of up to `list`
/// entries. `m_bytes`: the bytes of one M tile's operand over all of K; as many M tiles as hold
/// 16 MiB of it (a third of an H100's L2) run through the N tiles together.
template <class DT, class Op>
void launch_tile_gemm(const char* fn, const Op& op, std::int64_t m_tiles, std::int64_t n_tiles,
                      std::int64_t list, std::int64_t m_bytes, cudaStream_t s) {
  if constexpr (sparse_dtype<DT>) {
    if (m_tiles <= 0 || n_tiles <= 0) return;
    const int smem = sparse_smem(list);
    const auto kernel = sparse_gemm::tile_gemm_kernel<DT, Op>;
    allow_smem(fn, reinterpret_cast<const void*>(kernel), smem);
    const std::int64_t group = std::min(
        m_tiles,
        std::max<std::int64_t>(1, (std::int64_t{16} << 20) / std::max<std::int64_t>(m_bytes, 1)));
    kernel<<<static_cast<unsigned>(m_tiles * n_tiles), sparse_gemm::threads,
             static_cast<std::size_t>(smem), s>>>(op, m_tiles, n_tiles, group);
    check_cuda(fn, cudaGetLastError());
  }
}

/// Marks the hot tiles of `n` rows x `cols` columns of logits (ld apart): the call's rows
/// [r0, r0 + n) with their LSE and class ids, its classes [c0, c0 + cols).
template <class DT, class I>
void mark_tiles(const char* fn, const sparse_state& sp, const DT* logits, std::int64_t ld,
                std::int64_t n, std::int64_t cols, const float* lse, const I* ids,
                std::int64_t ignore_index, std::int64_t r0, std::int64_t c0, cudaStream_t s) {
  if (n <= 0 || cols <= 0) return;
  const std::int64_t groups = (sparse_blocks(cols) + sparse_gemm::warps - 1) / sparse_gemm::warps;
  sparse_gemm::mark_kernel<<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(groups)),
                             sparse_gemm::threads, 0, s>>>(logits, ld, cols, lse, ids, ignore_index,
                                                           r0, c0, sp.log_tau, sp.flags, sp.ld);
  check_cuda(fn, cudaGetLastError());
}

/// The statistics pass's hook (run_linear's): marks a chunk's hot tiles from its logits and the
/// LSE its row pass has just written, or (stats_forward) from the statistics GEMM's row partials
/// and the LSE merged from them.
template <class DT, class I>
struct mark_hook {
  const char* fn;
  const sparse_state* sp;
  const float* lse;  ///< every row's
  const I* ids;      ///< every row's class id
  std::int64_t ignore_index;
  cudaStream_t stream;
  void operator()(std::int64_t r0, std::int64_t n, const DT* logits, std::int64_t ld,
                  std::int64_t cols) const {
    mark_tiles(fn, *sp, logits, ld, n, cols, lse + r0, ids + r0, ignore_index, r0, 0, stream);
  }
  void partials(std::int64_t r0, std::int64_t n, const online_lse* p,
                std::int64_t col_tiles) const {
    if (n <= 0 || col_tiles <= 0) return;
    const std::int64_t ctas = (n * col_tiles + sparse_gemm::threads - 1) / sparse_gemm::threads;
    sparse_gemm::
        mark_partials_kernel<<<static_cast<unsigned>(ctas), sparse_gemm::threads, 0, stream>>>(
            p, col_tiles, n, lse + r0, ids + r0, ignore_index, r0, sp->log_tau, sp->flags);
    check_cuda(fn, cudaGetLastError());
  }
};

/// Counts the tiles of rows [r0, r0 + n) x the panel's classes [v0, v0 + cols), and the cold
/// ones, into sp.counts (when the caller asked).
inline void count_tiles(const char* fn, const sparse_state& sp, std::int64_t r0, std::int64_t n,
                        std::int64_t v0, std::int64_t cols, cudaStream_t s) {
  if (!sp.counts || n <= 0 || cols <= 0) return;
  const std::int64_t rows = touched_row_tiles(r0, n), blocks = sparse_blocks(cols);
  const std::int64_t ctas = std::min<std::int64_t>(
      1024, (rows * blocks + sparse_gemm::threads - 1) / sparse_gemm::threads);
  sparse_gemm::count_kernel<><<<static_cast<unsigned>(ctas), sparse_gemm::threads, 0, s>>>(
      sp.flags, sp.ld, r0 / sparse_gemm::flag_rows, rows, v0 / sparse_gemm::flag_cols, blocks,
      sp.counts);
  check_cuda(fn, cudaGetLastError());
}

/// A panel sub-chunk's flags cleared (linear_backward marks each from its own logits).
inline void clear_flags(const char* fn, const sparse_state& sp, std::int64_t r0, std::int64_t n,
                        cudaStream_t s) {
  if (n <= 0) return;
  check_cuda(fn, cudaMemsetAsync(sp.flags + r0 / sparse_gemm::flag_rows * sp.ld, 0,
                                 static_cast<std::size_t>(touched_row_tiles(r0, n) * sp.ld), s));
}

/// The logit gradient of rows [r0, r0 + n) for the panel call `c` (its weight and bias the
/// panel's, its first class v0) over the hot tiles (zeros in the cold ones where d_bias's column
/// sums read them), into the panel's logits buffer. `rows`: the sub-chunk's rows as the dense
/// gradient pass gets them (gradient_args).
template <class T, class G, class Tgt>
void sparse_gradient(
    const linear_call<T, G>& c, const sparse_state& sp, std::int64_t v0, std::int64_t r0,
    std::int64_t n,
    const row_args<typename linear_call<T, G>::DT, typename linear_call<T, G>::DT, Tgt>& rows) {
  using DT = typename linear_call<T, G>::DT;
  namespace sg = sparse_gemm;
  const std::int64_t P = c.vocab(), D = c.dim();
  const sg::gradient_op<DT, Tgt> op{{c.hidden_row(r0), c.hidden.ld, n, D},
                                    {c.weight.data, c.weight.ld, P, D},
                                    c.bias,
                                    c.logits(),
                                    c.plan.ld,
                                    {r0, n},
                                    rows};
  if constexpr (sparse_dtype<DT>) {
    const char* fn = c.blas.fn();
    const cudaStream_t s = c.exec.stream;
    const std::int64_t row_tiles = touched_row_tiles(r0, n), blocks = sparse_blocks(P);
    if (n <= 0 || P <= 0) return;
    // The cold tiles' gradient is zero. The tile GEMMs read hot tiles alone, so only d_bias's
    // column sums read those zeros: written over the panel at the copy roof for them, else left
    // out (3.5% of the sparse call at 8192 x 4096 x 128256 on an H100).
    if (c.db_sum()) {
      const std::int64_t vectors = n * ((P + 7) / 8);
      sg::fill_kernel<DT><<<static_cast<unsigned>(std::min<std::int64_t>(
                                4096, (vectors + sg::threads - 1) / sg::threads)),
                            sg::threads, 0, s>>>(c.logits(), c.plan.ld, n, P, 0.0f);
    }
    int* const items = sp.list;
    int* const count = items + row_tiles * blocks;
    sg::list_kernel<><<<1, sg::list_threads, 0, s>>>(sp.flags, sp.ld, r0 / sg::flag_rows, row_tiles,
                                                     v0 / sg::flag_cols, blocks, items, count,
                                                     count + 1);
    check_cuda(fn, cudaGetLastError());
    const int smem = sparse_smem(0);
    const auto kernel = sg::tile_list_kernel<DT, sg::gradient_op<DT, Tgt>>;
    allow_smem(fn, reinterpret_cast<const void*>(kernel), smem);
    kernel<<<static_cast<unsigned>(std::min<std::int64_t>(row_tiles * blocks, 2 * sp.sms)),
             sg::threads, static_cast<std::size_t>(smem), s>>>(op, items, count, count + 1, blocks);
    check_cuda(fn, cudaGetLastError());
  }
}

/// d_weight[panel] and d_bias[panel] from rows [r0, r0 + n)'s logit gradient (`first`: the
/// panel's first sub-chunk), and dx[rows] (the N x D float sum, ldx apart; `first_panel`: its
/// first write) += G · W_panel, over the hot tiles alone: chunk_grads's destinations.
template <class T, class G>
void sparse_grads(const linear_call<T, G>& c, const sparse_state& sp, std::int64_t v0,
                  std::int64_t r0, std::int64_t n, bool first, float* dx, std::int64_t ldx,
                  bool first_panel) {
  using DT = typename linear_call<T, G>::DT;
  using DG = typename linear_call<T, G>::DG;
  namespace sg = sparse_gemm;
  const char* fn = c.blas.fn();
  const cudaStream_t s = c.exec.stream;
  const std::int64_t P = c.vocab(), D = c.dim();
  const sg::operand<DT> g{c.logits(), c.plan.ld, n, P};
  const sg::operand<DT> x{c.hidden_row(r0), c.hidden.ld, n, D};
  const sg::flags_view f{sp.flags, sp.ld, v0 / sg::flag_cols};
  const sg::row_tiles tiles{r0, n};
  const std::int64_t row_tiles = touched_row_tiles(r0, n);
  const std::int64_t d_tiles = (D + sg::bn - 1) / sg::bn, class_tiles = (P + sg::bm - 1) / sg::bm;
  if (c.d_weight.data) {
    const auto [acc, ld_acc] = c.dw_float_sum();
    if (acc)
      launch_tile_gemm<DT>(
          fn, sg::weight_op<DT, float>{g, x, acc, ld_acc, first ? 0.0f : 1.0f, f, tiles},
          class_tiles, d_tiles, row_tiles, 2 * sg::bm * n, s);
    else  // one sub-chunk of every row: d_weight written once, in its dtype
      launch_tile_gemm<DT>(
          fn, sg::weight_op<DT, DG>{g, x, c.d_weight.data, c.d_weight.ld, 0.0f, f, tiles},
          class_tiles, d_tiles, row_tiles, 2 * sg::bm * n, s);
  }
  chunk_bias_grads(c, n, first);
  if (dx)
    launch_tile_gemm<DT>(fn,
                         sg::hidden_op<DT>{g,
                                           {c.weight.data, c.weight.ld, P, D},
                                           dx + r0 * ldx,
                                           ldx,
                                           first_panel ? 0.0f : 1.0f,
                                           f,
                                           tiles},
                         row_tiles, d_tiles, sparse_blocks(P), 2 * sg::bm * P, s);
  check_cuda(fn, cudaGetLastError());
}

}  // namespace cuda_detail
}  // namespace xent
