// The dispatch of the cross-entropy entry points: checks that need the device, the choice of
// kernel, its launch plan and the launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../../error.hpp"
#include "../../loss_math.hpp"
#include "../../options.hpp"
#include "../../targets.hpp"
#include "../../views.hpp"
#include "../block/dtype.cuh"
#include "../cuda.cuh"
#include "../kernels/backward_kernel.cuh"
#include "../kernels/forward_kernel.cuh"
#include "../kernels/normalizer_kernel.cuh"
#include "../kernels/row_kernel.cuh"
#include "../kernels/small_rows_kernel.cuh"
#include "../kernels/warp_rows_kernel.cuh"
#include "../runtime.cuh"
#include "../tuning/policy.cuh"
#include "launch.cuh"
#include "plan.cuh"

namespace xent {
namespace cuda_detail {

template <class I>
class_ids<I> device_targets(const vector_view<const I>& t) {
  return {t.data};
}
template <class S>
soft_probs<device_t<S>> device_targets(const soft_targets<S>& t) {
  return {reinterpret_cast<const device_t<S>*>(t.probs.data), t.probs.ld};
}

/// Shared-memory stages of the row kernel at most: the logits stages, and a gradient stage after
/// them where its rows store their gradient by bulk copy (policy::bulk_gradient).
template <bool Aligned, bool Plain, pass P, class T, class G>
constexpr int row_kernel_stages() {
  return policy::stages + (Aligned && policy::bulk_gradient<T, G, Plain, P == pass::fused> ? 1 : 0);
}

/// The row kernel of one CTA shape (row_shape); `Shifted`: rows cut at their own boundaries;
/// `Queue`: how it takes its rows (row_queue_form).
template <class Shape, bool Aligned, bool Plain, pass P, class T, class G, class Tgt,
          bool Shifted = false, row_queue_form Queue = row_queue_form::none>
constexpr auto row_kernel_of = row_kernel<Shape::block, Shape::regs, policy::stages, Aligned, Plain,
                                          P, T, G, Tgt, Shifted, Queue>;

/// Prepares `kernel`, a row kernel of that shape (prepare_cluster_kernel), for the shared memory
/// its stages take. The caller passes the address it launches: each translation unit has its own
/// host stub, and so its own copy, of a kernel template (stats_gemm.cuh's launch says why).
template <class Shape, bool Aligned, bool Plain, pass P, class T, class G>
bool prepare_kernel_attributes(const void* kernel, int device) {
  return prepare_cluster_kernel(
      kernel, device,
      static_cast<int>(row_kernel_stages<Aligned, Plain, P, T, G>() * Shape::chunk_bytes));
}

/// The mean's normaliser by one CTA ahead (normalizer_kernel) of a launch of class-id rows
/// (`cfg`, sm_90, with room for one more attribute), made its programmatic dependant: it starts at
/// once and waits for W where it needs it (normalizer_from_ahead). Only where the call reduces by
/// the mean into a workspace over its whole vocabulary; sets args.normalizer_ahead.
template <class T, class G, class Tgt>
void launch_normalizer_ahead(const char* fn, const cuda& exec, row_args<T, G, Tgt>& args,
                             cudaLaunchConfig_t& cfg) {
  if (!policy::normalizer_ahead || args.reduce != reduction::mean || !args.workspace ||
      args.first != 0)
    return;
  constexpr int block = 1024;
  normalizer_kernel<block><<<1, block, 0, exec.stream>>>(
      args.targets, args.rows, args.vocab, args.ignore_index, args.weights, args.workspace);
  check_cuda(fn, cudaGetLastError());
  args.normalizer_ahead = true;
  cudaLaunchAttribute& attr = cfg.attrs[cfg.numAttrs++];
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
}

/// The row kernel over every row; false, launching nothing, for `Shifted` rows (policy::
/// shifted_rows) where its code has no clusters, a row is longer than a cluster holds, or the
/// gradient does not leave by bulk copy (policy::bulk_gradient: the kernel is empty there).
template <bool Aligned, bool Plain, pass P, class T, class G, class Tgt,
          class Shape = default_shape, bool Shifted = false>
bool launch_rows(const char* fn, const cuda& exec, row_args<T, G, Tgt> args,
                 const device_facts& dev) {
  if constexpr (Shifted && !policy::bulk_gradient<T, G, Plain, P == pass::fused>) return false;
  auto kernel = row_kernel_of<Shape, Aligned, Plain, P, T, G, Tgt, Shifted>;
  const bool clusters = prepare_kernel_attributes<Shape, Aligned, Plain, P, T, G>(
                            reinterpret_cast<const void*>(kernel), dev.id) &&
                        tuning_for(dev.major).clusters;
  if (Shifted && !clusters) return false;
  const bool whole_rows =
      P == pass::forward && policy::whole_rows > 0 &&
      args.rows >= std::int64_t{policy::whole_rows} * dev.sms * policy::min_blocks<T, false>();
  // Shifted rows are cut at their own 16-byte boundaries: room for vec - 1 more classes.
  const std::int64_t room = Shifted ? 16 / std::int64_t{sizeof(T)} - 1 : 0;
  const launch_plan plan =
      make_launch_plan(args.rows, args.cols + room, sizeof(T), dev.sms,
                       clusters && !whole_rows ? policy::cluster_max : 1, Shape::chunk_bytes);
  if (Shifted && plan.chunks != 1) return false;
  args.cluster = plan.cluster;
  args.slice = plan.slice;
  // Resident rows staged by bulk copies (sm_90, aligned, forward or fused) take them from the
  // row queue (policy::row_queue), whose counter is in the workspace, where the call gave one.
  constexpr row_queue_form form = policy::row_queue && Aligned && P != pass::backward && !Shifted
                                      ? policy::queue_form<T, Shape::block>
                                      : row_queue_form::none;
  const auto queue_kernel = row_kernel_of<Shape, Aligned, Plain, P, T, G, Tgt, false, form>;
  const bool queued = form != row_queue_form::none && clusters && plan.chunks == 1 &&
                      exec.workspace && exec.workspace_bytes >= cuda_workspace_size(args.rows) &&
                      prepare_kernel_attributes<Shape, Aligned, Plain, P, T, G>(
                          reinterpret_cast<const void*>(queue_kernel), dev.id);
  if (queued) {
    args.queue = &static_cast<workspace_header*>(exec.workspace)->rows_taken;
    kernel = queue_kernel;
  }
  args.chunk = plan.chunk;
  args.chunks = plan.chunks;
  args.chunk_bytes = plan.chunk_bytes;
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(Shape::block, 1, 1);
  cfg.dynamicSmemBytes = plan.smem_bytes;
  // Plain fused resident rows staged by bulk copies (sm_90) take stages of a whole register tile
  // each, whose tails the kernel fills once (whole_extent), and, where they store their gradient
  // by bulk copy (policy::bulk_gradient), a gradient stage after them.
  if (Aligned && Plain && P == pass::fused && tuning_for(dev.major).bulk_copy && plan.chunks == 1) {
    args.chunk_bytes = Shape::chunk_bytes;
    cfg.dynamicSmemBytes = row_kernel_stages<Aligned, Plain, P, T, G>() * Shape::chunk_bytes;
  }
  cfg.stream = exec.stream;
  static const bool log = std::getenv("XENT_CUDA_LOG") != nullptr;  // read once
  cudaLaunchAttribute attr[2] = {cluster_attribute(plan.cluster)};
  cfg.attrs = attr;
  cfg.numAttrs = plan.cluster > 1 ? 1 : 0;
  if constexpr (P != pass::forward && !Tgt::soft) {
    if (clusters) launch_normalizer_ahead(fn, exec, args, cfg);
  }
  // Persistent clusters: as many as fit at once, each walking its share of the rows.
  cfg.gridDim = dim3(static_cast<unsigned>(plan.cluster), 1, 1);
  const int active =
      active_clusters(fn, reinterpret_cast<const void*>(kernel), Shape::block, cfg, dev);
  const std::int64_t grid_rows = args.rows < active ? args.rows : (active > 0 ? active : 1);
  cfg.gridDim = dim3(static_cast<unsigned>(plan.cluster), static_cast<unsigned>(grid_rows), 1);
  if (log)
    std::fprintf(stderr,
                 "%s: %lld x %lld, aligned %d, plain %d, shifted %d, queued %d: cluster %d, "
                 "slice %lld, chunk %lld x %lld, smem %zu, grid %lld (active %d)\n",
                 fn, static_cast<long long>(args.rows), static_cast<long long>(args.cols),
                 static_cast<int>(Aligned), static_cast<int>(Plain), static_cast<int>(Shifted),
                 static_cast<int>(queued), plan.cluster, static_cast<long long>(plan.slice),
                 static_cast<long long>(plan.chunk), static_cast<long long>(plan.chunks),
                 cfg.dynamicSmemBytes, static_cast<long long>(grid_rows), active);
  check_cuda(fn, cudaLaunchKernelEx(&cfg, kernel, args));
  return true;
}

/// Whether a call's rows take the plain kernels: class ids with no option path (soft targets never
/// do; the argmax is one, so asking for it sums the loss in another order, float32 rounding apart,
/// docs/numerics.md, rather than giving each plain kernel an argmax sweep and merge).
template <class T, class G, class Tgt>
bool plain_rows(const row_args<T, G, Tgt>& a) {
  return !Tgt::soft && a.k.smooth == 0.0f && a.k.softcap == 0.0f && !a.want_argmax;
}

/// Plain rows of an unsharded call (no vocab-parallel partials): the kernels that specialise the
/// row kernel's work take only those.
template <class T, class G, class Tgt>
bool own_plain_rows(const row_args<T, G, Tgt>& a) {
  return plain_rows(a) && a.first == 0 && a.records.block == nullptr;
}

/// A small batch by the small-batch kernel (one cluster per row), its plan from make_small_plan:
/// for the device and the call's sizes, or, where the logits' extents `E` are both static, fixed
/// at compile time (fixed_plan_sms), the forward's kernel built on those constants (fixed_sizes).
/// The fused pass keeps the call's sizes under the fixed plan: with constants it ran 0.5% faster
/// to 6.5% slower on the fp32 seed shapes (H100), the forward 4.0-4.8% faster. False, launching
/// nothing, where the batch is not small or the kernel's code has no clusters.
template <row_start Start, pass P, class E, class T, class G, class Tgt>
bool launch_small_rows(const char* fn, const cuda& exec, row_args<T, G, Tgt> args,
                       const device_facts& dev) {
  // Rows cut at their own 16-byte boundaries: room for vec - 1 more classes.
  constexpr std::int64_t room = Start == row_start::shifted ? 16 / std::int64_t{sizeof(T)} - 1 : 0;
  constexpr bool fixed = E::rows != dynamic && E::cols != dynamic;
  constexpr launch_plan fixed_plan =
      fixed ? make_small_plan(E::rows, E::cols + room, sizeof(T), fixed_plan_sms) : launch_plan{};
  if constexpr (fixed && fixed_plan.cluster <= 0) {
    return false;  // never a small batch: no kernel is built for it
  } else {
    const launch_plan plan =
        fixed ? fixed_plan : make_small_plan(args.rows, args.cols + room, sizeof(T), dev.sms);
    if (plan.cluster <= 0) return false;
    using sizes =
        std::conditional_t<fixed && P == pass::forward,
                           fixed_sizes<E::rows, E::cols, fixed_plan.cluster, fixed_plan.slice>,
                           call_sizes>;
    auto kernel = small_rows_kernel<policy::block, policy::small_regs, Start, P, T, G, Tgt, sizes>;
    if (!prepare_cluster_kernel(reinterpret_cast<const void*>(kernel), dev.id, 0)) return false;
    args.cluster = plan.cluster;
    args.slice = plan.slice;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(plan.cluster), static_cast<unsigned>(args.rows), 1);
    cfg.blockDim = dim3(policy::block, 1, 1);
    cfg.stream = exec.stream;
    cudaLaunchAttribute attr[1] = {cluster_attribute(plan.cluster)};
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    check_cuda(fn, cudaLaunchKernelEx(&cfg, kernel, args));
    return true;
  }
}

/// A batch too short for the row kernel's pipelined clusters, by the small-batch kernel; false,
/// launching nothing, where it does not take the call. Forward and fused calls of a shape take
/// the same kernel, so their losses are the same bits, except a fused call whose gradient rows do
/// not share the logits' 16-byte boundaries: rows that are not 16-byte aligned are cut at those
/// boundaries (row_start::shifted), or where the gradient has others, loaded and stored element
/// by element (row_start::any, on the call's sizes only; fp32 32 x 50257 on an H200: fused 23.5
/// against the row kernel's 29.2 us, forward 21.6 against 19.1). `E`: the logits' extents.
template <pass P, class E = dynamic_extents, class T, class G, class Tgt>
bool try_small_rows(const char* fn, const cuda& exec, const row_args<T, G, Tgt>& args, bool aligned,
                    bool shifted, const device_facts& dev) {
  if constexpr (P == pass::backward || Tgt::soft) {
    return false;
  } else {
    if (!own_plain_rows(args) || !tuning_for(dev.major).clusters || args.rows > 65535) return false;
    if (aligned) return launch_small_rows<row_start::aligned, P, E>(fn, exec, args, dev);
    if (shifted) return launch_small_rows<row_start::shifted, P, E>(fn, exec, args, dev);
    if constexpr (E::rows != dynamic && E::cols != dynamic)
      return false;  // the call's sizes (dispatch_rows) serve it
    else
      return launch_small_rows<row_start::any, P, E>(fn, exec, args, dev);
  }
}

/// Plain class-id rows, 16-byte aligned, of at most policy::warp_rows_kib KiB, a warp per row
/// (warp_rows_kernel): persistent CTAs, as many as the rows need up to MinBlocks per SM, each lane
/// holding Regs vectors of its warp's row. False, launching nothing, for rows longer than that
/// tile or below sm_90 (the normaliser ahead needs it; the kernel itself would run anywhere).
template <int Regs, int MinBlocks, pass P, bool Shifted, class T, class G, class Tgt>
bool launch_warp_rows_as(const char* fn, const cuda& exec, row_args<T, G, Tgt> args,
                         const device_facts& dev) {
  constexpr int block = policy::block;
  constexpr std::int64_t vec = 16 / sizeof(T), span = std::int64_t{Regs} * 32 * vec;
  if (!tuning_for(dev.major).warp_rows || args.cols + (Shifted ? vec - 1 : 0) > span) return false;
  constexpr std::int64_t warps = block / 32;
  const std::int64_t need = (args.rows + warps - 1) / warps,
                     most = std::int64_t{dev.sms} * MinBlocks;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(need < most ? need : most), 1, 1);
  cfg.blockDim = dim3(block, 1, 1);
  cfg.stream = exec.stream;
  cudaLaunchAttribute attr[1];
  cfg.attrs = attr;
  cfg.numAttrs = 0;
  const auto kernel = warp_rows_kernel<block, Regs, MinBlocks, P, Shifted, T, G, Tgt>;
  // The normaliser ahead only where the kernel's code waits for it (griddepcontrol.wait: sm_90
  // code, not compute_80 PTX JIT-compiled on a Hopper, prepare_cluster_kernel); else every CTA
  // sums it.
  if constexpr (P == pass::fused) {
    if (prepare_cluster_kernel(reinterpret_cast<const void*>(kernel), dev.id, 0))
      launch_normalizer_ahead(fn, exec, args, cfg);
  }
  check_cuda(fn, cudaLaunchKernelEx(&cfg, kernel, args));
  return true;
}

