// The tuning table of the CUDA backend: one row per GPU architecture, and `policy`, the row a
// build compiles its kernels with.
//
// A row holds two kinds of column. Capabilities (bulk copies and TMA, thread-block clusters with
// distributed shared memory, programmatic dependent launch, wgmma) say which kernels a device can
// run: host dispatch asks tuning_for(the device's compute capability) for them, device code asks
// XENT_CUDA_SM90_PTX (below: inline PTX that assembles for sm_90 alone, one guard in one place,
// tied to the row of __CUDA_ARCH__ by a static_assert). Numbers (threads, vectors per thread,
// stages, thresholds) shape the kernels; they are compile-time constants, taken from the row of
// XENT_CUDA_TUNED_MAJOR (below), which `policy` exposes to kernels and dispatch. Both rows hold
// sm_90's numbers (measured on an H200 and an H100).
// tuning_for picks the first row whose min_major the device reaches; sm_80 and older take the
// default row (the numbers of sm_90, every Hopper capability off).
//
// Adding a GPU (sm_100, say): one new row ahead of the rows it supersedes, its capabilities set,
// and a run of bench/cuda_variants.sh on it for the numbers that row changes; builds for it
// (XENT_CUDA_TUNED_MAJOR=10) compile their kernels with that row's numbers (docs/tuning.md).
//
// Overrides: xent's own benchmark and test builds may replace single numbers of the built row
// through one hook, XENT_CUDA_TUNING_OVERRIDE (a header naming `tuned`; CMake's XENT_CUDA_TUNING
// sets it, bench/tuning/override.cuh is that header). Without it the build takes its row whole.
#pragma once

#include <cstddef>
#include <cstdint>

namespace xent {
namespace cuda_detail {

/// One row of the table: each field says what its knob is; sm90_row's comments name the
/// measurement behind each value, docs/design.md (the tuning table's measurements) the rest.
struct tuning {
  /// The smallest compute capability major that takes this row.
  int min_major;

  // Capabilities: what the dispatch asks before it takes a kernel.
  bool bulk_copy;         ///< bulk copies (cp.async.bulk, TMA) and mbarriers
  bool clusters;          ///< thread-block clusters and distributed shared memory
  bool dependent_launch;  ///< programmatic dependent launch (griddepcontrol)
  bool wgmma;             ///< warpgroup MMA (the stats GEMM; its kernel needs an sm_90a build too)
  bool warp_rows;         ///< the warp-rows kernel's shapes hold here

  // The row kernel.
  int min_blocks;      ///< CTAs per SM its registers are bounded for; 0: per pass and dtype
  int overlap_rows;    ///< 1: a row's gradient after the next row's statistics; -1: per dtype
  int block;           ///< threads per CTA
  int stages;          ///< shared-memory stages per CTA
  int stats_unroll;    ///< vectors in flight per thread in a statistics sweep
  int split_barriers;  ///< 1: row hand-offs by named barriers; 0: CTA barriers
  int chunk_kib;       ///< KiB of a stage (the register tile is chunk / block / 16 vectors)
  int running_max;     ///< 1: a streamed chunk's exponentials against the running max
  int whole_rows;      ///< forwards with this many rows per CTA in flight stream whole rows

  // The streaming backward.
  int stream_backward;           ///< 1: class-id backward by it
  int stream_regs;               ///< 16-byte vectors per thread per tile
  int stream_min_blocks;         ///< CTAs per SM of its plain rows
  int stream_option_min_blocks;  ///< CTAs per SM of its option paths

  // The gradient's arithmetic.
  int fold_scale;  ///< 1: 16-bit gradients take the row's scale in the exponent
  int exp_once;    ///< 1: plain fused 16-bit rows keep their exponentials

  // The small-batch kernel.
  int small_regs;         ///< 16-byte vectors per thread (0: off)
  int small_exp_once;     ///< 1: its fp32 fused rows keep their exponentials
  int small_ctas_per_sm;  ///< the most CTAs per SM a launch of it may span

  // The bulk backward and the gradient stage.
  int bulk_backward;                  ///< 1: plain aligned backward by bulk copies both ways
  int bulk_backward_regs;             ///< 16-byte vectors per thread of its tiles
  int bulk_backward_stages;           ///< its shared-memory stages
  int bulk_backward_min_blocks;       ///< its CTAs per SM
  int bulk_backward_long_from_kib;    ///< longer rows take its long form (0: none)
  int bulk_backward_long_stages;      ///< the long form's shared-memory stages
  int bulk_backward_long_min_blocks;  ///< the long form's CTAs per SM
  int bulk_gradient;  ///< fused resident rows' gradient by bulk copy: 2 all, 1 keep_exps, 0 none

