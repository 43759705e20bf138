// The vocab-parallel ops: xent's vocab-parallel calls (include/xent/parallel/vocab_parallel.hpp)
// with the rank's exchange going through a torch.distributed process group, one process per
// device. Written once over a backend as xent_ops.h's op bodies are (xent_vocab_parallel.cpp
// instantiates them for the CPU); a backend adds to xent_ops.h's interface
//   B::vp_exec(x, rows, ranks)   the execution object of a vocab-parallel call on tensors like x
//                                with `ranks` ranks, {exec, hold} as B::exec
//   B::vp_group(name, device, rows, digest)  the call's communicator over the named process group
//                                (a torch_group, with whatever more the backend's calls need)
//
// Each rank holds logits[:, vocab_start : vocab_start + V_local] of a vocabulary of vocab_size
// classes; targets are global class ids (or the rank's N x V_local shard of class probabilities)
// and class weights all vocab_size of them, as the C++ calls take them. Every rank gets the
// unsharded call's loss and LSE, bit for bit the same on every rank, and its shard of the gradient.
#pragma once

#include <torch/library.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "xent_ops.h"

namespace xent_torch {

// What every rank's call must agree on beyond the byte counts of its exchange: the rows, the
// vocabulary, the options and the kind of targets, folded into one 64-bit word (FNV-1a over
// their bytes). Only the CPU path compares it (torch_group::all_gather).
class call_digest {
 public:
  template <class T>
  call_digest& add(const T& v) {
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &v, sizeof(T));
    for (unsigned char b : bytes) h_ = (h_ ^ b) * 1099511628211ull;
    return *this;
  }
  std::int64_t value() const { return static_cast<std::int64_t>(h_); }

 private:
  std::uint64_t h_ = 14695981039346656037ull;
};

// xent's communicator (parallel/communicator.hpp) over the process group that the Python side
// names (ProcessGroup.group_name, resolved through torch's group registry). The all-gather is
// torch's own: gloo for CPU tensors, NCCL for CUDA ones, where torch runs it on its collective
// stream after the work the current stream holds, and Work::wait makes the current stream wait
// for it without blocking the host.
//
// Each exchange is preceded, on the CPU, by one of 16 bytes per rank, (rows, digest): ranks that
// disagree on N, the vocabulary, the options or the targets' kind get a
// ValueError on every rank instead of a collective of mismatched sizes, which gloo may answer
// with a hang. On CUDA the host would have to wait for that exchange (a synchronisation per
// call), so it is made only under XENT_CHECK_RANKS=1, a debugging aid; otherwise the ranks'
// agreement is the caller's contract there, as it is for torch's own collectives.
class torch_group {
 public:
  torch_group(const std::string& group_name, const at::Device& device, std::int64_t rows,
              std::int64_t digest)
      : pg_(c10d::resolve_process_group(group_name)),
        device_(device),
        rows_(rows),
        digest_(digest),
        check_(checks(device)) {}

  int rank() const { return pg_->getRank(); }
  int size() const { return pg_->getSize(); }

  // Whether calls on `device` compare the ranks' (rows, digest) before their first exchange.
  static bool checks(const at::Device& device) { return device.is_cpu() || checks_requested(); }

  // The agreement exchanges this thread has made: a call that raises with none made has left the
  // other ranks waiting in theirs.
  static std::uint64_t& agreements() {
    thread_local std::uint64_t count = 0;
    return count;
  }

  // The end of a call: one that made no exchange (a backward from class ids, a linear call of no
  // rows) still makes the agreement exchange, so that every call makes one and a rank refusing
  // its arguments (below) always meets the other ranks' calls in it.
  void finish() const {
    if (check_ && !exchanged_) check_agreement();
  }