/// The warp-rows kernel's form for the row's length (policy::warp_rows_kib): rows of a short
/// warp's tile at two CTAs per SM (three for a forward), longer fused ones in twice the registers
/// at one. `Shifted`: rows off 16-byte boundaries (and gradient rows that share them), each cut
/// at its own (the short form).
template <pass P, bool Shifted = false, class T, class G, class Tgt>
bool launch_warp_rows(const char* fn, const cuda& exec, const row_args<T, G, Tgt>& args,
                      const device_facts& dev) {
  if (args.cols * static_cast<std::int64_t>(sizeof(T)) > std::int64_t{policy::warp_rows_kib} * 1024)
    return false;
  constexpr int short_blocks =
      P == pass::forward ? policy::warp_rows_forward_min_blocks : policy::warp_rows_min_blocks;
  if (launch_warp_rows_as<policy::warp_rows_regs, short_blocks, P, Shifted>(fn, exec, args, dev))
    return true;
  if constexpr (P == pass::fused && !Shifted)
    return launch_warp_rows_as<policy::warp_rows_long_regs, policy::warp_rows_long_min_blocks, P,
                               false>(fn, exec, args, dev);
  return false;
}

/// The streaming forward in CTAs of Block threads, MinBlocks per SM (a CTA per row where the
/// batch has fewer rows): false, launching nothing, when the batch has fewer rows than half that
/// grid has CTAs (the grid of the 256-thread CTAs this kernel had before its 128-thread ones:
/// policy::stream_forward), unless `Shifted` (rows not 16-byte aligned, which the row kernel
/// reads element by element: a CTA per row is faster there even for few rows; H200, bf16 forward
/// 64 x 262145 74.5 -> 27.2 us, 200 x 50257 44.3 -> 17.2).
template <int Block, int MinBlocks, bool Shifted, class T, class G, class Tgt>
bool launch_stream_forward_as(const char* fn, const cuda& exec, const row_args<T, G, Tgt>& args,
                              const device_facts& dev) {
  std::int64_t grid = std::int64_t{dev.sms} * MinBlocks;
  if (!Shifted && 2 * args.rows < grid) return false;
  if (args.rows < grid) grid = args.rows;
  stream_forward_kernel<Block, policy::stream_forward_regs, MinBlocks, Shifted>
      <<<static_cast<unsigned>(grid), Block, 0, exec.stream>>>(args);
  check_cuda(fn, cudaGetLastError());
  return true;
}

