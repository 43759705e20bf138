// The dispatch of vocab-parallel fused linear cross-entropy on the GPU
// (vocab_parallel_linear_traits<cuda>), each rank a GPU with the caller's cuBLAS handle
// (exec.cublas) and a device communicator (parallel/nccl_group.cuh, or any type whose all_gather
// enqueues on the stream its stream() names).
//
// The steps of parallel/linear_chunks.hpp, every one enqueued on exec.stream, nothing waiting for
// the host, made of the single-device CUDA pieces: the chunk's GEMMs and buffers, the prologue
// (the whole call's W over the global vocabulary and targets, each row's upstream gradient) and the
// reduced loss after the chunks are dispatch/linear_call.cuh's, over this rank's weight shard; a
// chunk's records (the row kernel's statistics pass over its logits), their rank-order merge
// (vp_merge_kernel: the chunk's rows' loss, LSE and argmax) and its gradient (the row kernel's
// backward pass, in place over the logits) are dispatch/vocab_parallel.cuh's. The chunk's exchange
// sits in the caller's workspace after the single-device buffers (a vp_layout without the
// reduction's head: the merge writes per-row outputs; the reduction comes after the chunks).
//
// The low-memory order (parallel/linear_chunks.hpp's panels step) runs the chunks' exchanges on a
// forward plan of the shard, keeping every row's merged LSE and mass, then linear_panels.cuh's
// panels over the shard, the single-device order's step 3.
//
// Errors found on the device are cuda/vocab_parallel.cuh's: a bad tiling makes every rank write
// NaN for each row's loss and LSE, and count 1 in *exec.error_count per chunk; a class id outside
// [0, V) that is not ignore_index gives its row a NaN loss and a zero gradient and counts 1.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../../linear/options.hpp"
#include "../../linear/plan.hpp"
#include "../../options.hpp"
#include "../../parallel/linear_chunks.hpp"
#include "../../parallel/shard.hpp"
#include "../../targets.hpp"
#include "../../views.hpp"
#include "../cuda.cuh"
#include "cublas.cuh"
#include "linear_call.cuh"
#include "linear_panels.cuh"
#include "linear_plan.cuh"
#include "rows.cuh"
#include "vocab_parallel.cuh"

namespace xent {
namespace cuda_detail {

/// A rank's workspace: the single-device call's buffers, then its chunk's exchange (a vp_layout
/// of chunk_rows rows, record_layout::largest, without the reduction's head). In the low-memory
/// order the single-device buffers are that order's over this rank's shard (linear_panels.cuh's
/// low_memory_plan: the statistics chunks, the exchange's, then the panels in the same region;
/// each row's merged LSE and target mass for all N rows after it).
struct vp_linear_plan {
  linear_plan chunk;         ///< the exchange chunks' (the low-memory order's statistics chunks)
  low_memory_plan low;       ///< the low-memory order's buffers (when `panels`)
  bool panels = false;       ///< the low-memory order
  std::size_t exchange = 0;  ///< the exchange's offset from the aligned base
  std::size_t bytes = 0;
};

/// A rank's low-memory buffers for exchange chunks of `chunk_rows` rows: a panel whose logits take
/// what a chunk's over the shard take (chunk_rows x V_l elements), so that a rank's bytes follow
/// from its shard and chunk_rows alone and more chunk rows give wider panels. Every row in one
/// sub-chunk at the widest whole-tile width those logits hold, where that is the narrowest panel
/// or more (linear_panels.cuh's rule per rank); else the narrowest panel in sub-chunks of
/// detail::panel_chunk_rows.
template <class T, class G>
low_memory_plan make_vp_low_memory_plan(const linear_shape& s, std::int64_t chunk_rows) {
  const std::int64_t narrowest = narrowest_panel(s.vocab);
  const std::int64_t room =
      s.rows > 0 ? std::max<std::int64_t>(chunk_rows, 0) * s.vocab / s.rows : 0;
  const std::int64_t cols =
      room >= s.vocab ? s.vocab : room / linear_panel_tile * linear_panel_tile;
  if (s.rows > 0 && chunk_rows > 0 && cols >= narrowest)
    return make_low_memory_plan<T, G>(s, s.rows, cols, chunk_rows);
  return make_low_memory_plan<T, G>(
      s, detail::panel_chunk_rows(chunk_rows, s.rows, s.vocab, narrowest), narrowest, chunk_rows);
}

/// The fewest exchange chunk rows whose panel takes every row (make_vp_low_memory_plan): the
/// narrowest panel's N x P logits over the shard's V_l classes.
inline std::int64_t vp_every_row_chunk(const linear_shape& s) {
  if (s.rows <= 0 || s.vocab <= 0) return std::max<std::int64_t>(s.rows, 1);
  const std::int64_t narrowest = narrowest_panel(s.vocab);
  return std::min(s.rows, (s.rows * narrowest + s.vocab - 1) / s.vocab);
}

template <class T, class G>
vp_linear_plan make_vp_linear_plan(const linear_shape& s, int ranks, linear_pass pass,
                                   dw_accumulation accumulate, linear_order order,
                                   std::int64_t chunk_rows) {
  vp_linear_plan p;
  p.panels = pass == linear_pass::training && order == linear_order::low_memory;
  if (p.panels) {
    p.low = make_vp_low_memory_plan<T, G>(s, chunk_rows);
    p.chunk = p.low.stats;
    p.exchange = p.low.end;
  } else {
    p.chunk = make_linear_plan<T, G>(s, pass, accumulate, chunk_rows, false, false);
    p.exchange = p.chunk.end;
  }
  p.bytes = p.exchange + linear_alignment +
            vp_layout(chunk_rows, ranks, record_layout::largest(), false).total;
  return p;
}

/// One call on one rank: its buffers and the steps of a chunk (parallel/linear_chunks.hpp).
template <class T, class G, class Tgt>
class vp_linear_call {
  using mode = detail::vp_linear_mode;
  using args = detail::vp_linear_args<T, G, Tgt>;
  static constexpr bool soft = detail::target_traits<Tgt>::soft;