  // The row kernel's wide shape.
  int wide_rows;      ///< 1: long plain fused aligned rows take it
  int wide_from_kib;  ///< rows longer than this take it

  // The streaming forward.
  int stream_forward;                ///< 1: plain forwards by it
  int stream_forward_regs;           ///< 16-byte vectors per thread per tile
  int stream_forward_min_blocks;     ///< CTAs per SM its registers are bounded for
  int stream_forward_block;          ///< threads per CTA
  int stream_forward_wide_from_kib;  ///< longer rows take CTAs of twice the threads (0: none)

  // Fused linear cross-entropy.
  int stats_gemm;          ///< 1: the forward by the Hopper statistics GEMM
  int stats_gemm_cluster;  ///< its CTAs per cluster (1 or 2)
  int stats_gemm_logits;   ///< 1: training's chunk logits by that GEMM too
  int scaled_probs;        ///< 1: training by scaled probabilities (no cross-entropy pass)
  int accumulate_by_lt;    ///< 1: d_weight's float sum by cuBLASLt with a chosen tile

  // Forms of the row kernel and its neighbours.
  int normalizer_ahead;        ///< 1: the mean's W by a kernel launched ahead
  int row_queue;               ///< 1: resident aligned rows from a queue
  int stream_forward_handoff;  ///< 1: the streaming forward's row hand-off by named barriers
  int shifted_rows;            ///< 1: fused rows off 16-byte boundaries cut at their own
  int trim_tiles;              ///< 1: whole-tile rows sweep only the vectors in use

  // The warp-rows kernel.
  int warp_rows_kib;                 ///< rows up to this many KiB take it (12 at most; 0: none)
  int warp_rows_regs;                ///< 16-byte vectors per lane, short form
  int warp_rows_min_blocks;          ///< CTAs per SM, short form
  int warp_rows_forward_min_blocks;  ///< CTAs per SM of its forward
  int warp_rows_long_regs;           ///< 16-byte vectors per lane, long form
  int warp_rows_long_min_blocks;     ///< CTAs per SM, long form
  int warp_rows_shifted;             ///< 1: short fused rows off 16-byte boundaries by it
  int warp_rows_shifted_passes;      ///< 1: and such forwards and backwards

