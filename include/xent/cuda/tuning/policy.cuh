// The tuning table of the CUDA backend: one row per GPU architecture, and `policy`, the row a
// build compiles its kernels with.
//
// A row holds two kinds of column. Capabilities (bulk copies and TMA, thread-block clusters with
// distributed shared memory, programmatic dependent launch, wgmma) say which kernels a device can
// run: host dispatch asks tuning_for(the device's compute capability) for them, device code asks
// XENT_CUDA_SM90_PTX (below: inline PTX that assembles for sm_90 alone, one guard in one place,
// tied to the row of __CUDA_ARCH__ by a static_assert). Numbers (threads, vectors per thread,
// stages, thresholds) shape the kernels; they are compile-time constants, the same for every row
// today (sm_90's: measured on an H200 and an H100), which `policy` exposes to kernels and dispatch.
// tuning_for picks the first row whose min_major the device reaches; sm_80 and older take the
// default row (the numbers of sm_90, every Hopper capability off).
//
// Adding a GPU (sm_100, say): one new row ahead of the rows it supersedes, its capabilities set,
// and a run of bench/cuda_variants.sh on it for the numbers that row changes.
//
// Overrides: xent's own benchmark and test builds may replace single numbers of the built row
// through one hook, XENT_CUDA_TUNING_OVERRIDE (a header naming `tuned`; CMake's XENT_CUDA_TUNING
// sets it, bench/tuning/override.cuh is that header). Without it the build takes the sm_90 row.
#pragma once

#include <cstddef>
#include <cstdint>

