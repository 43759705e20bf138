// Host-side argument checks shared by every backend. Each failure throws xent::error naming the
// argument, before any output is written.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "../error.hpp"
#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"

namespace xent {
namespace detail {

// Throws xent::error when `ok` is false. Every call runs these checks, so one that passes costs
// its comparison only: the message is a literal, or a callable that formats it (the numbers in
// it) only when the check fails.
inline void require(bool ok, const char* fn, const char* arg, const char* message) {
  if (!ok) throw error(fn, arg, message);
}

template <class Message, std::enable_if_t<std::is_invocable_r_v<std::string, Message&>, int> = 0>
void require(bool ok, const char* fn, const char* arg, Message&& message) {
  if (!ok) throw error(fn, arg, message());
}

inline std::string shape(std::int64_t rows, std::int64_t cols) {
  return std::to_string(rows) + " x " + std::to_string(cols);
}

/// The most elements one array may span: 2^59, so that any count of them times the widest
/// element a backend keeps (16 bytes), plus alignment slack, stays within int64 and size_t, and
/// no size a backend computes from the views overflows.
constexpr std::int64_t max_elements = std::int64_t{1} << 59;

/// Whether a x b (both >= 0) is at most max_elements.
inline bool within_max_elements(std::int64_t a, std::int64_t b) {
  return a <= max_elements && b <= max_elements && (a == 0 || b <= max_elements / a);
}

template <class T>
void check_matrix(const char* fn, const char* arg, const matrix_view<T>& m) {
  require(m.rows >= 0 && m.cols >= 0, fn, arg,
          [&] { return "negative size " + shape(m.rows, m.cols); });
  require(m.ld >= m.cols, fn, arg, [&] {
    return "leading dimension " + std::to_string(m.ld) + " < cols " + std::to_string(m.cols);
  });
  const bool empty = m.rows == 0 || m.cols == 0;
  // (rows - 1) x ld + cols elements, within max_elements (ld >= cols >= 1 here).
  require(empty || (m.cols <= max_elements && m.rows - 1 <= (max_elements - m.cols) / m.ld), fn,
          arg, [&] {
            return shape(m.rows, m.cols) + " with leading dimension " + std::to_string(m.ld) +
                   " spans more than 2^59 elements";
          });
  require(m.data != nullptr || empty, fn, arg, "null data with non-zero size");
}

template <class T>
void check_vector(const char* fn, const char* arg, const vector_view<T>& v, std::int64_t expected,
                  bool optional) {
  require(v.size >= 0, fn, arg, [&] { return "negative size " + std::to_string(v.size); });
  require(v.size <= max_elements, fn, arg,
          [&] { return std::to_string(v.size) + " entries: more than 2^59"; });
  if (optional && v.size == 0 && v.data == nullptr) return;
  require(v.size == expected, fn, arg, [&] {
    return "has " + std::to_string(v.size) + " entries, expected " + std::to_string(expected);
  });
  require(v.data != nullptr || v.size == 0, fn, arg, "null data with non-zero size");
}

template <class T>
void check_logits(const char* fn, const matrix_view<T>& logits) {
  check_matrix(fn, "logits", logits);
  require(logits.cols >= 1 || logits.rows == 0, fn, "logits", [&] {
    return "a row needs at least one class (cols = 0 with rows = " + std::to_string(logits.rows) +
           ")";
  });
}

template <class I>
void check_targets(const char* fn, const vector_view<I>& targets, std::int64_t rows, std::int64_t) {
  check_vector(fn, "targets", targets, rows, false);
}

template <class S>
void check_targets(const char* fn, const soft_targets<S>& targets, std::int64_t rows,
                   std::int64_t cols) {
  check_matrix(fn, "targets", targets.probs);
  require(targets.probs.rows == rows && targets.probs.cols == cols, fn, "targets", [&] {
    return "soft targets are " + shape(targets.probs.rows, targets.probs.cols) + ", logits are " +
           shape(rows, cols);
  });
}

inline void check_options(const char* fn, const options& opts, std::int64_t cols) {
  require(opts.reduce == reduction::none || opts.reduce == reduction::mean ||
              opts.reduce == reduction::sum,
          fn, "options.reduce", "not one of none, mean, sum");
  require(opts.label_smoothing >= 0.0f && opts.label_smoothing <= 1.0f, fn,
          "options.label_smoothing",
          [&] { return "must be in [0, 1], got " + std::to_string(opts.label_smoothing); });
  require(opts.z_loss >= 0.0f && std::isfinite(opts.z_loss), fn, "options.z_loss",
          [&] { return "must be finite and >= 0, got " + std::to_string(opts.z_loss); });
  require(opts.softcap >= 0.0f && std::isfinite(opts.softcap), fn, "options.softcap", [&] {
    return "must be finite and >= 0 (0 is off), got " + std::to_string(opts.softcap);
  });
  // The kernels multiply by 1 / softcap in float: below ~2.9e-39 that is infinite, and 0 x inf
  // would turn a zero logit into NaN.
  require(opts.softcap == 0.0f || std::isfinite(1.0f / opts.softcap), fn, "options.softcap", [&] {
    char text[32];
    std::snprintf(text, sizeof text, "%g", static_cast<double>(opts.softcap));
    return std::string("must be 0 (off) or at least 2.9e-39 (1 / softcap finite in float), got ") +
           text;
  });
  check_vector(fn, "options.class_weights", opts.class_weights, cols, true);
}

template <class A>
void check_outputs(const char* fn, const basic_forward_outputs<A>& out, const options& opts,
                   std::int64_t rows, bool soft, bool loss_required) {
  check_vector(fn, "outputs.row_loss", out.row_loss, rows, true);
  require(!soft || out.num_correct == nullptr, fn, "outputs.num_correct",
          "counts rows whose argmax equals a class id; soft targets have none");
  check_vector(fn, "outputs.lse", out.lse, rows, true);
  check_vector(fn, "outputs.argmax", out.argmax, rows, true);
  if (!loss_required) return;
  if (opts.reduce == reduction::none)
    require(out.row_loss.data != nullptr || rows == 0, fn, "outputs.row_loss",
            "required with reduction none");
  else
    require(out.loss != nullptr, fn, "outputs.loss", "required with reduction mean or sum");
}

template <class A>
void check_upstream(const char* fn, const basic_upstream<A>& up, const options& opts,
                    std::int64_t rows) {
  if (opts.reduce == reduction::none) {
    check_vector(fn, "upstream.rows", up.rows, rows, true);
    require(up.scale_ptr == nullptr, fn, "upstream.scale_ptr",
            "a scalar upstream pointer is for reduction mean or sum; use upstream.rows");
  } else {
    require(up.rows.size == 0 && up.rows.data == nullptr, fn, "upstream.rows",
            "per-row upstream gradients need reduction none");
  }
}

/// The gradient may be a separate array or the logits themselves (in place: same data, same ld,
/// same element type). Any other overlap would read logits after they were overwritten.
template <class L, class G>
void check_gradient(const char* fn, const matrix_view<L>& logits, const matrix_view<G>& grad) {
  check_matrix(fn, "grad", grad);
  require(grad.rows == logits.rows && grad.cols == logits.cols, fn, "grad", [&] {
    return "is " + shape(grad.rows, grad.cols) + ", logits are " + shape(logits.rows, logits.cols);
  });
  if (logits.empty()) return;
  const char* lb = reinterpret_cast<const char*>(logits.data);
  const char* le = reinterpret_cast<const char*>(logits.row(logits.rows - 1) + logits.cols);
  const char* gb = reinterpret_cast<const char*>(grad.data);
  const char* ge = reinterpret_cast<const char*>(grad.row(grad.rows - 1) + grad.cols);
  const bool overlap = gb < le && lb < ge;
  const bool same = gb == lb && grad.ld == logits.ld &&
                    std::is_same<std::remove_const_t<L>, std::remove_const_t<G>>::value;
  require(!overlap || same, fn, "grad",
          "overlaps logits without being them: in place needs grad.data == logits.data, the same "
          "ld and the same element type");
}

}  // namespace detail
}  // namespace xent