  // Split fused passes and grids.
  int split_fused_kib;  ///< plain fused rows up to this many KiB by two kernels (0: none)
  int balanced_grid;    ///< 1: the bulk backward's grid cut to equal tiles per CTA
};

/// sm_90 (H100, H200): every value measured there (bench/cuda_variants.sh). Each value's line
/// names the benchmark line that chose it: rows x classes ("fused": forward_backward in place),
/// before -> after the value, or the value's time and then an alternative's.
constexpr tuning sm90_row = {
    /*min_major=*/9,
    // sm_90 has every capability below; the kernels that take them were written for it.
    /*bulk_copy=*/true,
    /*clusters=*/true,
    /*dependent_launch=*/true,
    /*wgmma=*/true,
    // The warp-rows kernel's register shapes were measured on sm_90 alone.
    /*warp_rows=*/true,

    // Per pass and dtype: bf16 backward 16384 x 128256 2.52 ms at three CTAs, 2.44 at two (H200)
    /*min_blocks=*/0,
    // Per dtype: bf16 fused 16384 x 128256 3.00 ms waiting, 2.715 row finished first (H200)
    /*overlap_rows=*/-1,
    // bf16 fused 16384 x 128256 3.45 ms; 512 threads x 64 KiB 4.17 (H200)
    /*block=*/256,
    // bf16 fused 16384 x 128256 3.45 ms; three stages 4.01 (H200)
    /*stages=*/2,
    // bf16 16384 x 128256: sweeps unrolled 8 deep instead of 2, no change (H200)
    /*stats_unroll=*/2,
    // bf16 fused 16384 x 128256 3.37 -> 3.16 ms against two __syncthreads per row (H200)
    /*split_barriers=*/1,
    // bf16 fused 16384 x 128256 2.90 ms; 16 KiB stages 3.47-3.51 (H200)
    /*chunk_kib=*/32,
    // bf16 forward 16384 x 128256 by whole rows 1.249 -> 1.058 ms (H200)
    /*running_max=*/1,
    // bf16 forward 16384 x 128256 1.587 -> 1.234 ms against rows over clusters (H200)
    /*whole_rows=*/1,

    // bf16 backward 16384 x 128256 2.419 -> 2.292 ms against the row kernel (H200)
    /*stream_backward=*/1,
    // Not swept: 16 KiB per CTA in flight, 54-56 registers at four CTAs per SM (ptxas, sm_90)
    /*stream_regs=*/4,
    // Not swept: 4 x 16 KiB of loads in flight per SM, more than the memory system needs
    /*stream_min_blocks=*/4,
    // Smoothing and softcap over 16-bit tiles spilled 7 KB at 64 registers (ptxas, sm_90)
    /*stream_option_min_blocks=*/2,

    // bf16 fused 16384 x 128256 2.711 -> 2.567 ms (H200)
    /*fold_scale=*/1,
    // bf16 fused 16384 x 128256 2.569 -> 2.510 ms (H200)
    /*exp_once=*/1,

    // fp32 fused, 8 KiB slices (2): 128 x 32000 20.2 us, no faster; 32 x 50257 30.1 (H200)
    /*small_regs=*/4,
    // fp32 fused mean 128 x 32000 15.7 -> 15.45 us (H200)
    /*small_exp_once=*/1,
    // fp32 fused 128 x 32000: the row kernel at four no faster (20.8 us) (H200)
    /*small_ctas_per_sm=*/8,

    // bf16 backward 16384 x 128256 2.307 -> 2.197 ms against register stores (H200)
    /*bulk_backward=*/1,
    // bf16 backward 8192 x 32000: 16 KiB tiles 275 us, 8 KiB 271-272 (H200)
    /*bulk_backward_regs=*/2,
    // bf16 backward 16384 x 128256: 4 x 16 KiB 2.185 ms, 8 x 8 KiB 2.106-2.122 (H200);
    // 8192 x 32000 at eight 361.3-362.0 us, nine 350.4-350.7 (H100)
    /*bulk_backward_stages=*/9,
    // bf16 backward 16384 x 128256: four CTAs x 3 stages 2.291 ms, three x 4 2.197 (H200)
    /*bulk_backward_min_blocks=*/3,
    // bf16 backward 16384 x 128256 (250 KiB rows) at nine x three 2959.9-2967.6 us, twelve x two
    // 2893.5-2914.4; 8192 x 32000 (62.5 KiB) at twelve x two 377.7-377.8 (H100)
    /*bulk_backward_long_from_kib=*/128,
    // With the next: 4096 x 262144 at twelve x two 1467.7-1469.0 us, nine x three 1462.0-1462.5,
    // eight x three 1466.2-1467.8 (H100)
    /*bulk_backward_long_stages=*/12,
    /*bulk_backward_long_min_blocks=*/2,
    // fp32 fused 8192 x 128256 2.355 -> 2.181 ms with whole tiles (H200)
    /*bulk_gradient=*/2,

    // bf16 fused 4096 x 262144 1.162 -> 1.088 ms (H200)
    /*wide_rows=*/1,
    // fp32 fused 8192 x 32000 (125 KiB rows) 547 -> 534 us; from 32 KiB slower (H200)
    /*wide_from_kib=*/120,

    // bf16 forward 8192 x 32000 176 -> 153 us against the row kernel (H200)
    /*stream_forward=*/1,
    // bf16 forward 8192 x 32000 153 us; eight vectors at three CTAs per SM 159 (H200)
    /*stream_forward_regs=*/4,
    // With 128 threads, the threads per SM of 256 x 4 (measured with the block below)
    /*stream_forward_min_blocks=*/8,
    // bf16 forward 65536 x 3008 331-332 -> 181 us against 256 x 4 (H200)
    /*stream_forward_block=*/128,
    // bf16 forward 16384 x 128256 1013 -> 994 us at 512 x 2 (H200)
    /*stream_forward_wide_from_kib=*/128,

    // bf16 linear_forward 16384 x 2304 x 256000 1.21x -> 1.015x of X Wᵀ alone (H200)
    /*stats_gemm=*/1,
    // bf16 linear_forward 16384 x 2304 x 256000 31.1 -> 27.0 ms (H100)
    /*stats_gemm_cluster=*/2,
    // bf16 training 8192 x 4096 x 128256 38.8 / 38.2 against 38.6 / 38.6 ms: spread (H100)
    /*stats_gemm_logits=*/0,
    // bf16 training 16384 x 2304 x 256000 93.6 -> 88.8 ms (H200)
    /*scaled_probs=*/1,
    // bf16 d_weight GEMM of a 2048-row chunk, V 256000, D 2304: 3.86 -> 3.50 ms (H200)
    /*accumulate_by_lt=*/1,

    // bf16 fused mean 8192 x 32000 284 -> 281 us (H200)
    /*normalizer_ahead=*/1,
    // bf16 fused 8192 x 32000 280.5 -> 267.2 us (H200)
    /*row_queue=*/1,
    // bf16 forward 8192 x 32000 149 -> 148 us (H200)
    /*stream_forward_handoff=*/1,
    // bf16 fused in place 8192 x 50257 664 -> 510 us against the split kernels (H200)
    /*shifted_rows=*/1,
    // bf16 fused 8192 x 20480 225 -> 196 us (H200)
    /*trim_tiles=*/1,

    // bf16 fused 32768 x 6016 389 -> 274-276 us by the long form (H200)
    /*warp_rows_kib=*/12,
    // bf16 fused 65536 x 3008 746 -> 238-239 us; at 16, 144 bytes of spill (ptxas, sm_90)
    /*warp_rows_regs=*/12,
    // Not swept: at most 128 registers per thread for the 12-vector tile
    /*warp_rows_min_blocks=*/2,
    // bf16 forward 65536 x 3008 at 2 / 3 / 4 CTAs per SM: 144 / 134 / 161 us (H200)
    /*warp_rows_forward_min_blocks=*/3,
    // Twice the short form's: 238-255 registers, no spill (ptxas, sm_90)
    /*warp_rows_long_regs=*/24,
    // Not swept: 24 vectors per lane leave registers for one CTA per SM
    /*warp_rows_long_min_blocks=*/1,
    // bf16 fused 65536 x 3001 681 -> 349 us (H200)
    /*warp_rows_shifted=*/1,
    // bf16 forward 65536 x 3001 288 -> 160 us (H100)
    /*warp_rows_shifted_passes=*/1,

    // bf16 fused in place 65536 x 3001 898 -> 680 us; 24 KiB rows 220 -> 317 (H200)
    /*split_fused_kib=*/8,
    // bf16 backward 8192 x 32000 278 -> 275 us (H200)
    /*balanced_grid=*/1};

/// A row with every capability off and the numbers of `r`.
constexpr tuning without_capabilities(tuning r, int min_major) {
  r.min_major = min_major;
  r.bulk_copy = r.clusters = r.dependent_launch = r.wgmma = r.warp_rows = false;
  return r;
}

/// The table, newest architecture first; the last row takes every device.
constexpr tuning tuning_rows[] = {sm90_row, without_capabilities(sm90_row, 0)};

/// The row of a device of compute capability `major`.
constexpr const tuning& tuning_for(int major) {
  for (const tuning& r : tuning_rows)
    if (major >= r.min_major) return r;
  return tuning_rows[sizeof(tuning_rows) / sizeof(tuning_rows[0]) - 1];
}

}  // namespace cuda_detail
}  // namespace xent

