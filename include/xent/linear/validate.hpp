// Argument checks of the fused linear cross-entropy entry points, shared by every backend. Each
// failure throws xent::error naming the argument, before anything is written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../detail/disjoint.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../views.hpp"
#include "options.hpp"

namespace xent {
namespace detail {

/// A fused linear shape whose buffers' sizes the plans can compute: no negative size, and the
/// N x V logits of every row, the V x D weight and the N x D hidden rows within max_elements
/// each (chunks exist so that N x V need not fit in memory, but the search for the largest chunk
/// sizes every row's).
inline void check_linear_shape(const char* fn, const char* arg, const linear_shape& s) {
  require(s.rows >= 0 && s.hidden >= 0 && s.vocab >= 0, fn, arg, "negative size");
  require(within_max_elements(s.rows, s.vocab) && within_max_elements(s.vocab, s.hidden) &&
              within_max_elements(s.rows, s.hidden),
          fn, arg, [&] {
            return "N = " + std::to_string(s.rows) + ", D = " + std::to_string(s.hidden) +
                   ", V = " + std::to_string(s.vocab) +
                   ": N x V, V x D and N x D must each be at most 2^59 elements";
          });
}

inline void check_accumulation(const char* fn, const linear_options& opts) {
  require(opts.accumulate == dw_accumulation::fp32 || opts.accumulate == dw_accumulation::output,
          fn, "options.accumulate", "not one of fp32, output");
}

inline void check_order(const char* fn, const linear_options& opts) {
  require(opts.order == linear_order::automatic || opts.order == linear_order::fast ||
              opts.order == linear_order::low_memory,
          fn, "options.order", "not one of automatic, fast, low_memory");
}

/// The sparse backward's threshold: a number in [0, 1] (NaN is refused), and not with softcap and
/// label smoothing together (the kept smoothing term would be full rank). With linear_order::fast
/// a threshold is refused: only the low-memory order skips tiles.
inline void check_sparse(const char* fn, const linear_options& opts) {
  const float t = opts.sparse_threshold;
  require(t >= 0.0f && t <= 1.0f, fn, "options.sparse_threshold",
          [&] { return "must be in [0, 1] (0: exact), got " + std::to_string(t); });
  require(
      t == 0.0f || opts.softcap == 0.0f || opts.label_smoothing == 0.0f, fn,
      "options.sparse_threshold",
      "not with softcap and label_smoothing together (smoothing's term cannot be kept exactly)");
  require(t == 0.0f || opts.order != linear_order::fast, fn, "options.sparse_threshold",
          "runs in the low-memory order only: linear_order::fast refuses a threshold");
}

/// Calls that have no sparse backward refuse a threshold (`where` names them).
inline void require_dense_backward(const char* fn, const linear_options& opts, const char* where) {
  require(opts.sparse_threshold == 0.0f, fn, "options.sparse_threshold",
          [&] { return std::string("must be 0: ") + where + " have no sparse backward yet"; });
}

inline void check_pass(const char* fn, linear_pass pass) {
  require(pass == linear_pass::forward || pass == linear_pass::training, fn, "pass",
          "not one of forward, training");
}

/// hidden N x D, weight V_w x D (the same D), bias V_w or absent, targets for N rows (soft
/// targets: N x V_w, a probability per weight row), the loss options for `vocab` classes: V_w
/// unsharded, the whole vocabulary (`vocab_arg`, named in errors) when the weight is a
/// vocab-parallel rank's shard of it.
template <class T, class Tgt>
void check_linear_inputs(const char* fn, const matrix_view<const T>& hidden,
                         const matrix_view<const T>& weight, const vector_view<const T>& bias,
                         const Tgt& targets, const linear_options& opts, std::int64_t vocab,
                         const char* vocab_arg = "weight") {
  check_matrix(fn, "hidden", hidden);
  check_matrix(fn, "weight", weight);
  require(weight.cols == hidden.cols, fn, "weight", [&] {
    return "is " + shape(weight.rows, weight.cols) + ", hidden is " +
           shape(hidden.rows, hidden.cols) + ": both need D columns";
  });
  require(vocab >= 1 || hidden.rows == 0, fn, vocab_arg, [&] {
    return "a row needs at least one class (the vocabulary has 0 rows, hidden has " +
           std::to_string(hidden.rows) + ")";
  });
  check_linear_shape(fn, "weight", {hidden.rows, hidden.cols, weight.rows});
  check_vector(fn, "bias", bias, weight.rows, true);
  check_targets(fn, targets, hidden.rows, weight.rows);
  check_options(fn, opts, vocab);
  check_accumulation(fn, opts);
  check_order(fn, opts);
  check_sparse(fn, opts);
}

/// An optional gradient matrix: absent when null and 0 x 0, else exactly rows x cols.
template <class G>
void check_optional_matrix(const char* fn, const char* arg, const matrix_view<G>& m,
                           std::int64_t rows, std::int64_t cols) {
  if (m.data == nullptr && m.rows == 0 && m.cols == 0) return;
  check_matrix(fn, arg, m);
  require(m.rows == rows && m.cols == cols, fn, arg,
          [&] { return "is " + shape(m.rows, m.cols) + ", expected " + shape(rows, cols); });
}

template <class T, class G>
void check_linear_grads(const char* fn, const linear_grads<G>& grads,
                        const matrix_view<const T>& hidden, const matrix_view<const T>& weight,
                        const vector_view<const T>& bias) {
  check_optional_matrix(fn, "grads.d_hidden", grads.d_hidden, hidden.rows, hidden.cols);
  check_optional_matrix(fn, "grads.d_weight", grads.d_weight, weight.rows, weight.cols);
  check_vector(fn, "grads.d_bias", grads.d_bias, weight.rows, true);
  require(grads.d_bias.data == nullptr || bias.data != nullptr || weight.rows == 0, fn,
          "grads.d_bias", "given without a bias");
}

/// At least `need` bytes; `query` names the size query that says how many.
inline void check_workspace(const char* fn, const linear_workspace& ws, std::size_t need,
                            const char* query = "xent::linear_workspace_size") {
  require(ws.data != nullptr || ws.bytes == 0, fn, "workspace", "null data with non-zero size");
  require(ws.bytes >= need, fn, "workspace", [&] {
    return "has " + std::to_string(ws.bytes) + " bytes, this call needs at least " +
           std::to_string(need) + " (" + query + ")";
  });
}

}  // namespace detail
}  // namespace xent