/// A forward of plain class-id rows by the streaming forward kernel (policy::stream_forward):
/// persistent CTAs, as many as its register bound lets every SM hold (twice as wide and half as
/// many for rows longer than policy::stream_forward_wide_from_kib, when set); false, launching
/// nothing, when the batch of aligned rows has fewer rows than that (the row kernel's clusters
/// then split each row). `Shifted`: rows cut at their own 16-byte boundaries.
template <bool Shifted, class T, class G, class Tgt>
bool launch_stream_forward(const char* fn, const cuda& exec, const row_args<T, G, Tgt>& args,
                           const device_facts& dev) {
  constexpr int block = policy::stream_forward_block, blocks = policy::stream_forward_min_blocks;
  if constexpr (policy::stream_forward_wide_from_kib > 0) {
    if (args.cols * static_cast<std::int64_t>(sizeof(T)) >
        std::int64_t{policy::stream_forward_wide_from_kib} * 1024)
      return launch_stream_forward_as<2 * block, (blocks + 1) / 2, Shifted>(fn, exec, args, dev);
  }
  return launch_stream_forward_as<block, blocks, Shifted>(fn, exec, args, dev);
}

/// Backward of plain class-id rows by the bulk backward kernel (policy::bulk_backward) of Stages
/// stages: persistent CTAs, at most MinBlocks per SM; false, launching nothing, where its code has
/// no bulk copies (below sm_90) or the gradient's type differs in size from the logits' (it is
/// written over them in the stage). `Shifted`: rows cut at their own 16-byte boundaries (one tile
/// more per row allowed for).
template <int Stages, int MinBlocks, bool Shifted, class T, class G, class Tgt>
bool launch_bulk_backward_as(const char* fn, const cuda& exec, const row_args<T, G, Tgt>& args,
                             const device_facts& dev) {
  if constexpr (sizeof(T) != sizeof(G)) {
    return false;
  } else {
    constexpr int block = policy::block, regs = policy::bulk_backward_regs;
    auto kernel = bulk_backward_kernel<block, regs, Stages, MinBlocks, Shifted, T, G, Tgt>;
    constexpr int vec = 16 / static_cast<int>(sizeof(T));
    constexpr std::int64_t span = std::int64_t{regs} * block * vec;
    const int smem = static_cast<int>(Stages * span * sizeof(T));
    if (!tuning_for(dev.major).bulk_copy ||
        !prepare_cluster_kernel(reinterpret_cast<const void*>(kernel), dev.id, smem))
      return false;
    const std::int64_t tiles =
        args.rows * ((args.cols + (Shifted ? vec - 1 : 0) + span - 1) / span);
    if (tiles == 0) return true;
    const std::int64_t most = std::int64_t{dev.sms} * MinBlocks;
    const auto grid = static_cast<unsigned>(persistent_grid(tiles, most));
    kernel<<<grid, block, smem, exec.stream>>>(args);
    check_cuda(fn, cudaGetLastError());
    return true;
  }
}