namespace xent {
namespace cuda_detail {

/// One row of the table.
struct tuning {
  /// The smallest compute capability major that takes this row.
  int min_major;
  /// Capabilities: bulk copies (cp.async.bulk, TMA) and mbarriers.
  bool bulk_copy;
  /// Thread-block clusters and distributed shared memory.
  bool clusters;
  /// Programmatic dependent launch (griddepcontrol).
  bool dependent_launch;
  /// Warpgroup MMA (the fused linear forward's GEMM; its kernel needs an sm_90a build as well).
  bool wgmma;
  /// The warp-rows kernel's shapes hold (measured on sm_90 alone).
  bool warp_rows;
  /// When nonzero, replaces the per-dtype choice of policy::min_blocks.
  int min_blocks;
  /// When 0 or 1, replaces the per-dtype choice of policy::overlap_rows.
  int overlap_rows;
  int block;
  int stages;
  /// Vectors in flight per thread in a statistics sweep.
  int stats_unroll;
  /// 0: full CTA barriers for the row hand-offs (see policy).
  int split_barriers;
  int chunk_kib;
  /// 0: every chunk takes a max sweep before its exponentials.
  int running_max;
  /// Forward: rows per CTA in flight from which a CTA streams whole rows.
  int whole_rows;
  /// 1: class-id backward by the streaming kernel (see policy).
  int stream_backward;
  /// 0: the gradient sweep multiplies every element by the row's scale.
  int fold_scale;
  /// 0: fused plain 16-bit rows take a second exponential per element.
  int exp_once;
  /// 16-byte vectors per thread per tile of the streaming backward.
  int stream_regs;
  /// 16-byte vectors per thread of the small-batch kernel (0: off).
  int small_regs;
  /// 1: fp32 fused small batches keep their exponentials.
  int small_exp_once;
  /// The most CTAs per SM a small-batch launch may span.
  int small_ctas_per_sm;
  /// 1: plain backward tiles moved by bulk copies both ways (sm_90).
  int bulk_backward;
  /// 16-byte vectors per thread of its tiles.
  int bulk_backward_regs;
  int bulk_backward_stages;
  int bulk_backward_min_blocks;
  /// Fused resident rows' gradient by bulk copy (see policy).
  int bulk_gradient;
  /// 0: long plain fused rows keep the default CTA shape (see policy).
  int wide_rows;
  /// Rows longer than this take the wide shape.
  int wide_from_kib;
  /// 0: plain forwards by the row kernel too (see policy).
  int stream_forward;
  /// 16-byte vectors per thread per tile of it.
  int stream_forward_regs;
  /// CTAs per SM its registers are bounded for.
  int stream_forward_min_blocks;
  /// Threads per CTA of it.
  int stream_forward_block;
  /// Longer rows take its wide CTAs; 0: none (policy).
  int stream_forward_wide_from_kib;
  /// 0: the fused linear forward always by cuBLAS (see policy).
  int stats_gemm;
  /// 1: the stats GEMM's CTAs each load their own W tiles.
  int stats_gemm_cluster;
  /// 1: fused linear training's chunk logits by that GEMM too.
  int stats_gemm_logits;
  /// 0: fused linear training by the cross-entropy pass over logits.
  int scaled_probs;
  /// 0: d_weight's float accumulator by cublasGemmEx (see policy).
  int accumulate_by_lt;
  /// 0: every CTA sums the mean's normaliser (see policy).
  int normalizer_ahead;
  /// 0: the row kernel's rows dealt out in turn (see policy).
  int row_queue;
  /// 0: its rows end in a CTA barrier (see policy).
  int stream_forward_handoff;
  /// 0: fused rows off 16-byte boundaries by two kernels (policy).
  int shifted_rows;
  /// 0: whole-tile rows sweep every vector of the tile (policy).
  int trim_tiles;
  /// Rows up to this long (12 at most), a warp each; 0: none (policy).
  int warp_rows_kib;
  /// 0: unaligned short rows by the split pass (policy).
  int warp_rows_shifted;
  /// 0: unaligned short forwards/backwards streamed.
  int warp_rows_shifted_passes;
  /// Fused rows up to this long by two kernels; 0: none (policy).
  int split_fused_kib;
  /// 0: the bulk backward's grid as large as the SMs hold.
  int balanced_grid;
};

/// sm_90 (H100, H200): every value measured there (bench/cuda_variants.sh).
constexpr tuning sm90_row = {
    /*min_major=*/9,
    /*bulk_copy=*/true,
    /*clusters=*/true,
    /*dependent_launch=*/true,
    /*wgmma=*/true,
    /*warp_rows=*/true,
    /*min_blocks=*/0,
    /*overlap_rows=*/-1,
    /*block=*/256,
    /*stages=*/2,
    /*stats_unroll=*/2,
    /*split_barriers=*/1,
    /*chunk_kib=*/32,
    /*running_max=*/1,
    /*whole_rows=*/1,
    /*stream_backward=*/1,
    /*fold_scale=*/1,
    /*exp_once=*/1,
    /*stream_regs=*/4,
    /*small_regs=*/4,
    /*small_exp_once=*/1,
    /*small_ctas_per_sm=*/8,
    /*bulk_backward=*/1,
    /*bulk_backward_regs=*/2,
    /*bulk_backward_stages=*/8,
    /*bulk_backward_min_blocks=*/3,
    /*bulk_gradient=*/2,
    /*wide_rows=*/1,
    /*wide_from_kib=*/120,
    /*stream_forward=*/1,
    /*stream_forward_regs=*/4,
    /*stream_forward_min_blocks=*/8,
    /*stream_forward_block=*/128,
    /*stream_forward_wide_from_kib=*/128,
    /*stats_gemm=*/1,
    /*stats_gemm_cluster=*/2,
    /*stats_gemm_logits=*/0,
    /*scaled_probs=*/1,
    /*accumulate_by_lt=*/1,
    /*normalizer_ahead=*/1,
    /*row_queue=*/1,
    /*stream_forward_handoff=*/1,
    /*shifted_rows=*/1,
    /*trim_tiles=*/1,
    /*warp_rows_kib=*/12,
    /*warp_rows_shifted=*/1,
    /*warp_rows_shifted_passes=*/1,
    /*split_fused_kib=*/8,
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

#ifdef XENT_CUDA_TUNING_OVERRIDE
#include XENT_CUDA_TUNING_OVERRIDE
#else
namespace xent {
namespace cuda_detail {
/// The row this build's kernels are compiled with.
constexpr tuning tuned = sm90_row;
}  // namespace cuda_detail
}  // namespace xent
#endif

namespace xent {
namespace cuda_detail {

/// How a row kernel takes its rows: dealt out in turn (none), from the row queue in a kernel that
/// does nothing else (own_kernel), or from it in a branch of the kernel that also deals and
/// streams rows (branch; policy::queue_form).
enum class row_queue_form { none, own_kernel, branch };

/// Chosen on an H200 (bench/cuda_variants.sh; bf16 16384 x 128256 and 4096 x 262144, fp32 8192 x
/// 128256 and 32 x 32000). The figures of every version and alternative measured are in
/// docs/design.md. In short: 256 threads holding a 32 KiB chunk as eight 16-byte registers each,
/// two 32 KiB stages, three CTAs per SM (bf16 fused 2.81 ms at three, 2.95 at two); 512-thread CTAs
/// and three stages were slower.
struct policy {
  /// Threads per CTA.
  static constexpr int block = tuned.block;
  /// CTAs per SM the register budget is set for (__launch_bounds__): three (80 registers), but two
  /// (128) for the backward pass of 16-bit rows, which measured faster so (2.44 against 2.52 ms for
  /// bf16 16384 x 128256), for fused rows that keep their exponentials as floats (keep_exps: a
  /// 64-register tile; at three CTAs per SM bf16 16384 x 128256 took 3.66 ms against 2.51 at two,
  /// H200), and for plain fused aligned rows (`Two`), whose whole tiles and gradient stage are
  /// worth more than a third CTA: fp32 8192 x 128256 fused 2.355 ms before them at three, 2.596
  /// with whole tiles at three (172 bytes of spill), 2.270 at two, 2.181 at two with the gradient
  /// stage (H200).
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
  /// the gradient is due: bf16 16384 x 128256 fused 3.16 ms, against 3.37 ms with two
  /// __syncthreads per row. compute-sanitizer's racecheck does not model bar.arrive and reports
  /// barrier-separated accesses anywhere in such a kernel as hazards, so the sanitizer build of
  /// bench/gpu/run.sh checks the same protocol with full barriers (tuned.split_barriers=0).
  static constexpr bool split_barriers = tuned.split_barriers != 0;
  /// Whether a row's gradient waits until the next row's statistics are taken (hiding its cluster
  /// round trip) or is written first. Waiting holds the row's register tile across those sweeps:
  /// for fused 16-bit rows that is more than three CTAs per SM leave registers for (the tile
  /// spilled to local memory), so they finish a row first and keep three CTAs per SM. Checked
  /// again at f84c2e6 (H200, bf16 16384 x 128256 fused): 2.715 ms so, 3.00 ms waiting at three
  /// CTAs per SM (80 bytes of spill), 2.79 ms waiting at two (no spill).
  template <class T, bool Fused>
  static constexpr bool overlap_rows = tuned.overlap_rows >= 0 ? tuned.overlap_rows != 0
                                                               : sizeof(T) == 4 || !Fused;
  /// A forward pass over at least this many rows per CTA in flight gives each CTA whole rows,
  /// streamed through its stages chunk by chunk with an online LSE (0: never). No CTA then waits
  /// for another: a row cut over a cluster makes its CTAs meet once per row, and the forward has
  /// no gradient sweep to hide that round trip behind.
  static constexpr int whole_rows = tuned.whole_rows;
  /// Whether a streamed row's chunks after its first take their exponentials relative to the
  /// row's running max in one sweep (no max sweep; see chunk_stats).
  static constexpr bool running_max = tuned.running_max != 0;
  /// Whether backward from a saved LSE with class-id targets and 16-byte-aligned rows runs the
  /// streaming kernel (backward_kernel.cuh: each element read once from global memory into
  /// registers and its gradient stored, no shared-memory stage, no cluster) instead of the row
  /// kernel. H200, bf16 backward: 16384 x 128256 2.292 vs 2.419 ms (86.1 vs 81.6% of
  /// the copy roof), 4096 x 262144 1.179 vs 1.226 ms, 8192 x 32000 0.293 both (cuda-notes.md).
  static constexpr bool stream_backward = tuned.stream_backward != 0;
  /// Vectors per thread per tile of the streaming backward: 4 x 16 bytes x 256 threads = 16 KiB
  /// per CTA in flight, several CTAs per SM.
  static constexpr int stream_regs = tuned.stream_regs;
  /// Whether plain kernels with 16-bit gradients fold the row's scale into the exponent (2^(x log2e
  /// - shift + log2 |scale|), the sign xored onto the rounded pairs) instead of a multiply per
  /// element. H200: bf16 fused 16384 x 128256 2.711 -> 2.567 ms (73.0 -> 77.2% of the copy roof),
  /// 4096 x 262144 1.461 -> 1.382 ms, 8192 x 32000 331 -> 318 us; backward unchanged (bound by
  /// memory). A partial last vector stored through a function that is not inlined, measured in the,
  /// was slower everywhere (fp32 fused 2.35 -> 3.09 ms).
  static constexpr bool fold_scale = tuned.fold_scale != 0;
  /// Whether plain fused 16-bit rows keep each element's exponential from the statistics (as a
  /// float, exp_tile) and form the gradient with a multiply: one exponential per element in the
  /// pass instead of two (the special-function unit does 16 per SM per cycle: 2 x 2.1e9 of them
  /// for bf16 16384 x 128256 take 1.0 ms of the pass), and one load of the chunk from shared
  /// memory fewer. The float tile is 64 registers, so these kernels are bounded for two CTAs per
  /// SM (min_blocks). H200 (bench/cuda_variants.sh): bf16 fused 16384 x
  /// 128256 2.569 -> 2.510 ms, 4096 x 262144 1.384 -> 1.363 ms, 8192 x 32000 318 -> 308 us.
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
  /// gradient (a multiply per element instead of a second exponential). H200, three
  /// rounds: fused mean 128 x 32000 15.7 -> 15.45
  /// us, 32 x 32000 8.85 -> 8.73, 32 x 50257 9.93-10.01 -> 9.88-9.97.
  static constexpr bool small_exp_once = tuned.small_exp_once != 0;
  /// Whether forward calls with plain class-id rows, 16-byte aligned, run the streaming forward
  /// kernel (forward_kernel.cuh: whole rows per CTA, tiles of stream_forward_regs vectors per
  /// thread straight from global memory, stream_forward_min_blocks CTAs per SM) when the batch
  /// gives each CTA in flight a row. H200, against the row kernel's whole-row forward
  /// (shared-memory stages, three CTAs per SM): bf16 8192 x 32000 176 -> 153 us
  /// (70.6 -> 81.1% of the copy roof), 16384 x 128256 1.061 -> 0.964 ms, 4096 x 262144 0.528 ->
  /// 0.499 ms, fp32 8192 x 128256 0.954 -> 0.933 ms. Eight vectors per thread at three CTAs per
  /// SM: 159 us, 0.954, 0.488, 0.928 ms. CTAs of 128 threads, eight per SM (256 x 4 for the
  /// wide rows below), against 256 x 4 (512 x 2): H200, two rounds, read
  /// flush: bf16 65536 x
  /// 3008 (6 KiB rows) 331-332 -> 181 us, 8192 x 32000 134 -> 132, 8192 x 50304 207 -> 203, 8192
  /// x 50257 224-225 -> 219-220, 16384 x 128256 962-963 -> 953, fp32 8192 x 128256 928 -> 935.
  /// CTAs of 64 x 16 and 32 x 32: slower on every line but the 6 KiB rows (200, 193 us).
  static constexpr bool stream_forward = tuned.stream_forward != 0;
  static constexpr int stream_forward_regs = tuned.stream_forward_regs;
  static constexpr int stream_forward_min_blocks = tuned.stream_forward_min_blocks;
  static constexpr int stream_forward_block = tuned.stream_forward_block;
  /// Rows longer than stream_forward_wide_from_kib KiB take CTAs of twice the threads at half the
  /// CTAs per SM (the same registers per thread, tiles twice as long). H200, 256 x 4 against 512 x
  /// 2 (and 128 x 8): bf16 16384 x 128256 1013 -> 994 us (1020), 4096 x 262144 538 -> 529 (540),
  /// fp32 8192 x 128256 993 -> 969 (999), but 8192 x 32000 (64 KiB rows) 146 -> 155 (150; not
  /// profiled: a short row then has fewer, longer tiles, more of it in the masked last one, and
  /// half as many rows in flight per SM). Measured again: 1013 -> 994 us, 538 -> 529, 993 -> 970,
  /// 146 -> 146 (its rows stay on 256 threads).
  static constexpr int stream_forward_wide_from_kib = tuned.stream_forward_wide_from_kib;
  /// Whether the streaming forward hands each row's warp parts to warp 0 by named barriers (warps
  /// 1.. go on to the next row) rather than a CTA barrier, where every warp waited for the
  /// slowest warp's last tile of the row (split_barriers as well). H200,
  /// bf16 forward 8192 x 32000: 149 -> 148 us, 153 -> 151 with the balanced grid below; the
  /// longer rows unchanged (16384 x 128256 1.008-1.023 ms both ways). Asking L2 for the tiles
  /// ahead (prefetch.global.L2, one line per thread) made it slower at every distance measured:
  /// 148 us without, 156 one tile ahead, 158 two, 167 four, 215 eight.
  static constexpr bool stream_forward_handoff = tuned.stream_forward_handoff != 0;
  /// Whether the fused linear forward takes the Hopper GEMM that keeps each row's statistics in its
  /// epilogue (stats_gemm.cuh; sm_90a builds, bf16, plain options) rather than cuBLAS and the
  /// cross-entropy pass over each chunk's logits. H200, linear_forward against cuBLAS's X. W^T
  /// alone in the same run (xent_bench_cuda_linear, f6d4e74): 8192 x 4096 x 128256 0.980x, 16384 x
  /// 2304 x 256000 1.015x, where the cuBLAS path measured 1.08x and 1.21x (9b4cb64).
  static constexpr bool stats_gemm = tuned.stats_gemm != 0;
  /// CTAs per cluster of that GEMM: two on neighbouring row tiles, each loading half of every W
  /// tile into both by a multicast copy (stats_gemm.cuh), halve the L2-to-shared traffic of W.
  /// H100, xent_bench_cuda_linear built both ways, two rounds each, linear_forward at the default
  /// budget against X. W^T alone: 8192 x 4096 x 128256 12.5 / 12.6 -> 11.6 / 11.6 ms (1.022 /
  /// 1.069x -> 0.958 / 0.947x), 16384 x 2304 x 256000 31.1 / 31.3 -> 27.0 / 26.7 ms (1.013 / 1.003x
  /// -> 0.862 / 0.871x); bench/lse_gemm_bench.cu, both in one binary, the GEMM and merge 1.079x /
  /// 1.311x -> 0.982x / 0.883x of cuBLAS. On an H200 an earlier form of the kernel measured pairs
  /// slower at 8192 x 4096 x 128256 (12.14 -> 12.42 / 12.61 ms) and faster at the larger head (30.3
  /// -> 29.2 / 29.5): not measured there since.
  static constexpr int stats_gemm_cluster = tuned.stats_gemm_cluster;
  static_assert(stats_gemm_cluster == 1 || stats_gemm_cluster == 2, "the stats GEMM's forms");
  /// Whether fused linear training and backward form each chunk's logits by that GEMM's
  /// logits-storing form (stats_gemm.cuh; bf16, no bias, D a multiple of 8, 16-byte aligned
  /// operands, sm_90a) rather than cublasGemmEx, where scaled_probs below does not apply. That form
  /// measured 1.012x / 0.935x of cublasGemmEx in pairs (H100, bench/lse_gemm_bench.cu, 8192 x 4096
  /// x 128256 / 16384 x 2304 x 256000), but in training (H100, with / without, two rounds, the
  /// scaled path not yet built) 38.8 / 38.2 vs 38.6 / 38.6 ms and 91.3 / 91.5 vs 92.3 / 91.9 ms:
  /// within the runs' spread. The linear tests pass with it. Off.
  static constexpr bool stats_gemm_logits = tuned.stats_gemm_logits != 0;
  /// Whether fused linear training (bf16, class ids without smoothing or softcap, no bias, no
  /// argmax asked; D a multiple of 8, sm_90a) stores each chunk's scaled probabilities from that
  /// GEMM and takes the row scales into the backward GEMMs, so no cross-entropy pass runs
  /// (scaled_probs.cuh). Every bf16 training plan has room for its buffers while this is on. H200,
  /// xent_bench_cuda_linear built both ways, two rounds, medians against the three GEMMs alone:
  /// 8192 x 4096 x 128256 38.9 / 38.7 -> 38.4 / 38.4 ms (1.021 / 1.034x -> 1.004 / 1.016x), 16384 x
  /// 2304 x 256000 93.6 / 93.5 -> 88.8 / 88.8 ms (1.070 / 1.063x -> 1.014 / 1.026x), with one 6 GiB
  /// chunk 1.048 / 1.046x -> 1.009 / 1.006x.
  static constexpr bool scaled_probs = tuned.scaled_probs != 0;
  /// Whether fused linear training adds each chunk's d_weight into the float accumulator through
  /// cuBLASLt with the tile accumulate_gemm.cuh chooses (where it offers one) rather than
  /// cublasGemmEx's own choice; that header has the GEMM's measurements.
  static constexpr bool accumulate_by_lt = tuned.accumulate_by_lt != 0;
  /// Whether the row kernel's mean normaliser (fused and backward passes) is summed by one CTA of
  /// a kernel launched ahead of it, the row kernel its programmatic dependant, rather than by
  /// every CTA of the row kernel at its start. H200, three rounds each way: bf16 8192
  /// x 32000 fused with a mean 284 -> 281 us (the sum's time; 87.2 -> 89.0% of the copy roof),
  /// every other line unchanged. The CUDA tests
  /// (stream capture among them: a programmatic dependency in a graph) and the linear tests pass
  /// with it (H200).
  static constexpr bool normalizer_ahead = tuned.normalizer_ahead != 0;
  /// Whether the resident row kernel (bulk copies, forward or fused, a workspace given, rows on
  /// 16-byte boundaries) takes rows from a queue (row_queue.cuh) rather than each cluster a fixed
  /// share. H200, fused, two rounds each against the same tree without it : bf16 8192 x 32000 280.5
  /// -> 267.2 us, 8192 x 65536 559 -> 519, 8192 x 49152 436 -> 418, 16384 x 128256 2115 -> 2090,
  /// 4096 x 262144 1084 -> 1068, fp32 8192 x 32000 537 -> 511, 8192 x 128256 2134 -> 2058; but bf16
  /// 8192 x 20480 194.5 -> 207.3 and 8192 x 50304 452 -> 472, and these stayed so with the queue
  /// compiled in but not taken: the code, not the queue, cost there (queue_form took most of that
  /// back: 193 dealt against 198 queued). Rows off 16-byte boundaries (Shifted) are dealt: with the
  /// queue bf16 8192 x 50257 went 482.5 -> 499, and again 479 -> 495 as a kernel of its own (fp32
  /// 982 -> 971.5).
  static constexpr bool row_queue = tuned.row_queue != 0;
  /// How the row kernel's queued rows are compiled (row_queue_form): in a kernel of their own
  /// (resident rows alone, every queue test resolved at compile time), or as a branch of the kernel
  /// that also deals rows and streams long ones. The branch's extra code cost the default shape and
  /// fp32 (H200, three rounds, bf16 fused 8192 x 32000 266 -> 260.5 us, 8192 x 20480 207 -> 198,
  /// 8192 x 50304 470 -> 454, fp32 8192 x 128256 2061 -> 2051), but scheduled the wide 16-bit
  /// kernel better (bf16 16384 x 128256 2082 against 2125 us, 4096 x 262144 1066 against 1085; 128
  /// registers both, the branch's with a 16-byte stack frame: not understood beyond that), so those
  /// keep it.
  template <class T, int Block>
  static constexpr row_queue_form queue_form = sizeof(T) == 2 && Block > block
                                                   ? row_queue_form::branch
                                                   : row_queue_form::own_kernel;
  /// Whether the bulk backward's persistent grid takes as few CTAs as walk the same most tiles
  /// each (persistent_grid) rather than as many as the SMs hold. H200, bf16
  /// backward 8192 x 32000: 278 -> 275 us (two runs each; 16384 x 128256 and 4096 x 262144
  /// unchanged). The same cut of the streaming forward's rows (8192 over 512 CTAs, not 528) made
  /// it slower, 148 -> 151 us: there the rows each SM walks set the time (its CTAs share its
  /// load slots), and 512 CTAs put 64 rows on some SMs where 528 put at most 63. The row kernel's
  /// clusters: no change (bf16 fused 8192 x 32000 283 -> 284 us).
  static constexpr bool balanced_grid = tuned.balanced_grid != 0;
  /// Whether plain fused rows that do not start on 16-byte boundaries, whose gradient rows have the
  /// same boundaries (in place, say), on sm_90, take the row kernel cut at each row's own
  /// boundaries (row_kernel's Shifted: one read and one write of the logits, resident rows up to
  /// 512 KiB) rather than the streaming forward and then the bulk backward from the LSE it wrote
  /// (two reads and a write). H200, bf16 fused in place: 8192 x 50257 (GPT-2's vocabulary) 664 us
  /// by the two kernels, 592 by the row kernel with masked sweeps, 510 with whole-tile sweeps
  /// (row_kernel: the threads past the row's end reset the stage to -inf after each copy); 256 x
  /// 50257 37.3 / 32.4 / 29.0 us; fp32 8192 x 50257 1231 / 1158 / 975 us.
  static constexpr bool shifted_rows = tuned.shifted_rows != 0;
  /// Whether the row kernel's whole-tile rows (plain fused resident rows; CTAs of the default
  /// shape) whose slices fill at most regs - 2 or regs - 1 of each thread's vectors sweep only
  /// those: the sweeps past a slice take exponentials of -inf, and the rows of 40 KiB (two CTAs
  /// of 20 of the 32 KiB) or of GPT-2's 50257 classes (four of 24.5) are partly bound by them.
  /// H200, two rounds, bf16 fused, whole tiles -> trimmed: 8192 x 20480
  /// 225 -> 196 us (70 -> 81% of the roof), 8192 x 50257 509 -> 477-478 (76 -> 81%), 8192 x
  /// 50304 479-480 -> 466, 16384 x 12032 220 -> 217-218, fp32 8192 x 50257 973-974 -> 953-955;
  /// the full-tile lines unchanged. Each trim alone first: regs - 1 in the wide shape as well
  /// made 16384 x 128256 2109 -> 2127-2129 us (the wide kernel's code; it never took the trimmed
  /// path), so the wide shape keeps its whole tiles.
  static constexpr bool trim_tiles = tuned.trim_tiles != 0;
  /// Plain fused rows of at most split_fused_kib KiB in a batch long enough for the streaming
  /// forward (aligned, or cut at their own boundaries where the gradient's share them) run it and
  /// then the bulk backward from the LSE it wrote (launch_split_fused), rather than the row kernel:
  /// short rows fill a sliver of its 32 KiB tiles and each CTA holds two in flight. H200, two
  /// rounds, bf16 fused in place, row kernel -> two kernels : 65536 x 3008 (6 KiB rows) 746-747 ->
  /// 446 us, 65536 x 3001 898 -> 680, 32768 x 6016 (12 KiB) 389 -> 385, 16384 x 12032 (24 KiB) 220
  /// -> 317, 8192 x 20480 225 -> 263-264, 8192 x 32000 277 -> 400, fp32 8192 x 16384 282 ->
  /// 395-396: the line lies near 8 KiB. Behind the warp-rows kernel (warp_rows_kib) it takes the
  /// rows that one does not, those off 16-byte boundaries: H200, three rounds, 65536 x 3001 897-898
  /// -> 680-682 us.
  static constexpr int split_fused_kib = tuned.split_fused_kib;
  /// Plain class-id rows, 16-byte aligned, of at most warp_rows_kib KiB (a warp's tile holds 6 at
  /// warp_rows_regs 16-byte vectors per lane, 12 in the long form below), every pass, take the
  /// warp-rows kernel: a warp per row, held in its registers from the load to the gradient's store,
  /// every warp of an SM with a row in flight, where the row kernel holds two per CTA in 32 KiB
  /// tiles (bf16 65536 x 3008 fused 747 us, 25% of the roof) and the streaming forward one per
  /// 128-thread CTA (181 us, 51%). Taken before split_fused_kib. H200, three rounds, off -> 6: bf16
  /// 65536 x 3008 fused 746 -> 238-239 us (78% of the roof; the split kernels 445-446), forward 181
  /// -> 144 (65%); 12 KiB rows and longer unchanged (the short form's). 12 vectors: at 16 (8 KiB)
  /// the 16-bit fused kernels spilled 144 bytes at their 128 registers (ptxas, sm_90), at 12 none
  /// but a float gradient of bf16 logits (12 bytes). Backward calls from the saved LSE too (two
  /// rounds): 65536 x 3008 282-283 -> 245-246 us (66 -> 76%; the bulk backward before).
  static constexpr int warp_rows_kib = tuned.warp_rows_kib;
  static constexpr int warp_rows_regs = 12;
  static constexpr int warp_rows_min_blocks = 2;  // at most 128 registers per thread
  /// The forward holds no gradient: three CTAs per SM, though ptxas (sm_90) then spills 176
  /// bytes of the bf16 instantiation at its 80 registers. H200, two
  /// rounds, bf16 65536 x 3008 forward at 2 / 3 / 4 CTAs per SM: 144 / 134 / 161 us (64 / 69 /
  /// 58% of the roof).
  static constexpr int warp_rows_forward_min_blocks = 3;
  /// Fused rows of 6 to 12 KiB (warp_rows_kib above 6) take the warp-rows kernel with twice the
  /// vectors per lane at one CTA per SM (ptxas: 238-255 registers, no spill): eight rows in
  /// flight per SM, the bytes of the short form's sixteen. H200, two
  /// rounds each: bf16 32768 x 6016 fused 389 (the row kernel) -> 274-276 us (48 -> 67% of the
  /// roof). Not for 6 KiB rows (239 -> 425 us: half the bytes in flight) nor for forwards (32768 x
  /// 6016 141 -> 222: the streaming forward's 128-thread CTAs keep more rows in flight).
  /// Whether fused rows off 16-byte boundaries whose gradient rows share them, short enough for
  /// the short form with their lead, take the warp-rows kernel cut at each row's own boundaries
  /// (the streaming kernels' lead) before the split pass. H200, two
  /// rounds: bf16 65536 x 3001 fused 681 -> 349 us (27 -> 53% of the roof; the row's first and
  /// last vectors go element by element), every other line unchanged.
  static constexpr bool warp_rows_shifted = tuned.warp_rows_shifted != 0;
  /// Whether forwards of short rows off 16-byte boundaries, and backwards whose gradient rows share
  /// those boundaries, take the same cut form of the warp-rows kernel (the short form) instead of
  /// the streaming kernels' shifted forms. H100, off / on (a build each, bench/cuda_variants.sh):
  /// bf16 65536 x 3001 forward 288 -> 160 us (45 -> 81% of the roof), backward 424 -> 325 us (62 ->
  /// 80%); the fused line (408 us), the aligned 65536 x 3008 and 32768 x 6016 lines and every 8192
  /// x 32000 line unchanged within 1%.
  static constexpr bool warp_rows_shifted_passes = tuned.warp_rows_shifted_passes != 0;
  static constexpr int warp_rows_long_regs = 24;
  static constexpr int warp_rows_long_min_blocks = 1;
  /// Whether backward calls with plain class-id rows, 16-byte aligned, on sm_90, move the
  /// streaming backward's tiles by bulk copies both ways (bulk_backward_kernel: a tile staged in
  /// one of bulk_backward_stages shared-memory stages, its gradient written back over it and
  /// stored by one bulk copy), bulk_backward_min_blocks CTAs per SM. Register loads and stores
  /// stop at 85-86% of the copy roof on an H200 (BM_copy_kernel), which is where the streaming
  /// backward was. H200, bf16 backward 8192 x 32000 / 16384 x 128256 /
  /// 4096 x 262144: streaming 296 us / 2.307 / 1.192 ms (84.0 / 86.5 / 85.5% of the roof); bulk
  /// with 3 stages of 16 KiB at four CTAs per SM 293 / 2.291 / 1.170; 2 stages 294 / 2.296 /
  /// 1.170; 4 stages at three CTAs per SM 279 us / 2.197 / 1.110 ms (88.8 / 90.5 / 91.5%).
  /// Tiles of bulk_backward_regs vectors per thread: H200, two runs each
  /// (with the balanced grid), 16 KiB tiles x 4 stages 275 us / 2.185 / 1.099 ms; 8 KiB x 8
  /// stages 271-272 us / 2.106-2.122 / 1.104 ms; 12 KiB x 6 stages 312 us / 2.286 / 1.167; 16
  /// KiB x 3 stages at four CTAs per SM 291 us / 2.274 / 1.160. The same bytes in flight in
  /// smaller tiles (not profiled: a CTA's first tile lands sooner, its gradient leaves sooner).
  static constexpr bool bulk_backward = tuned.bulk_backward != 0;
  static constexpr int bulk_backward_regs = tuned.bulk_backward_regs;
  static constexpr int bulk_backward_stages = tuned.bulk_backward_stages;
  static constexpr int bulk_backward_min_blocks = tuned.bulk_backward_min_blocks;
  /// Whether plain fused resident rows on sm_90 write their gradient into a shared-memory stage
  /// of its own (one chunk more per CTA) and store it by one bulk copy, instead of 16-byte
  /// stores from registers, which stop at 85-86% of the copy roof (BM_copy_kernel). 2: every
  /// such row whose gradient has the logits' type (two CTAs per SM: min_blocks); 1: only the
  /// 16-bit rows that keep their exponentials; 0: never. H200, bf16 fused
  /// 8192 x 32000 / 16384 x 128256 / 4096 x 262144: register stores 308 us / 2.512 / 1.364 ms,
  /// the gradient stage 304 / 2.477 / 1.339. It also lets the 16-bit rows sweep whole tiles
  /// (whole_extent): 285 us / 2.206 / 1.153 ms, a third fewer instructions per row (ncu: 1010 per
  /// warp and row, 40% of them tests, branches and address arithmetic around the element work).
  /// fp32 8192 x 128256: 2.355 ms with register stores and three CTAs per SM, 2.720 with the
  /// stage at two before whole tiles, 2.181 (90.5%) with both (see min_blocks).
  template <class T, class G, bool Plain, bool Fused>
  static constexpr bool bulk_gradient = (Plain && Fused) && sizeof(T) == sizeof(G) &&
                                        (tuned.bulk_gradient >= 2 ||
                                         (tuned.bulk_gradient == 1 && keep_exps<T, Plain, Fused>));
  /// Whether plain fused aligned rows on sm_90 longer than wide_from_bytes and at most
  /// cluster_max wide chunks take the wide shape (wide_shape: CTAs of twice the threads, each
  /// holding a chunk twice as large, one CTA per SM at the same registers per thread): half the
  /// CTAs per row, so clusters of 16 become 8, which pack where the GPCs fit 14 of 16 at two CTAs
  /// per SM (224 of 264 CTA slots), and rows up to 1 MiB are held on chip where the default shape
  /// streams them through twice. H200, bf16 fused 4096 x 262144: 1.162 -> 1.088 ms
  /// (87.5 -> 93.3% of the copy roof; the shape applied to every kernel by bench/cuda_variants.sh
  /// made the others slower, so it is chosen here alone); from 256 KiB, fp32 8192 x 128256 2.190
  /// -> 2.091 ms; from 128 KiB, bf16 16384 x 128256 (clusters of 4 where they were 8) 2.198 ->
  /// 2.113 ms (90.2 -> 93.5%). From 32 KiB, bf16 8192 x 32000 (one wide CTA per row) went 284 ->
  /// 281 us, too little to take it there unmeasured elsewhere. From 120 KiB (H200,
  /// two rounds): rows of 125
  /// and 128 KiB, fp32 8192 x 32000 547 -> 534 us (90.8-91.3 -> 92.8-93.0%), bf16 8192 x 65536
  /// 567-569 -> 556-557 us; from 32 KiB (one round) 8192 x 20480 and 8192 x 49152 ran 195 -> 214
  /// and 429 -> 472 us, so shorter rows keep the default shape.
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
