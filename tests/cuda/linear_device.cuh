// Device copies of the fused linear tests' host cases (tests/cpu/linear_harness.hpp): a case's
// inputs, poisoned forward outputs and gradients copied back into the harness's host types, and a
// poisoned workspace at a given offset. Shared by the CUDA linear and vocab-parallel linear tests.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>
#include <xent/xent.hpp>

#include "cpu/linear_harness.hpp"
#include "cuda/device_util.cuh"

namespace xent_test {

using xent::reduction;
using xtl::gradients;
using xtl::ldata;
using xtl::lspec;
using xtl::outputs;
using xtl::target_kind;

/// A case's inputs on the device: hidden, weight, bias, targets, class weights and the upstream
/// gradient's device parts, with the options and upstream pointing at them.
template <class T>
struct device_inputs {
  const ldata<T>& L;
  dbuf<T> x, w, b, probs;
  dbuf<std::int32_t> t32;
  dbuf<std::int64_t> t64;
  dbuf<float> weights, up_rows, scale;

  explicit device_inputs(const ldata<T>& L_)
      : L(L_),
        x(L_.x),
        w(L_.w),
        b(L_.b),
        probs(L_.d.probs),
        t32(L_.d.t32),
        t64(L_.d.t64),
        weights(L_.d.weights),
        up_rows(L_.d.up_rows),
        scale(std::vector<float>{L_.d.scale_value}) {}

  xent::matrix_view<const T> hidden() const { return {x.ptr, L.N(), L.D(), L.s.ld()}; }
  xent::matrix_view<const T> weight() const { return {w.ptr, L.V(), L.D(), L.s.ld()}; }
  xent::vector_view<const T> bias() const {
    return L.s.bias ? xent::vector_view<const T>(b.ptr, L.V()) : xent::vector_view<const T>{};
  }
  xent::linear_options options() const {
    xent::linear_options o = L.options();
    // All of them: a vocab-parallel rank's case (a shard's weight rows) keeps the V weights.
    if (L.s.ce.weights) o.class_weights = {weights.ptr, static_cast<std::int64_t>(weights.n)};
    return o;
  }
  xent::upstream upstream() const {
    xent::upstream u = L.d.upstream();
    if (u.scale_ptr) u.scale_ptr = scale.ptr;
    if (u.rows.data) u.rows = {up_rows.ptr, L.N()};
    return u;
  }
  /// Calls f with the device targets in the form the case asks for.
  template <class F>
  void with_targets(F&& f) const {
    switch (L.s.ce.kind) {
      case target_kind::int32:
        f(xent::vector_view<const std::int32_t>(t32.ptr, L.N()));
        break;
      case target_kind::int64:
        f(xent::vector_view<const std::int64_t>(t64.ptr, L.N()));
        break;
      case target_kind::soft:
        f(xent::soft_targets<T>{xent::matrix_view<const T>(probs.ptr, L.N(), L.V(), L.s.ce.ld())});
        break;
    }
  }
};

/// Forward outputs on the device, poisoned as xtl::outputs, copied back into one.
struct device_outputs {
  outputs host;
  dbuf<float> row_loss, lse, loss;
  dbuf<std::int64_t> argmax, correct;
  explicit device_outputs(std::int64_t n)
      : host(n),
        row_loss(host.row_loss),
        lse(host.lse),
        loss(std::vector<float>{host.loss}),
        argmax(host.argmax),
        correct(std::vector<std::int64_t>{host.correct}) {}
  xent::forward_outputs all(const xt::spec& s) {
    xent::forward_outputs o;
    const auto n = static_cast<std::int64_t>(host.row_loss.size());
    if (s.reduce != reduction::none) o.loss = loss.ptr;
    o.row_loss = {row_loss.ptr, n};
    o.lse = {lse.ptr, n};
    o.argmax = {argmax.ptr, n};
    if (s.kind != target_kind::soft) o.num_correct = correct.ptr;
    return o;
  }
  xent::vector_view<const float> lse_view() const {
    return {lse.ptr, static_cast<std::int64_t>(lse.n)};
  }
  const outputs& fetch() {
    host.row_loss = row_loss.download();
    host.lse = lse.download();
    host.argmax = argmax.download();
    host.loss = loss.download()[0];
    host.correct = correct.download()[0];
    return host;
  }
};

/// Gradients on the device, poisoned as xtl::gradients (padding included), copied back into one.
template <class G>
struct device_gradients {
  gradients<G> host;
  dbuf<G> dx, dw, db;
  explicit device_gradients(const lspec& s) : host(s), dx(host.dx), dw(host.dw), db(host.db) {}
  xent::linear_grads<G> views() const {
    xent::linear_grads<G> g;
    g.d_hidden = {dx.ptr, host.s.ce.rows, host.s.hidden, host.s.ld()};
    g.d_weight = {dw.ptr, host.s.ce.cols, host.s.hidden, host.s.ld()};
    if (host.s.bias) g.d_bias = {db.ptr, host.s.ce.cols};
    return g;
  }
  const gradients<G>& fetch() {
    host.dx = dx.download();
    host.dw = dw.download();
    host.db = db.download();
    return host;
  }
};

/// A fused call's results as bytes (the loss, then d_hidden, d_weight and d_bias as stored): what
/// the bitwise comparisons (graph capture, runs of the same inputs) compare.
template <class G>
std::vector<unsigned char> result_bytes(float loss, const gradients<G>& gr) {
  std::vector<unsigned char> out(sizeof(float));
  std::memcpy(out.data(), &loss, sizeof(float));
  for (const auto* v : {&gr.dx, &gr.dw, &gr.db}) {
    const auto* p = reinterpret_cast<const unsigned char*>(v->data());
    out.insert(out.end(), p, p + v->size() * sizeof(G));
  }
  return out;
}

/// A device workspace of `bytes`, its start `offset` bytes past a 256-byte boundary, filled with
/// NaN bytes: a call must write what it reads.
struct device_workspace {
  dbuf<unsigned char> raw;
  xent::linear_workspace ws;
  device_workspace(std::size_t bytes, std::size_t offset) : raw(bytes + 512) {
    EXPECT_EQ(cudaMemset(raw.ptr, 0xFF, raw.n), cudaSuccess);
    ws.data = raw.ptr + offset % 256;  // cudaMalloc returns 256-byte-aligned memory
    ws.bytes = bytes;
  }
  /// Whether every byte still holds the poison (a call that threw wrote nothing).
  bool untouched() const {
    const std::vector<unsigned char> h = raw.download();
    return std::all_of(h.begin(), h.end(), [](unsigned char b) { return b == 0xFF; });
  }
};

/// The device backend of the shared linear tests (cpu/linear_backend_tests.hpp, which lists what
/// a backend provides): device copies of a case, and an execution object on a cuBLAS handle of the
/// fixture's (the caller's, as xent requires) that counts the rows of bad targets.
struct device_memory {
  template <class T>
  using inputs = device_inputs<T>;
  template <class A>
  using outputs = device_outputs;
  template <class G>
  using grads = device_gradients<G>;
  using workspace = device_workspace;
  struct error_count {
    dbuf<int> count{std::vector<int>{0}};
    int read() const { return count.download()[0]; }
  };
  /// Every other every-option case in bf16 / fp16.
  static constexpr int narrow_stride = 2;
  static constexpr bool low_memory_order = true;

