// The CPU workspace of fused linear cross-entropy: which buffers of the accumulator type (float;
// double for double inputs) a call needs, where they
// sit in the caller's buffer, and how many rows a chunk can have in a given number of bytes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../accumulator.hpp"
#include "../linear/options.hpp"
#include "../linear/plan.hpp"
#include "cpu.hpp"
#include "parallel.hpp"

namespace xent {
namespace cpu_detail {

/// Weight rows per GEMM block. A block is converted to float (bf16 / fp16 weights) once per chunk
/// and pass and multiplied against every row of the chunk, so its conversion is amortised over the
/// chunk; 256 rows is wide enough for Eigen's GEMM panels and keeps a thread's converted block at
/// 1 KiB per hidden unit (4 MiB for D = 4096). Not tuned by measurement yet.
constexpr std::int64_t linear_block_rows = 256;

/// Every buffer is 64-byte aligned (a cache line; Eigen's largest packet), measured from the
/// first aligned address of the caller's buffer, so the caller's buffer may have any alignment.
constexpr std::size_t linear_alignment = 64;
constexpr std::size_t linear_absent = ~std::size_t{0};

/// Lays buffers one after another, each starting on a 64-byte boundary (from the aligned base).
struct buffer_stack {
  std::size_t at = 0;  ///< the end of the buffers taken so far
  std::size_t take(std::size_t bytes) {
    const std::size_t offset = at;
    at += (bytes + linear_alignment - 1) / linear_alignment * linear_alignment;
    return offset;
  }
  /// What a workspace holding these buffers needs: room to align whatever address it has.
  std::size_t bytes() const { return at + linear_alignment; }
};

/// Byte offsets of a call's buffers from the aligned base (linear_absent when not needed) and the
/// bytes it needs in all.
struct linear_plan {
  int threads = 1;                       ///< GEMM workers; each has its own weight block
  std::int64_t chunk_rows = 1;           ///< rows of hidden per chunk
  std::int64_t block = 1;                ///< weight rows per GEMM block
  std::size_t logits = linear_absent;    ///< chunk_rows x V: logits, then their gradient
  std::size_t row_loss = linear_absent;  ///< chunk_rows: row losses nobody asked for
  std::size_t x = linear_absent;         ///< chunk_rows x D: hidden rows in float (T not float)
  std::size_t wblock = linear_absent;    ///< threads x block x D: weight blocks (T not float)
  std::size_t bias = linear_absent;      ///< V: bias in float (T not float)
  std::size_t dx = linear_absent;        ///< chunk_rows x D: d_hidden rows in float (G not float)
  std::size_t dw = linear_absent;  ///< V x D, or threads x block x D (dw_accumulation::output)
  std::size_t db = linear_absent;  ///< V: d_bias in float (G not float)
  std::size_t end = 0;             ///< the end of the last buffer, from the aligned base
  std::size_t bytes = 0;           ///< what the call needs, alignment slack included
};

/// The plan of chunks of `chunk_rows` rows; its d_hidden buffer holds `dx_rows` rows (the chunk's,
/// or every row's for the low-memory order's sum).
template <class T, class G>
linear_plan make_linear_plan(const cpu& exec, const linear_shape& s, linear_pass pass,
                             dw_accumulation accumulate, std::int64_t chunk_rows,
                             std::int64_t dx_rows = -1) {
  linear_plan p;
  p.block = std::max<std::int64_t>(1, std::min(s.vocab, linear_block_rows));
  const std::int64_t blocks = (s.vocab + p.block - 1) / p.block;
  p.threads = static_cast<int>(std::max<std::int64_t>(
      1, std::min<std::int64_t>(std::min(std::max(exec.threads, 1), max_threads), blocks)));
  p.chunk_rows = chunk_rows;

  using A = accumulator_t<T>;
  constexpr bool convert_in = !std::is_same<T, A>::value;
  constexpr bool convert_out = !std::is_same<G, A>::value;
  const bool training = pass == linear_pass::training;
  buffer_stack stack;
  auto take = [&](std::int64_t elements, bool needed) {
    return needed ? stack.take(sizeof(A) * static_cast<std::size_t>(elements)) : linear_absent;
  };
  const std::int64_t R = chunk_rows, V = s.vocab, D = s.hidden;
  p.logits = take(R * V, true);
  p.row_loss = take(R, true);
  p.x = take(R * D, convert_in);
  p.wblock = take(p.threads * p.block * D, convert_in);
  p.bias = take(V, convert_in);
  p.dx = take((dx_rows < 0 ? R : dx_rows) * D, training && convert_out);
  p.dw = accumulate == dw_accumulation::fp32
             ? take(V * D, training && convert_out)
             : take(p.threads * p.block * D, training && convert_out);
  p.db = take(V, training && convert_out);
  p.end = stack.at;
  p.bytes = stack.bytes();
  return p;
}

/// The plan with the most rows per chunk (at most every row) that fits `budget` bytes; the
/// one-row plan when none does.
template <class T, class G>
linear_plan plan_linear(const cpu& exec, const linear_shape& s, linear_pass pass,
                        dw_accumulation accumulate, std::size_t budget) {
  return detail::largest_chunk_plan(s.rows, budget, [&](std::int64_t rows) {
    return make_linear_plan<T, G>(exec, s, pass, accumulate, rows);
  });
}

/// Weight rows per panel of the low-memory order: a 256-row block per thread, at least four
/// (1024 rows). A panel's d_weight sum is panel x D floats (16 MiB at D = 4096), and d_hidden's
/// N x D float sum is read and written once per panel, so wider panels trade the one for the
/// other. Not tuned by measurement yet.
inline std::int64_t panel_cols(const cpu& exec, std::int64_t vocab) {
  const std::int64_t threads = std::min(std::max(exec.threads, 1), max_threads);
  return std::max<std::int64_t>(
      1, std::min(vocab, linear_block_rows * std::max<std::int64_t>(threads, 4)));
}

/// Rows of a tile of the sparse backward (linear_options::sparse_threshold): a tile is this many
/// rows of a panel sub-chunk by one weight block. Its d_weight GEMM has K = 64 (runs of hot tiles
/// merge into one GEMM); smaller tiles skip more but multiply less efficiently. Not tuned by
/// measurement yet.
constexpr std::int64_t sparse_tile_rows = 64;

/// The low-memory order's workspace (linear_order::low_memory): one region holds first the
/// statistics' row chunks over the whole vocabulary, then a panel's row sub-chunks (d_hidden's
/// N x D float sum in the panel plan's dx); each row's LSE and target mass follow it, and with a
/// sparse threshold what the sparse backward needs (linear_sparse.hpp).
struct low_memory_plan {
  linear_plan stats;  ///< the forward over row chunks that saves each row's LSE
  linear_plan panel;  ///< one panel of `cols` weight rows, chunk_rows rows at a time
  std::int64_t cols = 1;
  std::size_t lse = linear_absent;     ///< N: each row's LSE
  std::size_t mass = linear_absent;    ///< N: each row's target mass
  std::size_t hot = linear_absent;     ///< a byte per tile of a panel sub-chunk: whether it is kept
  std::size_t cold = linear_absent;    ///< a byte per row and weight block: cold in the forward
  std::size_t smooth = linear_absent;  ///< 2 x D: label smoothing's kept sums
  std::size_t end = 0;                 ///< the end of the last buffer, from the aligned base
  std::size_t bytes = 0;
};

/// Panel sub-chunks of `rows` rows, statistics chunks of `stats_rows` rows over the whole
/// vocabulary; `sparse`: with the sparse backward's buffers (N x ceil(V / 256) bytes, 4 MiB at
/// 8192 x 128256, plus a byte per tile and 2 D floats).
template <class T, class G>
low_memory_plan make_low_memory_plan(const cpu& exec, const linear_shape& s, std::int64_t rows,
                                     std::int64_t stats_rows = 1, bool sparse = false) {
  low_memory_plan p;
  p.cols = panel_cols(exec, s.vocab);
  p.panel = make_linear_plan<T, G>(exec, {s.rows, s.hidden, p.cols}, linear_pass::training,
                                   dw_accumulation::fp32, rows, s.rows);
  p.stats =
      make_linear_plan<T, G>(exec, s, linear_pass::forward, dw_accumulation::fp32, stats_rows);
  buffer_stack stack{std::max(p.panel.end, p.stats.end)};
  using A = accumulator_t<T>;
  p.lse = stack.take(sizeof(A) * static_cast<std::size_t>(s.rows));
  p.mass = stack.take(sizeof(A) * static_cast<std::size_t>(s.rows));
  if (sparse) {
    const std::int64_t blocks = (s.vocab + linear_block_rows - 1) / linear_block_rows;
    const std::int64_t tiles = (rows + sparse_tile_rows - 1) / sparse_tile_rows *
                               ((p.cols + p.panel.block - 1) / p.panel.block);
    p.hot = stack.take(static_cast<std::size_t>(tiles));
    p.cold = stack.take(static_cast<std::size_t>(s.rows * blocks));
    p.smooth = stack.take(sizeof(A) * 2 * static_cast<std::size_t>(s.hidden));
  }
  p.end = stack.at;
  p.bytes = stack.bytes();
  return p;
}

/// The low-memory plan with the largest panel sub-chunks that fit `budget` bytes, then the largest
/// statistics chunks that fit it beside them: sized to the panel's logits bytes instead, they were
/// 32 rows at 1024 x 512 x 32000, GEMMs of a fraction of the fast order's rows.
template <class T, class G>
low_memory_plan plan_low_memory(const cpu& exec, const linear_shape& s, std::size_t budget,
                                bool sparse = false) {
  const std::int64_t rows = detail::largest_chunk_plan(s.rows, budget, [&](std::int64_t r) {
                              return make_low_memory_plan<T, G>(exec, s, r, 1, sparse);
                            }).panel.chunk_rows;
  return detail::largest_chunk_plan(s.rows, budget, [&](std::int64_t stats_rows) {
    return make_low_memory_plan<T, G>(exec, s, rows, stats_rows, sparse);
  });
}

}  // namespace cpu_detail
}  // namespace xent
