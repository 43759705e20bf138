// The vocab-parallel handlers' bodies: xent's split phases (parallel/vocab_parallel_phases.hpp) as
// three FFI calls, between which xent/jax/vocab_parallel.py all-gathers with jax.lax.all_gather
// over a mesh axis:
//
//   records   logits (N, C) of this device's C classes, labels (N,), class weights (V,) or (0,)
//             -> send (B,) uint8: a header and one record per row (B: exchange_bytes below);
//   merge     recv (R B,) uint8 (every device's block, in mesh order), labels, class weights
//             -> loss (() for mean and sum, (N,) for none), lse (N,), float32;
//   backward  logits (N, C), labels, class weights, lse (N,), g (() or (N,), float32)
//             -> grad (N, C), this device's shard of d loss / d logits times g.
//
// Every handler sees the shard {first 0, vocab V} (the `vocab` attribute), so none needs a
// device's first class, which under shard_map is a traced value (axis_index x C): records and
// backward get class ids and class weights rotated by that first class, and records' header is
// corrected by the binding before the exchange (vocab_parallel.py says how). The merge reads no
// logits (an N x 0 view): its outputs are a function of the gathered records and the global
// labels and weights alone, the same on every device. No vmap batch: the binding batches these
// calls as a loop (ffi_call's vmap_method="sequential"). Logits are float32, bfloat16 or float16
// (xent's vocab-parallel calls do not take float64).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ffi_ops.h"

namespace xent_jax {

// The attributes of every vocab-parallel handler: the loss options and the whole vocabulary V.
struct vp_attrs {
  std::int64_t ignore_index;
  std::int32_t reduction;
  float label_smoothing, z_loss, softcap;
  std::int64_t vocab;

  loss_attrs loss() const { return {ignore_index, reduction, label_smoothing, z_loss, softcap}; }
};

// What an execution-object maker is asked for: a plain call, or a merge (which xent::cuda needs a
// zero-filled workspace for).
enum class vp_phase { plain, merge };

// The operands the three calls share: N rows of class ids, the class weights and the options.
struct vp_call {
  std::int64_t rows;
  ffi::AnyBuffer labels, weight;
  xent::options opts;
  xent::vocab_shard shard;

  vp_call(std::int64_t rows_, ffi::AnyBuffer labels_, ffi::AnyBuffer weight_, const vp_attrs& attrs)
      : rows(rows_), labels(labels_), weight(weight_) {
    if (labels.element_type() != ffi::DataType::S32 && labels.element_type() != ffi::DataType::S64)
      fail("labels",
           std::string("must be int32 or int64, got ") + dtype_name(labels.element_type()));
    expect_vector("labels", labels, rows);
    expect_dtype("weight", weight, ffi::DataType::F32);
    const auto wd = weight.dimensions();
    const bool weighted = wd.size() == 1 && wd[0] != 0;
    expect_vector("weight", weight, weighted ? attrs.vocab : 0);
    opts = attrs.loss().options();
    if (weighted) opts.class_weights = {static_cast<const float*>(weight.untyped_data()), wd[0]};
    shard = {0, attrs.vocab};
  }

  static void expect_vector(const std::string& name, const ffi::AnyBuffer& b, std::int64_t n) {
    const auto d = b.dimensions();
    if (d.size() != 1 || d[0] != n)
      fail(name, "must have shape (" + std::to_string(n) + ",), got " + shape_string(d));
  }

  // The loss: () for mean and sum, (N,) for none; and any other float32 per-row operand.
  void expect_loss(const std::string& name, const ffi::AnyBuffer& b) const {
    expect_dtype(name, b, ffi::DataType::F32);
    if (opts.reduce == xent::reduction::none)
      expect_vector(name, b, rows);
    else if (b.dimensions().size() != 0)
      fail(name, "must be a scalar for mean and sum, got shape " + shape_string(b.dimensions()));
  }
  void expect_rows(const std::string& name, const ffi::AnyBuffer& b) const {
    expect_dtype(name, b, ffi::DataType::F32);
    expect_vector(name, b, rows);
  }

  // Bytes of one device's block: the same on every device of a call.
  template <class Exec>
  std::size_t block_bytes(const Exec& exec) const {
    return xent::vocab_parallel_exchange_bytes(exec, rows, false, opts, false);
  }