  // This rank's part in the agreement exchange of a call that it refuses (a bad argument of its
  // own): rows -1, so that every other rank raises instead of waiting. Its own error is the
  // caller's to raise, so one from the exchange itself is dropped.
  static void refuse(const std::string& group_name, const at::Device& device) try {
    torch_group(group_name, device, -1, 0).gather_agreement();
  } catch (...) {
  }

  void all_gather(const void* send, void* recv, std::size_t bytes) const {
    if (check_) check_agreement();
    exchanged_ = true;
    const auto opts = at::TensorOptions().dtype(at::kByte).device(device_);
    const auto n = static_cast<std::int64_t>(bytes);
    gather(at::from_blob(const_cast<void*>(send), {n}, opts),
           at::from_blob(recv, {n * size()}, opts));
  }

 private:
  static bool checks_requested() {
    const char* v = std::getenv("XENT_CHECK_RANKS");
    return v != nullptr && std::string(v) == "1";
  }

  void gather(at::Tensor in, at::Tensor out) const {
    // _allgather_base: the one spelling of the single-tensor all-gather from torch 2.4 to today's
    // (later releases add all_gather_single and keep this one as its alias).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    pg_->_allgather_base(out, in)->wait();
#pragma GCC diagnostic pop
  }

  // Rows first: the options and the kind of targets decide a record's size, so the byte counts of
  // ranks that disagree on them differ too, and a fused linear call's chunks have the same size on
  // ranks of different N until the last.
  at::Tensor gather_agreement() const {
    const at::Tensor mine = at::tensor({rows_, digest_}, at::kLong).to(device_);
    at::Tensor all = at::empty({2 * size()}, mine.options());
    gather(mine, all);
    ++agreements();
    return all.cpu();  // on CUDA, the host waits here (XENT_CHECK_RANKS=1 only)
  }