  void set_up() {
    REQUIRE_GPU();
    ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  }
  void tear_down() {
    if (handle) cublasDestroy(handle);
    handle = nullptr;
  }
  xent::cuda exec(const lspec&, error_count& errors) const {
    xent::cuda e;
    e.error_count = errors.count.ptr;
    e.cublas = handle;
    return e;
  }
  static void sync() { ok(cudaDeviceSynchronize()); }
  /// Workspaces at offsets of 16 bytes and 8 more from a 256-byte boundary.
  static std::size_t offset(std::uint64_t seed, int k) { return seed * 16 + 8 * k; }
  template <class T>
  static xtl::rounding stored() {
    return xtl::stored_in<T>();
  }
  template <class T, class G>
  static std::int64_t chunk_rows(const xent::cuda&, const xent::linear_shape& shape,
                                 xent::dw_accumulation accumulate, std::size_t bytes) {
    return xent::cuda_detail::plan_linear<T, G>(shape, xent::linear_pass::training, accumulate,
                                                bytes)
        .chunk_rows;
  }

  /// Where the CUDA backend writes linear_sparse_counts: device memory.
  struct sparse_counts {
    dbuf<std::int64_t> c{std::vector<std::int64_t>{-1, -1}};
    xent::linear_sparse_counts* ptr() {
      return reinterpret_cast<xent::linear_sparse_counts*>(c.ptr);
    }
    xent::linear_sparse_counts fetch() const {
      const std::vector<std::int64_t> v = c.download();
      return {v[0], v[1]};
    }
  };
  /// The rows of its panel sub-chunks.
  template <class T, class G>
  static std::int64_t sparse_chunk_rows(const xent::cuda&, const xent::linear_shape& shape,
                                        std::size_t bytes) {
    return xent::cuda_detail::plan_low_memory<T, G>(shape, bytes, INT64_MAX, true).panel.chunk_rows;
  }
  /// Its tiles are of 64 global rows (cut at the sub-chunks' ends).
  static constexpr bool sparse_global_tiles = true;

  cublasHandle_t handle = nullptr;
};

}  // namespace xent_test