/// The bulk backward's form for the row's length: rows longer than
/// policy::bulk_backward_long_from_kib KiB (when set) take its long form, the others its default.
template <bool Shifted, class T, class G, class Tgt>
bool launch_bulk_backward(const char* fn, const cuda& exec, const row_args<T, G, Tgt>& args,
                          const device_facts& dev) {
  if constexpr (policy::bulk_backward_long_from_kib > 0) {
    if (args.cols * static_cast<std::int64_t>(sizeof(T)) >
        std::int64_t{policy::bulk_backward_long_from_kib} * 1024)
      return launch_bulk_backward_as<policy::bulk_backward_long_stages,
                                     policy::bulk_backward_long_min_blocks, Shifted>(fn, exec, args,
                                                                                     dev);
  }
  return launch_bulk_backward_as<policy::bulk_backward_stages, policy::bulk_backward_min_blocks,
                                 Shifted>(fn, exec, args, dev);
}

/// Backward of class-id rows by the streaming kernel (policy::stream_backward): persistent CTAs,
/// as many as the register bound lets every SM hold, or one per tile. `Shifted`: rows cut at
/// their own 16-byte boundaries (one tile more per row allowed for).
template <bool Plain, bool Shifted, class T, class G, class Tgt>
void launch_stream_backward(const char* fn, const cuda& exec, const row_args<T, G, Tgt>& args,
                            const device_facts& dev) {
  constexpr int block = policy::block, regs = policy::stream_regs;
  constexpr int vec = 16 / static_cast<int>(sizeof(T));
  constexpr std::int64_t span = std::int64_t{regs} * block * vec;
  const std::int64_t tiles = args.rows * ((args.cols + (Shifted ? vec - 1 : 0) + span - 1) / span);
  if (tiles == 0) return;
  const std::int64_t most = std::int64_t{dev.sms} * policy::stream_min_blocks(Plain);
  const auto grid = static_cast<unsigned>(tiles < most ? tiles : most);
  stream_backward_kernel<block, regs, Plain, Shifted><<<grid, block, 0, exec.stream>>>(args);
  check_cuda(fn, cudaGetLastError());
}