// Device code's view of its row: inline PTX of the capabilities above assembles for sm_90 alone.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define XENT_CUDA_SM90_PTX 1
#else
#define XENT_CUDA_SM90_PTX 0
#endif
#ifdef __CUDA_ARCH__
static_assert(xent::cuda_detail::tuning_for(__CUDA_ARCH__ / 100).bulk_copy ==
                  (XENT_CUDA_SM90_PTX != 0),
              "the device row's capabilities and the PTX compiled");
#endif

// The compute capability major whose row's numbers a build's kernels take: one set per build,
// since host code launches the kernels of every architecture in a fat binary with the same launch
// shapes. A build for a GPU with a row of its own defines it (CMake's XENT_CUDA_TUNED_MAJOR).
#ifndef XENT_CUDA_TUNED_MAJOR
#define XENT_CUDA_TUNED_MAJOR 9
#endif

namespace xent {
namespace cuda_detail {
/// The row of the architecture this build is tuned for.
constexpr tuning tuned_row = tuning_for(XENT_CUDA_TUNED_MAJOR);
}  // namespace cuda_detail
}  // namespace xent

#ifdef XENT_CUDA_TUNING_OVERRIDE
#include XENT_CUDA_TUNING_OVERRIDE
#else
namespace xent {
namespace cuda_detail {
/// The row this build's kernels are compiled with.
constexpr tuning tuned = tuned_row;
}  // namespace cuda_detail
}  // namespace xent
#endif