 public:
  template <class Group>
  vp_linear_call(const char* fn, const cuda& exec, const Group& group, const args& a, mode m)
      : fn_(fn),
        exec_(exec),
        a_(a),
        mode_(m),
        plan_(make_vp_linear_plan<T, G>(
            {a.hidden.rows, a.hidden.cols, a.weight.rows}, a.ranks,
            m == mode::forward ? linear_pass::forward : linear_pass::training, a.opts.accumulate,
            a.opts.order, detail::planned_chunk_rows(a.ws.chunk_rows, a.hidden.rows))),
        checked_(check(fn, exec, group, a, plan_)),
        blas_(fn, exec),
        // The low-memory order's chunks compute statistics only; its panels have calls of their
        // own.
        c_(make_linear_call(exec, blas_, a.hidden, a.weight, a.bias,
                            plan_.panels ? linear_grads<G>{} : a.grads, plan_.chunk, a.ws.data)),
        exchange_(reinterpret_cast<unsigned char*>(c_.base) + plan_.exchange),
        targets_(device_targets(a.targets)),
        totals_(start_totals(fn, c_, targets_, a.hidden.rows, a.shard.vocab, a.opts, a.up,
                             m == mode::backward ? nullptr : &a_.out)),
        core_(a.opts) {
    core_.reduce = reduction::none;  // each chunk's rows; W and the reduction are the call's
  }
  vp_linear_call(const vp_linear_call&) = delete;
  vp_linear_call& operator=(const vp_linear_call&) = delete;

  void logits(std::int64_t r0, std::int64_t n) { chunk_logits(c_, r0, n); }

  detail::vp_block records(std::int64_t r0, std::int64_t n, detail::vp_records) {
    const vp_layout lay = layout(n);
    vp_send(fn_, exec_, exchange_ + lay.send, lay.record, chunk(n), a_.shard, chunk_targets(r0, n),
            core_);
    return {exchange_ + lay.send, exchange_ + lay.recv, lay.block};
  }

  void merge(std::int64_t r0, std::int64_t n, detail::vp_records what) {
    const forward_outputs o = chunk_outputs(a_.out, totals_, r0, n);
    const vp_layout lay = layout(n);
    // The low-memory order keeps every row's LSE and mass (its panels come after the last chunk).
    float* lse = plan_.panels ? c_.template buffer<float>(plan_.low.lse) + r0 : nullptr;
    float* mass = plan_.panels ? c_.template buffer<float>(plan_.low.mass) + r0 : nullptr;
    vp_merge(fn_, exec_, exchange_, lay, exchange_ + lay.recv, a_.ranks, chunk(n), a_.shard,
             chunk_targets(r0, n), core_, what == detail::vp_records::statistics ? &o : nullptr,
             mass, lse);
  }