  void check_agreement() const {
    const at::Tensor got = gather_agreement();
    const std::int64_t* h = got.data_ptr<std::int64_t>();
    for (int r = 0; r < size(); ++r)
      TORCH_CHECK_VALUE(h[2 * r] >= 0, "xent: rank ", r,
                        " of a vocab-parallel call refused its arguments (its own error says why)");
    for (int r = 0; r < size(); ++r)
      TORCH_CHECK_VALUE(h[2 * r] == h[0],
                        "xent: the ranks of a vocab-parallel call disagree on the number of rows "
                        "(rank ",
                        r, " has ", h[2 * r], ", rank 0 ", h[0], ")");
    for (int r = 0; r < size(); ++r)
      TORCH_CHECK_VALUE(h[2 * r + 1] == h[1], "xent: rank ", r,
                        " of a vocab-parallel call disagrees with rank 0 on the vocabulary size, "
                        "the options or the kind of targets");
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  at::Device device_;
  std::int64_t rows_;
  std::int64_t digest_;
  bool check_;
  mutable bool exchanged_ = false;
};

// This rank's shard: classes [vocab_start, vocab_start + V_local) of vocab_size.
struct vp_shard {
  std::int64_t start, vocab;
};

// The digest of what every rank's call must share besides its rows: the vocabulary, the options,
// the kind of targets and whether class weights are given.
inline call_digest call_digest_of(vp_shard shard, const ce_inputs& in) {
  const xent::options& o = in.opts;
  return call_digest()
      .add(shard.vocab)
      .add(o.ignore_index)
      .add(o.reduce)
      .add(o.label_smoothing)
      .add(o.z_loss)
      .add(o.softcap)
      .add(in.tg.soft)
      .add(in.weights.defined());
}

// A vocab-parallel call's logits shard as rows, its place in the vocabulary, its targets, class
// weights (all vocab_size of them) and options, and the digest its ranks compare.
struct vp_inputs {
  at::Tensor x;
  vp_shard shard;
  ce_inputs ce;
  std::int64_t digest;
};

inline vp_inputs vp_inputs_of(const at::Tensor& input, const at::Tensor& target,
                              const std::optional<at::Tensor>& weight, vp_shard shard,
                              std::int64_t ignore_index, std::int64_t reduction,
                              double label_smoothing, double z_loss, double softcap) {
  check_input_dtype(input);
  vp_inputs in;
  in.x = rows_view(input);
  in.shard = shard;
  in.ce.tg = targets_of(target, in.x, in.x.size(1));
  in.ce.weights = weights_of(in.x, weight, shard.vocab);
  in.ce.opts = options_of(in.ce.weights, ignore_index, reduction, label_smoothing, z_loss, softcap);
  in.digest = call_digest_of(shard, in.ce).value();
  return in;
}

// An op's body, `body()`. Where the ranks' agreement is checked, an error this rank raises before
// its first exchange (a bad argument of its own: the dtype, a class weight count, its shard) is
// raised on every rank: this rank still takes part in the agreement exchange, refusing.
template <class F>
decltype(auto) agreeing(const std::string& group_name, const at::Device& device, F&& body) {
  const std::uint64_t before = torch_group::agreements();
  try {
    return body();
  } catch (...) {
    if (torch_group::agreements() == before && torch_group::checks(device))
      torch_group::refuse(group_name, device);
    throw;
  }
}

// One vocab-parallel call on backend B: `run(exec, group, T{}, targets, shard)`, xent's errors as
// torch's.
template <class B, class Run>
void run_vocab_parallel(const vp_inputs& in, const std::string& group_name, Run&& run) {
  const at::Tensor& x = in.x;
  const vp_shard shard = in.shard;
  const auto group = B::vp_group(group_name, x.device(), x.size(0), in.digest);
  dispatch<B>(x, in.ce.tg, [&](auto tag, auto tv) {
    if constexpr (std::is_same<decltype(tag), double>::value) {
      TORCH_CHECK_TYPE(false,
                       "xent: vocab-parallel calls take float32, bfloat16 or float16 "
                       "logits, got float64");
    } else {
      const auto call = B::vp_exec(x, x.size(0), group.size());
      call_xent([&] {
        run(call.exec, group, tag, tv, xent::vocab_shard{shard.start, shard.vocab});
      });
      group.finish();
    }
  });
}

// Forward: (loss, lse) of the unsharded call, the same on every rank.
template <class B>
std::tuple<at::Tensor, at::Tensor> vocab_parallel_cross_entropy_fwd(
    const at::Tensor& input, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    std::int64_t vocab_start, std::int64_t vocab_size, const std::string& group_name,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap) {
  const typename B::guard device_guard(input.device());
  return agreeing(group_name, input.device(), [&]() -> std::tuple<at::Tensor, at::Tensor> {
    const vp_inputs in = vp_inputs_of(input, target, weight, {vocab_start, vocab_size},
                                      ignore_index, reduction, label_smoothing, z_loss, softcap);
    const at::Tensor& x = in.x;
    const loss_outputs out(x, in.ce.opts.reduce);
    run_vocab_parallel<B>(in, group_name,
                          [&](auto& exec, auto& group, auto tag, auto tv, xent::vocab_shard s) {
                            using T = decltype(tag);
                            xent::vocab_parallel_forward(exec, group, matrix_of<const T>(x), s, tv,
                                                         in.ce.opts, out.view<float>());
                          });
    return {out.loss, out.lse};
  });
}

// Backward: this rank's shard of the gradient from the saved LSE, scaled by grad_output.
template <class B>
at::Tensor vocab_parallel_cross_entropy_bwd(const at::Tensor& grad_output, const at::Tensor& input,
                                            const at::Tensor& target,
                                            const std::optional<at::Tensor>& weight,
                                            const at::Tensor& lse, std::int64_t vocab_start,
                                            std::int64_t vocab_size, const std::string& group_name,
                                            std::int64_t ignore_index, std::int64_t reduction,
                                            double label_smoothing, double z_loss, double softcap) {
  const typename B::guard device_guard(input.device());
  return agreeing(group_name, input.device(), [&]() -> at::Tensor {
    const vp_inputs in = vp_inputs_of(input, target, weight, {vocab_start, vocab_size},
                                      ignore_index, reduction, label_smoothing, z_loss, softcap);
    const at::Tensor& x = in.x;
    const std::int64_t n = x.size(0);
    const at::Tensor g_out = upstream_tensor(x, grad_output);
    const at::Tensor saved = saved_lse(x, lse, n);
    at::Tensor grad = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    run_vocab_parallel<B>(
        in, group_name, [&](auto& exec, auto& group, auto tag, auto tv, xent::vocab_shard s) {
          using T = decltype(tag);
          xent::vocab_parallel_backward(exec, group, matrix_of<const T>(x), s, tv, in.ce.opts,
                                        xent::vector_view<const float>(saved.data_ptr<float>(), n),
                                        upstream_of<float>(g_out, in.ce.opts.reduce, n),
                                        matrix_of<T>(grad));
        });
    return grad;
  });
}

// Training in one call (reduction mean or sum, upstream 1: the autograd node scales the gradient
// by the loss's gradient, as for the single-device fused op): (loss, lse, grad shard).
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> vocab_parallel_cross_entropy_fwd_bwd(
    const at::Tensor& input, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    std::int64_t vocab_start, std::int64_t vocab_size, const std::string& group_name,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap) {
  const typename B::guard device_guard(input.device());
  return agreeing(
      group_name, input.device(), [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
        const vp_inputs in =
            vp_inputs_of(input, target, weight, {vocab_start, vocab_size}, ignore_index, reduction,
                         label_smoothing, z_loss, softcap);
        const at::Tensor& x = in.x;
        check_fused_reduction(in.ce.opts);
        const loss_outputs out(x, in.ce.opts.reduce);
        at::Tensor grad =
            at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
        run_vocab_parallel<B>(
            in, group_name, [&](auto& exec, auto& group, auto tag, auto tv, xent::vocab_shard s) {
              using T = decltype(tag);
              xent::vocab_parallel_forward_backward(exec, group, matrix_of<const T>(x), s, tv,
                                                    in.ce.opts, xent::upstream{}, out.view<float>(),
                                                    matrix_of<T>(grad));
            });
        return {out.loss, out.lse, grad};
      });
}

// --- fused linear: logits = hidden weight_shard^T (+ bias_shard), never materialised ------------

// The inputs of a vocab-parallel linear call: linear_inputs over this rank's weight rows, with the
// class weights of the whole vocabulary, and the digest its ranks compare.
struct vp_linear_inputs {
  linear_inputs lin;
  vp_shard shard;
  std::int64_t digest;
};

inline vp_linear_inputs vp_linear_inputs_of(const at::Tensor& hidden, const at::Tensor& weight,
                                            const std::optional<at::Tensor>& bias,
                                            const at::Tensor& target,
                                            const std::optional<at::Tensor>& class_weight,
                                            vp_shard shard, std::int64_t ignore_index,
                                            std::int64_t reduction, double label_smoothing,
                                            double z_loss, double softcap) {
  vp_linear_inputs in;
  in.shard = shard;
  in.lin = linear_inputs_of(hidden, weight, bias, target, std::nullopt, ignore_index, reduction,
                            label_smoothing, z_loss, softcap);
  in.lin.class_weights = weights_of(in.lin.hidden, class_weight, shard.vocab, "class_weight");
  static_cast<xent::options&>(in.lin.opts) =
      options_of(in.lin.class_weights, ignore_index, reduction, label_smoothing, z_loss, softcap);
  in.digest = call_digest_of(shard, {in.lin.tg, in.lin.class_weights, in.lin.opts})
                  .add(in.lin.hidden.size(1))
                  .add(in.lin.bias.defined())
                  .value();
  return in;
}

// One vocab-parallel linear call on backend B: `run(exec, group, T{}, targets, shard, workspace)`
// with a workspace of xent's size for `pass` (its chunk rows the same on every rank), xent's
// errors as torch's.
template <class B, class Run>
void run_vocab_parallel_linear(const vp_linear_inputs& in, const std::string& group_name,
                               xent::linear_pass pass, Run&& run) {
  const linear_inputs& lin = in.lin;
  const vp_shard shard = in.shard;
  const auto group = B::vp_group(group_name, lin.hidden.device(), lin.hidden.size(0), in.digest);
  dispatch<B>(lin.hidden, lin.tg, [&](auto tag, auto tv) {
    using T = decltype(tag);
    if constexpr (std::is_same<T, double>::value) {
      TORCH_CHECK_TYPE(false,
                       "xent: vocab-parallel calls take float32, bfloat16 or float16 "
                       "hidden states, got float64");
    } else {
      // As the single-device linear ops: the GEMM library's handle, no reduced-loss workspace.
      const auto call = B::exec(lin.hidden, false, true);
      call_xent([&] {
        const auto size = xent::vocab_parallel_linear_workspace_size<T>(
            call.exec, {lin.hidden.size(0), lin.hidden.size(1), lin.weight.size(0)}, shard.vocab,
            group.size(), pass, lin.opts);
        const at::Tensor ws = at::empty({static_cast<std::int64_t>(size.bytes)},
                                        lin.hidden.options().dtype(at::kByte));
        xent::vocab_parallel_linear_workspace w;
        static_cast<xent::linear_workspace&>(w) = workspace_of(ws);
        w.chunk_rows = size.chunk_rows;
        run(call.exec, group, tag, tv, xent::vocab_shard{shard.start, shard.vocab}, w);
      });
      group.finish();
    }
  });
}

// Forward: (loss, lse) of the unsharded linear call, the same on every rank.
template <class B>
std::tuple<at::Tensor, at::Tensor> vocab_parallel_linear_cross_entropy_fwd(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    std::int64_t vocab_start, std::int64_t vocab_size, const std::string& group_name,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap) {
  const typename B::guard device_guard(hidden.device());
  return agreeing(group_name, hidden.device(), [&]() -> std::tuple<at::Tensor, at::Tensor> {
    const vp_linear_inputs in =
        vp_linear_inputs_of(hidden, weight, bias, target, class_weight, {vocab_start, vocab_size},
                            ignore_index, reduction, label_smoothing, z_loss, softcap);
    const linear_inputs& lin = in.lin;
    const loss_outputs out(lin.hidden, lin.opts.reduce);
    run_vocab_parallel_linear<B>(
        in, group_name, xent::linear_pass::forward,
        [&](auto& exec, auto& group, auto tag, auto tv, xent::vocab_shard s, const auto& ws) {
          using T = decltype(tag);
          xent::vocab_parallel_linear_forward(
              exec, group, matrix_of<const T>(lin.hidden), matrix_of<const T>(lin.weight),
              vector_of<const T>(lin.bias), s, tv, lin.opts, out.view<float>(), ws);
        });
    return {out.loss, out.lse};
  });
}

// This rank's gradients from the saved LSE: d_hidden is its partial, G_shard W_shard, which the
// caller sums over the group; d_weight and d_bias its own rows, complete.
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor> vocab_parallel_linear_cross_entropy_bwd(
    const at::Tensor& grad_output, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& target,
    const std::optional<at::Tensor>& class_weight, const at::Tensor& lse, std::int64_t vocab_start,
    std::int64_t vocab_size, const std::string& group_name, std::int64_t ignore_index,
    std::int64_t reduction, double label_smoothing, double z_loss, double softcap,
    std::array<bool, 3> output_mask) {
  const typename B::guard device_guard(hidden.device());
  return agreeing(
      group_name, hidden.device(), [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
        vp_linear_inputs in = vp_linear_inputs_of(hidden, weight, bias, target, class_weight,
                                                  {vocab_start, vocab_size}, ignore_index,
                                                  reduction, label_smoothing, z_loss, softcap);
        const linear_inputs& lin = in.lin;
        const std::int64_t n = lin.hidden.size(0);
        const at::Tensor g_out = upstream_tensor(lin.hidden, grad_output);
        const at::Tensor saved = saved_lse(lin.hidden, lse, n);
        const linear_grad_tensors grads(lin, output_mask);
        run_vocab_parallel_linear<B>(
            in, group_name, xent::linear_pass::training,
            [&](auto& exec, auto& group, auto tag, auto tv, xent::vocab_shard s, const auto& ws) {
              using T = decltype(tag);
              xent::vocab_parallel_linear_backward(
                  exec, group, matrix_of<const T>(lin.hidden), matrix_of<const T>(lin.weight),
                  vector_of<const T>(lin.bias), s, tv, lin.opts,
                  xent::vector_view<const float>(saved.data_ptr<float>(), n),
                  upstream_of<float>(g_out, lin.opts.reduce, n), grads.view<T>(), ws);
            });
        return {grads.d_hidden, grads.d_weight, grads.d_bias};
      });
}

// Training in one call (upstream 1, see check_fused_reduction): (loss, lse, d_hidden partial,
// d_weight, d_bias).
template <class B>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
vocab_parallel_linear_cross_entropy_fwd_bwd(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, const std::optional<at::Tensor>& class_weight,
    std::int64_t vocab_start, std::int64_t vocab_size, const std::string& group_name,
    std::int64_t ignore_index, std::int64_t reduction, double label_smoothing, double z_loss,
    double softcap, std::array<bool, 3> output_mask) {
  const typename B::guard device_guard(hidden.device());
  return agreeing(
      group_name, hidden.device(),
      [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
        const vp_linear_inputs in = vp_linear_inputs_of(
            hidden, weight, bias, target, class_weight, {vocab_start, vocab_size}, ignore_index,
            reduction, label_smoothing, z_loss, softcap);
        const linear_inputs& lin = in.lin;
        check_fused_reduction(lin.opts);
        const loss_outputs out(lin.hidden, lin.opts.reduce);
        const linear_grad_tensors grads(lin, output_mask);
        run_vocab_parallel_linear<B>(
            in, group_name, xent::linear_pass::training,
            [&](auto& exec, auto& group, auto tag, auto tv, xent::vocab_shard s, const auto& ws) {
              using T = decltype(tag);
              xent::vocab_parallel_linear_forward_backward(
                  exec, group, matrix_of<const T>(lin.hidden), matrix_of<const T>(lin.weight),
                  vector_of<const T>(lin.bias), s, tv, lin.opts, xent::upstream{},
                  out.view<float>(), grads.view<T>(), ws);
            });
        return {out.loss, out.lse, grads.d_hidden, grads.d_weight, grads.d_bias};
      });
}

// The six ops' kernels on backend B, under the dispatch key of the library `m` was made for.
template <class B>
void register_vocab_parallel(torch::Library& m) {
  m.impl("vocab_parallel_cross_entropy_fwd", &vocab_parallel_cross_entropy_fwd<B>);
  m.impl("vocab_parallel_cross_entropy_bwd", &vocab_parallel_cross_entropy_bwd<B>);
  m.impl("vocab_parallel_cross_entropy_fwd_bwd", &vocab_parallel_cross_entropy_fwd_bwd<B>);
  m.impl("vocab_parallel_linear_cross_entropy_fwd", &vocab_parallel_linear_cross_entropy_fwd<B>);
  m.impl("vocab_parallel_linear_cross_entropy_bwd", &vocab_parallel_linear_cross_entropy_bwd<B>);
  m.impl("vocab_parallel_linear_cross_entropy_fwd_bwd",
         &vocab_parallel_linear_cross_entropy_fwd_bwd<B>);
}

}  // namespace xent_torch