namespace xent {
namespace cuda_detail {

/// How a row kernel takes its rows: dealt out in turn (none), from the row queue in a kernel that
/// does nothing else (own_kernel), or from it in a branch of the kernel that also deals and
/// streams rows (branch; policy::queue_form).
enum class row_queue_form { none, own_kernel, branch };

/// The numbers of the built row (`tuned`) as the kernels and dispatch use them: each member says
/// what it derives; the measurements are the row's comments.
struct policy {
  /// Threads per CTA of the row kernel.
  static constexpr int block = tuned.block;
  /// CTAs per SM the row kernel's registers are bounded for (__launch_bounds__): three (80
  /// registers), two (128) for 16-bit backward, for fused rows that keep their exponentials as a
  /// float tile (64 registers), and for plain fused aligned rows with whole tiles and a gradient
  /// stage (`Two`).
  template <class T, bool Backward, bool Two = false>
  static constexpr int min_blocks() {
    if (tuned.min_blocks != 0) return tuned.min_blocks;
    return (sizeof(T) == 2 && Backward) || Two ? 2 : 3;
  }
  /// Shared-memory stages per CTA: the next row's chunk streams in while this one is processed.
  static constexpr int stages = tuned.stages;
  /// Bytes of a stage. 2 x 32 KiB per CTA leaves room for three CTAs per SM (227 KiB); the fused
  /// rows with a gradient stage (bulk_gradient) take three, at two CTAs per SM.
  static constexpr std::size_t max_chunk_bytes = tuned.chunk_kib * 1024;
  /// Vectors per thread in flight in a statistics sweep over shared memory: unrolling the whole
  /// chunk there would hold a second chunk in registers beside the tile.
  static constexpr int stats_unroll = tuned.stats_unroll;
  /// 16-byte vectors per thread that hold a chunk in registers (32 registers for 32 KiB).
  static constexpr int regs = static_cast<int>(max_chunk_bytes / (16 * block));
  static_assert(regs * 16 * block == max_chunk_bytes, "a chunk is whole vectors per thread");
  /// Row hand-offs inside a CTA through named producer/consumer barriers (bar.arrive / bar.sync),
  /// so only warp 0 waits for a row's partials and the other warps wait for its result only when
  /// the gradient is due. compute-sanitizer's racecheck does not model bar.arrive and reports
  /// barrier-separated accesses anywhere in such a kernel as hazards, so the sanitizer build
  /// (bench/gpu/run.sh's sanitize part) checks the same protocol with full barriers
  /// (tuned.split_barriers=0).
  static constexpr bool split_barriers = tuned.split_barriers != 0;
  /// Whether a row's gradient waits until the next row's statistics are taken (hiding its cluster
  /// round trip) or is written first. Waiting holds the row's register tile across those sweeps,
  /// which fused 16-bit rows cannot afford at three CTAs per SM (the tile spills): they finish a
  /// row first.
  template <class T, bool Fused>
  static constexpr bool overlap_rows = tuned.overlap_rows >= 0 ? tuned.overlap_rows != 0
                                                               : sizeof(T) == 4 || !Fused;
  /// A forward pass over at least this many rows per CTA in flight gives each CTA whole rows,
  /// streamed chunk by chunk with an online LSE (0: never): a row cut over a cluster makes its
  /// CTAs meet once per row, and the forward has no gradient sweep to hide that round trip behind.
  static constexpr int whole_rows = tuned.whole_rows;
  /// Whether a streamed row's chunks after its first take their exponentials relative to the
  /// row's running max in one sweep (no max sweep; see chunk_stats).
  static constexpr bool running_max = tuned.running_max != 0;
  /// Whether class-id backward with 16-byte-aligned rows runs the streaming kernel
  /// (backward_kernel.cuh: no shared-memory stage, no cluster) instead of the row kernel.
  static constexpr bool stream_backward = tuned.stream_backward != 0;
  /// Vectors per thread per tile of the streaming backward (4 x 16 bytes x 256 threads = 16 KiB).
  static constexpr int stream_regs = tuned.stream_regs;
  /// CTAs per SM the streaming backward's registers are bounded for: its plain rows, or the
  /// option paths' per-element smoothing and softcap terms.
  static constexpr int stream_min_blocks(bool plain) {
    return plain ? tuned.stream_min_blocks : tuned.stream_option_min_blocks;
  }
  /// Whether plain kernels with 16-bit gradients fold the row's scale into the exponent (2^(x
  /// log2e - shift + log2 |scale|), the sign xored onto the rounded pairs) instead of a multiply
  /// per element.
  static constexpr bool fold_scale = tuned.fold_scale != 0;
  /// Whether plain fused 16-bit rows keep each element's exponential from the statistics (a float
  /// tile, exp_tile) and form the gradient with a multiply: one exponential per element instead
  /// of two. The float tile is 64 registers: two CTAs per SM (min_blocks).
  static constexpr bool exp_once = tuned.exp_once != 0;
  /// The kernels that keep them: plain fused 16-bit rows finished before the next row's
  /// statistics (the float tile is not held across them).
  template <class T, bool Plain, bool Fused>
  static constexpr bool keep_exps = (exp_once && Plain && Fused && sizeof(T) == 2 &&
                                     !overlap_rows<T, Fused>);
  /// The small-batch kernel (small_rows_kernel.cuh): vectors per thread (16 KiB of a row per
  /// 256-thread CTA), and the most CTAs per SM a launch of it may span (rows x cluster), beyond
  /// which the row kernel's persistent clusters take the batch.
  static constexpr int small_regs = tuned.small_regs;
  static constexpr int small_ctas_per_sm = tuned.small_ctas_per_sm;
  /// Whether the small-batch kernel's fp32 fused rows keep the statistics' exponentials for the
  /// gradient (a multiply per element instead of a second exponential).
  static constexpr bool small_exp_once = tuned.small_exp_once != 0;
  /// Whether plain class-id forwards, 16-byte aligned, run the streaming forward kernel
  /// (forward_kernel.cuh: whole rows per CTA, tiles straight from global memory) when the batch
  /// gives each CTA in flight a row.
  static constexpr bool stream_forward = tuned.stream_forward != 0;
  static constexpr int stream_forward_regs = tuned.stream_forward_regs;
  static constexpr int stream_forward_min_blocks = tuned.stream_forward_min_blocks;
  static constexpr int stream_forward_block = tuned.stream_forward_block;
  /// Rows longer than stream_forward_wide_from_kib KiB take CTAs of twice the threads at half the
  /// CTAs per SM (the same registers per thread, tiles twice as long).
  static constexpr int stream_forward_wide_from_kib = tuned.stream_forward_wide_from_kib;
  /// Whether the streaming forward hands each row's warp parts to warp 0 by named barriers (warps
  /// 1.. go on to the next row) rather than a CTA barrier, where every warp waited for the
  /// slowest warp's last tile of the row (split_barriers as well).
  static constexpr bool stream_forward_handoff = tuned.stream_forward_handoff != 0;
  /// Whether the fused linear forward takes the Hopper GEMM that keeps each row's statistics in its
  /// epilogue (stats_gemm.cuh; sm_90a builds, bf16, plain options) rather than cuBLAS and the
  /// cross-entropy pass over each chunk's logits.
  static constexpr bool stats_gemm = tuned.stats_gemm != 0;
  /// CTAs per cluster of that GEMM: two on neighbouring row tiles each load half of every W tile
  /// into both by a multicast copy, halving the L2-to-shared traffic of W.
  static constexpr int stats_gemm_cluster = tuned.stats_gemm_cluster;
  static_assert(stats_gemm_cluster == 1 || stats_gemm_cluster == 2, "the stats GEMM's forms");
  /// Whether fused linear training and backward form each chunk's logits by that GEMM's
  /// logits-storing form (bf16, no bias, D a multiple of 8, 16-byte aligned operands, sm_90a)
  /// rather than cublasGemmEx, where scaled_probs below does not apply.
  static constexpr bool stats_gemm_logits = tuned.stats_gemm_logits != 0;
  /// Whether fused linear training (bf16, class ids without smoothing or softcap, no bias, no
  /// argmax asked; D a multiple of 8, sm_90a) stores each chunk's scaled probabilities from that
  /// GEMM and takes the row scales into the backward GEMMs, so no cross-entropy pass runs
  /// (scaled_probs.cuh). Every bf16 training plan has room for its buffers while this is on.
  static constexpr bool scaled_probs = tuned.scaled_probs != 0;
  /// Whether fused linear training adds each chunk's d_weight into the float accumulator through
  /// cuBLASLt with the tile accumulate_gemm.cuh chooses (where it offers one) rather than
  /// cublasGemmEx's own choice.
  static constexpr bool accumulate_by_lt = tuned.accumulate_by_lt != 0;
  /// Whether the row kernel's mean normaliser (fused and backward passes) is summed by one CTA of
  /// a kernel launched ahead of it, the row kernel its programmatic dependant, rather than by
  /// every CTA of the row kernel at its start.
  static constexpr bool normalizer_ahead = tuned.normalizer_ahead != 0;
  /// Whether the resident row kernel (bulk copies, forward or fused, a workspace given, rows on
  /// 16-byte boundaries) takes rows from a queue (row_queue.cuh) rather than each cluster a fixed
  /// share. Rows off 16-byte boundaries (Shifted) are dealt: queued, they measured slower.
  static constexpr bool row_queue = tuned.row_queue != 0;
  /// How the row kernel's queued rows are compiled (row_queue_form): in a kernel of their own
  /// (every queue test resolved at compile time), or as a branch of the kernel that also deals
  /// rows and streams long ones, which measured faster for the wide 16-bit kernel alone
  /// (docs/design.md, the row queue).
  template <class T, int Block>
  static constexpr row_queue_form queue_form = sizeof(T) == 2 && Block > block
                                                   ? row_queue_form::branch
                                                   : row_queue_form::own_kernel;
  /// Whether the bulk backward's persistent grid takes as few CTAs as walk the same most tiles
  /// each (persistent_grid) rather than as many as the SMs hold. Not the streaming forward's:
  /// there the rows each SM walks set the time, and fewer CTAs put more rows on some SMs.
  static constexpr bool balanced_grid = tuned.balanced_grid != 0;
  /// Whether plain fused rows off 16-byte boundaries, whose gradient rows share those boundaries
  /// (in place, say), on sm_90, take the row kernel cut at each row's own boundaries (row_kernel's
  /// Shifted: one read and one write of the logits, resident rows up to 512 KiB) rather than the
  /// streaming forward and then the bulk backward from its LSE (two reads and a write).
  static constexpr bool shifted_rows = tuned.shifted_rows != 0;
  /// Whether the row kernel's whole-tile rows (plain fused resident rows; CTAs of the default
  /// shape) whose slices fill at most regs - 2 or regs - 1 of each thread's vectors sweep only
  /// those: the sweeps past a slice take exponentials of -inf. The wide shape keeps whole tiles
  /// (the trimmed code cost its kernel).
  static constexpr bool trim_tiles = tuned.trim_tiles != 0;
  /// Plain fused rows of at most split_fused_kib KiB in a batch long enough for the streaming
  /// forward (aligned, or cut at their own boundaries where the gradient's share them) run it and
  /// then the bulk backward from the LSE it wrote (launch_split_fused), rather than the row kernel,
  /// whose 32 KiB tiles such rows fill a sliver of. Taken after the warp-rows kernel.
  static constexpr int split_fused_kib = tuned.split_fused_kib;
  /// Plain class-id rows, 16-byte aligned, of at most warp_rows_kib KiB, every pass, take the
  /// warp-rows kernel: a warp per row held in its registers from the load to the gradient's
  /// store. The short form holds 6 KiB rows (warp_rows_regs vectors per lane); fused rows of 6 to
  /// 12 KiB take the long form (warp_rows_long_regs, one CTA per SM: half the rows in flight,
  /// too few for 6 KiB rows and for forwards). Taken before split_fused_kib.
  static constexpr int warp_rows_kib = tuned.warp_rows_kib;
  static constexpr int warp_rows_regs = tuned.warp_rows_regs;
  static constexpr int warp_rows_min_blocks = tuned.warp_rows_min_blocks;
  /// The forward holds no gradient: more CTAs per SM, though ptxas (sm_90) then spills 176 bytes
  /// of the bf16 instantiation at its 80 registers.
  static constexpr int warp_rows_forward_min_blocks = tuned.warp_rows_forward_min_blocks;
  /// Whether fused rows off 16-byte boundaries whose gradient rows share them, short enough for
  /// the short form with their lead, take the warp-rows kernel cut at each row's own boundaries
  /// (the streaming kernels' lead) before the split pass.
  static constexpr bool warp_rows_shifted = tuned.warp_rows_shifted != 0;
  /// Whether forwards of short rows off 16-byte boundaries, and backwards whose gradient rows
  /// share those boundaries, take the same cut form of the warp-rows kernel (the short form)
  /// instead of the streaming kernels' shifted forms.
  static constexpr bool warp_rows_shifted_passes = tuned.warp_rows_shifted_passes != 0;
  static constexpr int warp_rows_long_regs = tuned.warp_rows_long_regs;
  static constexpr int warp_rows_long_min_blocks = tuned.warp_rows_long_min_blocks;
  /// Whether backward calls with plain class-id rows, 16-byte aligned, on sm_90, move the
  /// streaming backward's tiles by bulk copies both ways (bulk_backward_kernel: a tile staged in
  /// one of bulk_backward_stages shared-memory stages, its gradient written back over it and
  /// stored by one bulk copy): register loads and stores stop at 85-86% of the copy roof on an
  /// H200 (BM_copy_kernel).
  static constexpr bool bulk_backward = tuned.bulk_backward != 0;
  static constexpr int bulk_backward_regs = tuned.bulk_backward_regs;
  static constexpr int bulk_backward_stages = tuned.bulk_backward_stages;
  static constexpr int bulk_backward_min_blocks = tuned.bulk_backward_min_blocks;
  /// Rows longer than bulk_backward_long_from_kib KiB (0: none) take the bulk backward with
  /// bulk_backward_long_stages stages at bulk_backward_long_min_blocks CTAs per SM: on an H100 the
  /// long rows ran faster with fewer, deeper CTAs and the short ones slower.
  static constexpr int bulk_backward_long_from_kib = tuned.bulk_backward_long_from_kib;
  static constexpr int bulk_backward_long_stages = tuned.bulk_backward_long_stages;
  static constexpr int bulk_backward_long_min_blocks = tuned.bulk_backward_long_min_blocks;
  /// Whether plain fused resident rows on sm_90 write their gradient into a shared-memory stage
  /// of its own (one chunk more per CTA) and store it by one bulk copy, instead of 16-byte stores
  /// from registers. 2: every such row whose gradient has the logits' type (two CTAs per SM:
  /// min_blocks); 1: only the 16-bit rows that keep their exponentials; 0: never. It also lets
  /// the 16-bit rows sweep whole tiles (whole_extent).
  template <class T, class G, bool Plain, bool Fused>
  static constexpr bool bulk_gradient = (Plain && Fused) && sizeof(T) == sizeof(G) &&
                                        (tuned.bulk_gradient >= 2 ||
                                         (tuned.bulk_gradient == 1 && keep_exps<T, Plain, Fused>));
  /// Whether plain fused aligned rows on sm_90 longer than wide_from_bytes and at most
  /// cluster_max wide chunks take the wide shape (wide_shape: CTAs of twice the threads, each
  /// holding a chunk twice as large, one CTA per SM at the same registers per thread): half the
  /// CTAs per row, so clusters of 16 become 8, which pack where the GPCs fit 14 of 16 at two CTAs
  /// per SM (224 of 264 CTA slots), and rows up to 1 MiB are held on chip where the default shape
  /// streams them through twice.
  static constexpr bool wide_rows = tuned.wide_rows != 0;
  static constexpr std::int64_t wide_from_bytes = std::int64_t{tuned.wide_from_kib} * 1024;
  /// Cluster size limit: 16 is the non-portable maximum of sm_90.
  static constexpr int cluster_max = 16;
  /// Smallest slice worth a CTA when a short batch is spread over more CTAs.
  static constexpr std::int64_t min_slice_bytes = 4096;
};

/// A shape of the row kernel's CTAs: threads, and 16-byte vectors per thread of a chunk (a stage
/// holds Block x Regs vectors).
template <int Block, int Regs>
struct row_shape {
  static constexpr int block = Block, regs = Regs;
  static constexpr std::size_t chunk_bytes = std::size_t{16} * Block * Regs;
  /// CTAs per SM that `min_blocks` CTAs of the default shape's registers per thread come to.
  static constexpr int blocks_at(int min_blocks) {
    return min_blocks * policy::block / Block > 0 ? min_blocks * policy::block / Block : 1;
  }
};
using default_shape = row_shape<policy::block, policy::regs>;
using wide_shape = row_shape<2 * policy::block, policy::regs>;
static_assert(default_shape::chunk_bytes == policy::max_chunk_bytes, "the default chunk");

}  // namespace cuda_detail
}  // namespace xent