  void gradient(std::int64_t r0, std::int64_t n) {
    const vp_layout lay = layout(n);
    const bool backward = mode_ == mode::backward;
    const float* lse =
        backward ? a_.lse.data + r0 : reinterpret_cast<const float*>(exchange_ + lay.lse);
    const float* mass = soft ? reinterpret_cast<const float*>(exchange_ + lay.mass) : nullptr;
    // Backward with class ids has no merge: its gradient pass counts out-of-range class ids.
    vp_gradient(fn_, exec_, chunk(n), a_.shard, chunk_targets(r0, n), core_, lse, mass,
                chunk_upstream(a_.up, a_.opts, totals_, r0, n),
                matrix_view<T>(reinterpret_cast<T*>(c_.logits()), n, vocab(), plan_.chunk.ld),
                backward && !soft ? exec_.error_count : nullptr);
  }

  void accumulate(std::int64_t r0, std::int64_t n) {
    chunk_grads(c_, r0, n, r0 == 0, c_.hidden_row(r0), c_.hidden.ld);
  }

  /// The low-memory order's panels over this rank's shard (linear_panels.cuh's run_panels) from
  /// every row's LSE (merged, or the saved one) and, for soft targets, its exchanged mass. The
  /// reduced outputs are formed first: their per-row buffers lie in the region the panels reuse.
  void panels() {
    const bool backward = mode_ == mode::backward;
    if (!backward) finish_outputs();
    const float* lse = backward ? a_.lse.data : c_.template buffer<float>(plan_.low.lse);
    run_panels(fn_, exec_, blas_, plan_.low, a_.ws.data, a_.hidden, a_.weight, a_.bias, a_.targets,
               a_.opts, a_.shard, lse, soft ? c_.template buffer<float>(plan_.low.mass) : nullptr,
               a_.up, a_.grads, backward && !soft ? exec_.error_count : nullptr);
  }

  void finish() {
    if (plan_.panels) return;  // panels() finished the gradients and the outputs
    if (mode_ != mode::forward) finish_grads(c_);
    if (mode_ != mode::backward) finish_outputs();
  }

 private:
  /// The device communicator enqueues on exec.stream; the handle is there; cuBLAS's int sizes
  /// (of the panels' plan too).
  template <class Group>
  static bool check(const char* fn, const cuda& exec, const Group& group, const args& a,
                    const vp_linear_plan& plan) {
    check_device_group(fn, exec, group);
    check_linear_call(fn, exec, a.hidden, a.weight, a.grads, plan.chunk);
    if (plan.panels) check_linear_call(fn, exec, a.hidden, a.weight, a.grads, plan.low.panel);
    return true;
  }
  void finish_outputs() const {
    finish_totals(fn_, exec_.stream, totals_, targets_, a_.hidden.rows, a_.shard.vocab, a_.opts,
                  a_.out);
  }
  std::int64_t vocab() const { return a_.weight.rows; }
  /// A chunk of n rows exchanges n records per rank (the same n on every rank): every statistic
  /// a forward pass merges, or in backward (soft targets) the target mass alone
  /// (linear_chunks.hpp's vp_records), the same records in every chunk.
  vp_layout layout(std::int64_t n) const {
    const record_layout record =
        mode_ == mode::backward
            ? record_layout::mass_only()
            : record_layout::statistics(soft, a_.opts, a_.out.argmax.data || a_.out.num_correct);
    return vp_layout(n, a_.ranks, record, false);
  }
  matrix_view<const T> chunk(std::int64_t n) const {
    return {reinterpret_cast<const T*>(c_.logits()), n, vocab(), plan_.chunk.ld};
  }
  auto chunk_targets(std::int64_t r0, std::int64_t n) const {
    return device_targets(detail::target_rows(a_.targets, r0, n));
  }

  const char* fn_;
  const cuda& exec_;
  args a_;
  mode mode_;
  vp_linear_plan plan_;
  bool checked_;  ///< before blas_: nothing is set up or enqueued with a bad handle or group
  cublas_scope blas_;
  linear_call<T, G> c_;
  unsigned char* exchange_;  ///< the chunk's exchange, after the single-device buffers
  decltype(device_targets(std::declval<Tgt>())) targets_;
  linear_totals totals_;
  options core_;
};

}  // namespace cuda_detail
}  // namespace xent