  // Calls f(targets view) with the class ids.
  template <class F>
  void with_labels(F&& f) const {
    if (labels.element_type() == ffi::DataType::S64)
      f(xent::vector_view<const std::int64_t>(
          static_cast<const std::int64_t*>(labels.untyped_data()), rows));
    else
      f(xent::vector_view<const std::int32_t>(
          static_cast<const std::int32_t*>(labels.untyped_data()), rows));
  }
};

// The logits operand (N, C) and the view of it as T.
inline ffi::AnyBuffer::Dimensions vp_logits_shape(const ffi::AnyBuffer& logits) {
  const auto d = logits.dimensions();
  if (d.size() != 2) fail("logits", "must be (N, C), got shape " + shape_string(d));
  return d;
}

template <class T>
xent::matrix_view<const T> vp_logits(const ffi::AnyBuffer& logits) {
  const auto d = logits.dimensions();
  return {static_cast<const T*>(logits.untyped_data()), d[0], d[1], d[1]};
}

// `make_exec(phase, rows)` returns a holder whose get() is the execution object of a call of
// `rows` rows (as ffi_ops.h's makers).

// Records: this device's block into send.
template <class MakeExec>
ffi::Error vp_records(MakeExec&& make_exec, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                      ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> send,
                      const vp_attrs& attrs) {
  return run_checked([&] {
    const auto d = vp_logits_shape(logits);
    const vp_call c(d[0], labels, weight, attrs);
    const auto holder = make_exec(vp_phase::plain, c.rows);
    const auto& exec = holder.get();
    expect_dtype("send", *send, ffi::DataType::U8);
    const auto bytes = static_cast<std::int64_t>(c.block_bytes(exec));
    vp_call::expect_vector("send", *send, bytes);
    dispatch_dtype<false>(logits, [&](auto tag) {
      using T = decltype(tag);
      c.with_labels([&](auto tv) {
        xent::vocab_parallel_records(
            exec, vp_logits<T>(logits), c.shard, tv, c.opts, false,
            xent::vector_view<unsigned char>(at<unsigned char>(*send, 0), bytes));
      });
    });
  });
}

// Merge: the loss and every row's LSE from every device's block, the same on every device.
template <class MakeExec>
ffi::Error vp_merge(MakeExec&& make_exec, ffi::AnyBuffer recv, ffi::AnyBuffer labels,
                    ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> loss,
                    ffi::Result<ffi::AnyBuffer> lse, const vp_attrs& attrs) {
  return run_checked([&] {
    const auto ld = lse->dimensions();
    if (ld.size() != 1) fail("lse", "must be (N,), got shape " + shape_string(ld));
    const vp_call c(ld[0], labels, weight, attrs);
    c.expect_loss("loss", *loss);
    c.expect_rows("lse", *lse);
    const auto holder = make_exec(vp_phase::merge, c.rows);
    const auto& exec = holder.get();
    expect_dtype("recv", recv, ffi::DataType::U8);
    const auto block = static_cast<std::int64_t>(c.block_bytes(exec));
    const auto rd = recv.dimensions();
    if (rd.size() != 1 || rd[0] == 0 || rd[0] % block != 0)
      fail("recv", "must hold a whole number of " + std::to_string(block) +
                       "-byte blocks (one per device), got shape " + shape_string(rd));
    xent::forward_outputs out;
    if (c.opts.reduce == xent::reduction::none)
      out.row_loss = {at<float>(*loss, 0), c.rows};
    else
      out.loss = at<float>(*loss, 0);
    out.lse = {at<float>(*lse, 0), c.rows};
    c.with_labels([&](auto tv) {
      xent::vocab_parallel_finish(
          exec, static_cast<int>(rd[0] / block),
          xent::matrix_view<const float>(nullptr, c.rows, 0, 0), c.shard, tv, c.opts,
          xent::vector_view<const unsigned char>(at<const unsigned char>(recv, 0), rd[0]), out);
    });
  });
}

// Backward: this device's gradient shard from the merged LSE and the upstream gradient g.
template <class MakeExec>
ffi::Error vp_backward(MakeExec&& make_exec, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                       ffi::AnyBuffer weight, ffi::AnyBuffer lse, ffi::AnyBuffer g,
                       ffi::Result<ffi::AnyBuffer> grad, const vp_attrs& attrs) {
  return run_checked([&] {
    const auto d = vp_logits_shape(logits);
    const vp_call c(d[0], labels, weight, attrs);
    c.expect_rows("lse", lse);
    c.expect_loss("g", g);
    expect_dtype("grad", *grad, logits.element_type());
    if (grad->dimensions().size() != 2 || grad->dimensions()[0] != d[0] ||
        grad->dimensions()[1] != d[1])
      fail("grad", "must have the logits' shape " + shape_string(d) + ", got " +
                       shape_string(grad->dimensions()));
    xent::upstream up;
    if (c.opts.reduce == xent::reduction::none)
      up.rows = {at<const float>(g, 0), c.rows};
    else
      up.scale_ptr = at<const float>(g, 0);  // on CUDA, read on the device
    const auto holder = make_exec(vp_phase::plain, c.rows);
    const auto& exec = holder.get();
    dispatch_dtype<false>(logits, [&](auto tag) {
      using T = decltype(tag);
      c.with_labels([&](auto tv) {
        xent::vocab_parallel_backward(
            exec, vp_logits<T>(logits), c.shard, tv, c.opts,
            xent::vector_view<const float>(at<const float>(lse, 0), c.rows),
            xent::vector_view<const float>{}, up,
            xent::matrix_view<T>(at<T>(*grad, 0), d[0], d[1], d[1]));
      });
    });
  });
}

template <class B>
auto vp_records_binding(B&& ctx) {  // logits, labels, weight -> send
  return buffers<3, 1>(std::move(ctx)).template Attrs<vp_attrs>();
}

template <int ws = 0, class B>
auto vp_merge_binding(B&& ctx) {  // recv, labels, weight -> loss, lse (ws: as ffi_ops.h's)
  return buffers<3, 2 + ws>(std::move(ctx)).template Attrs<vp_attrs>();
}

template <class B>
auto vp_backward_binding(B&& ctx) {  // logits, labels, weight, lse, g -> grad
  return buffers<5, 1>(std::move(ctx)).template Attrs<vp_attrs>();
}

}  // namespace xent_jax

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(xent_jax::vp_attrs,
                                      xla::ffi::StructMember<std::int64_t>("ignore_index"),
                                      xla::ffi::StructMember<std::int32_t>("reduction"),
                                      xla::ffi::StructMember<float>("label_smoothing"),
                                      xla::ffi::StructMember<float>("z_loss"),
                                      xla::ffi::StructMember<float>("softcap"),
                                      xla::ffi::StructMember<std::int64_t>("vocab"));