/// Where a fused call on shifted rows (dispatch_rows) keeps each row's LSE between its two
/// kernels: the caller's LSE output, or the per-row area of a workspace of at least
/// cuda_workspace_size(rows) bytes (the streaming forward sums the loss in shares, not there);
/// null where there is neither.
template <class T, class G, class Tgt>
float* split_lse(const cuda& exec, const row_args<T, G, Tgt>& args) {
  if (args.lse_out) return args.lse_out;
  if (!exec.workspace || exec.workspace_bytes < cuda_workspace_size(args.rows)) return nullptr;
  return reinterpret_cast<float*>(static_cast<unsigned char*>(exec.workspace) +
                                  workspace_layout(args.rows).row_loss);
}

/// A fused call of plain rows by two kernels through the LSE (split_lse): the streaming forward,
/// then the bulk (or streaming) backward from the LSE it wrote. The logits move three times where
/// the row kernel moves them twice; taken where that kernel is slower (rows off 16-byte
/// boundaries longer than its clusters hold, policy::split_fused_kib). The call's error count is
/// the forward's alone. False, launching nothing, where there is no LSE buffer or the batch is
/// too short for the streaming forward.
template <bool Shifted, class T, class G, class Tgt>
bool launch_split_fused(const char* fn, const cuda& exec, const row_args<T, G, Tgt>& args,
                        const device_facts& dev) {
  if constexpr (policy::stream_forward && policy::stream_backward) {
    float* lse = split_lse(exec, args);
    if (!lse) return false;
    row_args<T, G, Tgt> f = args;
    f.lse_out = lse;
    if (!launch_stream_forward<Shifted>(fn, exec, f, dev)) return false;
    row_args<T, G, Tgt> b = args;
    b.lse_in = lse;
    b.error_count = nullptr;
    if (!policy::bulk_backward || !launch_bulk_backward<Shifted>(fn, exec, b, dev))
      launch_stream_backward<true, Shifted>(fn, exec, b, dev);
    return true;
  } else {
    return false;
  }
}

