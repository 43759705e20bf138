// Argument checks of the fused linear cross-entropy entry points, shared by every backend. Each
// failure throws xent::error naming the argument, before anything is written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../views.hpp"
#include "options.hpp"

namespace xent {
namespace detail {

/// The bytes a view spans ([begin, end), both null when it is empty), for overlap checks.
struct span_of {
  const char* name;
  const char* begin = nullptr;
  const char* end = nullptr;

  template <class T>
  span_of(const char* name_, const matrix_view<T>& m) : name(name_) {
    if (m.empty() || m.data == nullptr) return;
    begin = reinterpret_cast<const char*>(m.data);
    end = reinterpret_cast<const char*>(m.row(m.rows - 1) + m.cols);
  }
  template <class T>
  span_of(const char* name_, const vector_view<T>& v) : name(name_) {
    if (v.empty() || v.data == nullptr) return;
    begin = reinterpret_cast<const char*>(v.data);
    end = reinterpret_cast<const char*>(v.data + v.size);
  }
  span_of(const char* name_, const linear_workspace& w) : name(name_) {
    if (w.data == nullptr || w.bytes == 0) return;
    begin = static_cast<const char*>(w.data);
    end = begin + w.bytes;
  }

  bool overlaps(const span_of& o) const {
    return begin && o.begin && begin < o.end && o.begin < end;
  }
};

/// Each written span must miss every input and every other written span: a call reads the
/// weight and the hidden rows again after it has started writing. (Arrays rather than
/// initializer_lists of temporaries: nvcc's front end mistranslates the latter.)
template <std::size_t Written, std::size_t Read>
void check_disjoint(const char* fn, const span_of (&written)[Written],
                    const span_of (&read)[Read]) {
  for (std::size_t w = 0; w < Written; ++w) {
    for (const span_of& r : read)
      require(!written[w].overlaps(r), fn, written[w].name,
              [&] { return std::string("overlaps ") + r.name; });
    for (std::size_t o = w + 1; o < Written; ++o)
      require(!written[w].overlaps(written[o]), fn, written[w].name,
              [&] { return std::string("overlaps ") + written[o].name; });
  }
}

/// hidden N x D, weight V_w x D (the same D), bias V_w or absent, targets for N rows (soft
/// targets: N x V_w, a probability per weight row), the loss options for `vocab` classes: V_w
/// unsharded, the whole vocabulary when the weight is a vocab-parallel rank's shard of it.
template <class T, class Tgt>
void check_linear_inputs(const char* fn, const matrix_view<const T>& hidden,
                         const matrix_view<const T>& weight, const vector_view<const T>& bias,
                         const Tgt& targets, const linear_options& opts, std::int64_t vocab) {
  check_matrix(fn, "hidden", hidden);
  check_matrix(fn, "weight", weight);
  require(weight.cols == hidden.cols, fn, "weight", [&] {
    return "is " + shape(weight.rows, weight.cols) + ", hidden is " +
           shape(hidden.rows, hidden.cols) + ": both need D columns";
  });
  require(vocab >= 1 || hidden.rows == 0, fn, "weight", [&] {
    return "a row needs at least one class (the vocabulary has 0 rows, hidden has " +
           std::to_string(hidden.rows) + ")";
  });
  check_vector(fn, "bias", bias, weight.rows, true);
  check_targets(fn, targets, hidden.rows, weight.rows);
  check_options(fn, opts, vocab);
  require(opts.accumulate == dw_accumulation::fp32 || opts.accumulate == dw_accumulation::output,
          fn, "options.accumulate", "not one of fp32, output");
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