template <pass P, class T, class G, class Tgt>
void dispatch_rows(const char* fn, const cuda& exec, const row_args<T, G, Tgt>& args, bool aligned,
                   bool shifted = false) {
  if (args.rows == 0) return;
  const device_facts dev = query_device(fn);
  // Bulk copies and 16-byte stores when every row start is 16-byte aligned; element-wise
  // staging and stores otherwise.
  const bool plain = plain_rows(args);
  [[maybe_unused]] const bool own_plain = own_plain_rows(args);
  if constexpr (P == pass::backward && !Tgt::soft && policy::stream_backward) {
    if (aligned) {
      // Short rows, a warp each (policy::warp_rows_kib).
      if (own_plain && launch_warp_rows<P>(fn, exec, args, dev)) return;
      if (plain && policy::bulk_backward && launch_bulk_backward<false>(fn, exec, args, dev))
        return;
      if (plain)
        launch_stream_backward<true, false>(fn, exec, args, dev);
      else
        launch_stream_backward<false, false>(fn, exec, args, dev);
      return;
    }
    if (shifted) {
      // Short rows cut at their own boundaries, a warp each (policy::warp_rows_shifted_passes).
      if (own_plain && policy::warp_rows_shifted_passes &&
          launch_warp_rows<P, true>(fn, exec, args, dev))
        return;
      if (plain && policy::bulk_backward && launch_bulk_backward<true>(fn, exec, args, dev)) return;
      if (plain)
        launch_stream_backward<true, true>(fn, exec, args, dev);
      else
        launch_stream_backward<false, true>(fn, exec, args, dev);
      return;
    }
  }
  if constexpr (P != pass::backward && !Tgt::soft) {
    if (try_small_rows<P>(fn, exec, args, aligned, shifted, dev)) return;
    // Short aligned rows, a warp each (policy::warp_rows_kib), forward or fused.
    if (own_plain && aligned && launch_warp_rows<P>(fn, exec, args, dev)) return;
    // Short unaligned rows' forward, a warp each cut at each row's own boundaries
    // (policy::warp_rows_shifted_passes).
    if constexpr (P == pass::forward && policy::warp_rows_shifted_passes) {
      if (own_plain && !aligned && launch_warp_rows<P, true>(fn, exec, args, dev)) return;
    }
    // A forward that gives every CTA in flight a row of its own.
    if constexpr (P == pass::forward && policy::stream_forward) {
      if (own_plain && (aligned ? launch_stream_forward<false>(fn, exec, args, dev)
                                : launch_stream_forward<true>(fn, exec, args, dev)))
        return;
    }
    if constexpr (P == pass::fused) {
      // Short rows cut at their own boundaries (their gradient rows on the same ones), a warp
      // each (policy::warp_rows_kib).
      if (own_plain && !aligned && shifted && policy::warp_rows_shifted &&
          launch_warp_rows<P, true>(fn, exec, args, dev))
        return;
      // Short rows (policy::split_fused_kib), aligned or cut at their own boundaries (their
      // gradient rows on the same ones), by the two kernels through the LSE.
      const bool split_short = args.cols * static_cast<std::int64_t>(sizeof(T)) <=
                               std::int64_t{policy::split_fused_kib} * 1024;
      if (own_plain && split_short && (aligned || shifted) &&
          (aligned ? launch_split_fused<false>(fn, exec, args, dev)
                   : launch_split_fused<true>(fn, exec, args, dev)))
        return;
      // A fused call on rows that are not 16-byte aligned but whose gradient rows have the same
      // boundaries (in place, say), each row cut at its own boundaries.
      if (own_plain && !aligned && shifted) {
        // The row kernel, where it is taken (policy::shifted_rows) and holds the rows on chip.
        if constexpr (policy::shifted_rows && sizeof(T) == sizeof(G)) {
          if (launch_rows<true, true, P, T, G, Tgt, default_shape, true>(fn, exec, args, dev))
            return;
        }
        // Otherwise (rows longer than a cluster holds, say) the two kernels through the LSE:
        // the row kernel's unshifted form stages unaligned rows element by element (bf16 8192 x
        // 50257 fused: 2542 us there, 670 so; H200).
        if (launch_split_fused<true>(fn, exec, args, dev)) return;
      }
    }
  }
  if constexpr (P == pass::fused && !Tgt::soft && policy::wide_rows) {
    if (aligned && plain && tuning_for(dev.major).clusters &&
        wide_rows_for(args.cols * static_cast<std::int64_t>(sizeof(T))) &&
        prepare_kernel_attributes<wide_shape, true, true, P, T, G>(
            reinterpret_cast<const void*>(row_kernel_of<wide_shape, true, true, P, T, G, Tgt>),
            dev.id)) {
      launch_rows<true, true, P, T, G, Tgt, wide_shape>(fn, exec, args, dev);
      return;
    }
  }
  if (!aligned)
    launch_rows<false, false, P>(fn, exec, args, dev);
  else if (plain)
    launch_rows<true, !Tgt::soft, P>(fn, exec, args, dev);
  else
    launch_rows<true, false, P>(fn, exec, args, dev);
}

/// Everything but the pass, from the public arguments.
template <class T, class G, class Tgt>
row_args<device_t<T>, device_t<G>, Tgt> make_args(const cuda& exec, matrix_view<const T> logits,
                                                  Tgt targets, const options& opts) {
  row_args<device_t<T>, device_t<G>, Tgt> a{};
  a.logits = reinterpret_cast<const device_t<T>*>(logits.data);
  a.ld = logits.ld;
  a.rows = logits.rows;
  a.cols = logits.cols;
  a.targets = targets;
  a.weights = opts.class_weights.data;
  // With class weights, sum_c w_c is summed on the device (where the weights live) by the kernel.
  a.k = make_loss_constants(opts, logits.cols, static_cast<float>(logits.cols));
  a.first = 0;
  a.vocab = logits.cols;
  a.ignore_index = opts.ignore_index;
  a.reduce = opts.reduce;
  a.workspace = exec.workspace;
  a.error_count = exec.error_count;
  return a;
}

/// The forward outputs a kernel writes (row_args), from the public ones.
template <class T, class G, class Tgt>
void set_outputs(row_args<T, G, Tgt>& a, const options& opts, const forward_outputs& out) {
  a.loss = opts.reduce == reduction::none ? nullptr : out.loss;
  a.row_loss = out.row_loss.data;
  a.lse_out = out.lse.data;
  a.argmax = out.argmax.data;
  a.num_correct = out.num_correct;
  a.want_argmax = out.argmax.data || out.num_correct;
}

inline void require_workspace(const char* fn, const cuda& exec, std::int64_t rows, bool needed) {
  if (!needed) return;
  if (exec.workspace == nullptr || exec.workspace_bytes < cuda_workspace_size(rows))
    throw error(fn, "exec.workspace",
                "needs " + std::to_string(cuda_workspace_size(rows)) +
                    " bytes of zero-filled device memory (cuda_workspace_size(rows)), got " +
                    std::to_string(exec.workspace ? exec.workspace_bytes : 0));
}

/// One entry point's call. `E`: the logits' extents, whose static sizes the small-batch kernel
/// takes as constants (try_small_rows); the checks and every other kernel read the run-time sizes.
template <pass P, class E = dynamic_extents, class T, class Tgt, class G>
void run(const char* fn, const cuda& exec, matrix_view<const T> logits, const Tgt& targets,
         const options& opts, const upstream* up, const forward_outputs* out,
         vector_view<const float> lse, matrix_view<G> grad) {
  auto dt = device_targets(targets);
  auto a = make_args<T, G>(exec, logits, dt, opts);
  const bool reduced = out && ((out->loss && opts.reduce != reduction::none) || out->num_correct);
  const bool needs_ws = P != pass::backward && reduced;
  require_workspace(fn, exec, logits.rows, needs_ws);
  if (!needs_ws) a.workspace = nullptr;
  if (out) set_outputs(a, opts, *out);
  a.lse_in = lse.data;
  a.grad = reinterpret_cast<device_t<G>*>(grad.data);
  a.grad_ld = grad.ld;
  if (up) {
    a.scale = up->scale;
    a.scale_ptr = up->scale_ptr;
    a.up_rows = up->rows.data;
  }
  bool aligned = aligned16(logits.data, logits.ld * static_cast<std::int64_t>(sizeof(T)));
  if (grad.data)
    aligned = aligned && aligned16(grad.data, grad.ld * static_cast<std::int64_t>(sizeof(G)));
  // Each row's 16-byte boundaries at the same elements of the logits and of the gradient (an
  // in-place call always): the small-batch kernel cuts unaligned rows there (row_start::shifted).
  const bool shifted =
      !grad.data ||
      (sizeof(G) == sizeof(T) && same_boundaries(grad.data, grad.ld * std::int64_t{sizeof(G)},
                                                 logits.data, logits.ld * std::int64_t{sizeof(T)}));
  if (logits.rows == 0) {
    // Nothing to read; the reduced loss of no rows is still defined (mean NaN, sum 0).
    // All-ones bytes are a float NaN; memset nodes are capturable, unlike pageable copies.
    if (a.loss)
      check_cuda(fn, cudaMemsetAsync(a.loss, opts.reduce == reduction::mean ? 0xff : 0,
                                     sizeof(float), exec.stream));
    if (a.num_correct)
      check_cuda(fn, cudaMemsetAsync(a.num_correct, 0, sizeof(std::int64_t), exec.stream));
    return;
  }
  if constexpr (P != pass::backward && E::rows != dynamic && E::cols != dynamic) {
    if (try_small_rows<P, E>(fn, exec, a, aligned, shifted, query_device(fn))) return;
  }
  dispatch_rows<P>(fn, exec, a, aligned, shifted);
}

}  // namespace cuda_detail
}  // namespace xent
