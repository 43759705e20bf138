// What the CPU tests share: a case description, data generated in double and rounded to the dtype
// under test, a runner that calls forward, backward and forward_backward on poisoned outputs, and
// the checks that hold each result to the float64 oracle (tests/oracle/oracle.hpp), which is fed
// the rounded values.
//
// Tolerances. xent computes in float from the rounded inputs, so a result errs by a few float ulps
// of the terms it is made of, not of the result: the oracle returns those magnitudes
// (row_magnitude, grad_magnitude) and every check is |got - ref| <= tol * magnitude. A gradient
// element p_j = exp(z_j - lse) carries the float error of z_j - lse, so its tolerance grows with
// 1 + |z_j| + |lse|. A bf16 / fp16 gradient is a float value rounded once: on top of that, half an
// ulp of the output type (2^-9 / 2^-12 of the value, doubled for margin) and the smallest
// subnormal step. Under softcap the float slope 1 - (z / cap)^2 adds a few ulps of 1, i.e. a
// relative error growing as 1 / slope. Per row, the max-abs error over the row maximum and the
// norm ratio ||got - ref|| / ||ref|| are reported with every failure. NaN passes only where the
// oracle says NaN; an infinite reference must be matched exactly.
//
// float64 logits compute in double (xent::accumulator_t) from unrounded double data: the same
// error budget counted in double ulps (tolerance_scale), about 1e-14 of the terms' magnitude.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "oracle/oracle.hpp"
#include "xent/xent.hpp"

namespace xt {

using bf16 = Eigen::bfloat16;
using half = Eigen::half;

// ---------------------------------------------------------------------------------------------
// dtypes
// ---------------------------------------------------------------------------------------------

template <class T>
double to_double(T v) {
  if constexpr (std::is_same<T, double>::value) {
    return v;
  } else {
    return static_cast<double>(static_cast<float>(v));
  }
}

template <class T>
T from_double(double v) {
  if constexpr (std::is_same<T, double>::value) {
    return v;
  } else {
    return static_cast<T>(static_cast<float>(v));
  }
}

template <class T>
const char* dtype_name() {
  if (std::is_same<T, double>::value) return "f64";
  if (std::is_same<T, float>::value) return "f32";
  if (std::is_same<T, bf16>::value) return "bf16";
  return "f16";
}

/// Unit roundoff of an output dtype (half an ulp of 1).
template <class T>
double unit_roundoff() {
  if (std::is_same<T, double>::value) return std::ldexp(1.0, -53);
  if (std::is_same<T, float>::value) return std::ldexp(1.0, -24);
  if (std::is_same<T, bf16>::value) return std::ldexp(1.0, -8);  // 8 significant bits
  return std::ldexp(1.0, -11);                                   // 11 significant bits
}

/// The spacing of the subnormals of an output dtype: the absolute error floor of one rounding.
template <class T>
double subnormal_step() {
  if (std::is_same<T, double>::value) return std::ldexp(1.0, -1074);
  if (std::is_same<T, float>::value) return std::ldexp(1.0, -149);
  if (std::is_same<T, bf16>::value) return std::ldexp(1.0, -133);
  return std::ldexp(1.0, -24);
}

/// What the float tolerances (spec::fwd_tol, bwd_tol: float ulps of the terms) are multiplied by
/// for a call accumulating in A: 1 for float; for double, the ratio of the unit roundoffs (the
/// same count of double ulps) times 4, as the double oracle's own rounding is now of the same size.
template <class A>
double tolerance_scale() {
  return std::is_same<A, double>::value ? 4 * unit_roundoff<double>() / unit_roundoff<float>()
                                        : 1.0;
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// Two vectors bit for bit; memcmp is not called on an empty one, whose null data would be
/// undefined behaviour even for zero bytes.
template <class T>
bool same_vector_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
T sentinel() {
  return static_cast<T>(12345.0f);
}

// ---------------------------------------------------------------------------------------------
// A case
// ---------------------------------------------------------------------------------------------

enum class target_kind { int32, int64, soft };
enum class ignore_mode { none, some, all };
/// mean / sum: plain scale, or also scale_ptr. none: scale only (rows empty), or per-row values.
enum class upstream_mode { scale, pointer_or_rows };

struct spec {
  std::int64_t rows = 3;
  std::int64_t cols = 5;
  std::int64_t pad = 0;  ///< ld = cols + pad (logits, grad and soft targets)
  target_kind kind = target_kind::int64;
  xent::reduction reduce = xent::reduction::mean;
  ignore_mode ignore = ignore_mode::none;
  std::int64_t ignore_index = -100;
  float label_smoothing = 0.0f;
  bool weights = false;
  float z_loss = 0.0f;
  float softcap = 0.0f;
  int threads = 1;
  std::int64_t chunk = 0;
  bool in_place = false;
  upstream_mode up = upstream_mode::scale;
  float scale = 0.75f;
  double sigma = 2.0;  ///< logits ~ N(0, sigma)
  std::uint64_t seed = 1;
  /// Relative tolerances of float results (loss, lse, gradient before output rounding); 0 picks
  /// the defaults from the vocabulary size.
  double forward_tol = 0.0;
  double grad_tol = 0.0;

  std::int64_t ld() const { return cols + pad; }
  // Defaults: 2e-6 (4e-6 past 4096 classes) of the terms' magnitude for the loss and LSE, 5e-7
  // (1e-6) of the element's magnitude times (1 + |z_j| + |lse|) for the gradient: about 8 float
  // ulps of each, and at least 4x the largest error seen over the whole matrix (measured by
  // scaling these down until cases failed).
  double fwd_tol() const { return forward_tol > 0 ? forward_tol : (cols > 4096 ? 4e-6 : 2e-6); }
  double bwd_tol() const { return grad_tol > 0 ? grad_tol : (cols > 4096 ? 1e-6 : 5e-7); }

  std::string describe() const {
    static const char* kinds[] = {"int32", "int64", "soft"};
    static const char* reds[] = {"none", "mean", "sum"};
    static const char* igs[] = {"none", "some", "all"};
    std::ostringstream o;
    o << "rows=" << rows << " cols=" << cols << " ld=" << ld()
      << " targets=" << kinds[static_cast<int>(kind)]
      << " reduce=" << reds[static_cast<int>(reduce)];
    if (kind != target_kind::soft)
      o << " ignore=" << igs[static_cast<int>(ignore)] << "(" << ignore_index << ")";
    o << " eps=" << label_smoothing << " weights=" << weights << " z_loss=" << z_loss
      << " softcap=" << softcap << " threads=" << threads << " chunk=" << chunk
      << " in_place=" << in_place
      << " upstream=" << (up == upstream_mode::scale ? "scale" : "ptr/rows") << " scale=" << scale
      << " sigma=" << sigma << " seed=" << seed;
    return o.str();
  }
};

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

/// The inputs of one case, in the dtype under test, with the padding columns of every matrix
/// holding a sentinel.
template <class T>
struct dataset {
  using acc = xent::accumulator_t<T>;  ///< the call's outputs and upstream gradient

  spec s;
  std::vector<T> logits;  ///< rows x ld
  std::vector<std::int32_t> t32;
  std::vector<std::int64_t> t64;
  std::vector<T> probs;  ///< rows x ld (soft targets)
  std::vector<float> weights;
  acc scale_value = acc(1.5f);  ///< what upstream.scale_ptr points at
  std::vector<acc> up_rows;     ///< upstream.rows for reduction none

  std::int64_t target(std::int64_t n) const {
    return s.kind == target_kind::int32 ? t32[n] : t64[n];
  }
  void set_target(std::int64_t n, std::int64_t y) {
    if (s.kind == target_kind::int32)
      t32[n] = static_cast<std::int32_t>(y);
    else
      t64[n] = y;
  }
  T& x(std::int64_t n, std::int64_t c) { return logits[n * s.ld() + c]; }
  const T& x(std::int64_t n, std::int64_t c) const { return logits[n * s.ld() + c]; }

  xent::options options() const {
    xent::options o;
    o.reduce = s.reduce;
    o.ignore_index = s.ignore_index;
    o.label_smoothing = s.label_smoothing;
    if (s.weights) o.class_weights = {weights.data(), static_cast<std::int64_t>(weights.size())};
    o.z_loss = s.z_loss;
    o.softcap = s.softcap;
    return o;
  }

  xent::basic_upstream<acc> upstream() const {
    xent::basic_upstream<acc> u;
    u.scale = s.scale;
    if (s.up == upstream_mode::pointer_or_rows) {
      if (s.reduce == xent::reduction::none)
        u.rows = {up_rows.data(), static_cast<std::int64_t>(up_rows.size())};
      else
        u.scale_ptr = &scale_value;
    }
    return u;
  }

  xent::cpu exec() const { return xent::cpu(s.threads, s.chunk); }

  xent::matrix_view<const T> view() const { return {logits.data(), s.rows, s.cols, s.ld()}; }

  /// Calls f with the targets in the form the case asks for.
  template <class F>
  void with_targets(F&& f) const {
    switch (s.kind) {
      case target_kind::int32:
        f(xent::vector_view<const std::int32_t>(t32.data(), s.rows));
        break;
      case target_kind::int64:
        f(xent::vector_view<const std::int64_t>(t64.data(), s.rows));
        break;
      case target_kind::soft:
        // soft_targets<T> spelled out: xent::soft() of a const view does not compile (see
        // CompileCheck.SoftTargetsFromConstView).
        f(xent::soft_targets<T>{xent::matrix_view<const T>(probs.data(), s.rows, s.cols, s.ld())});
        break;
    }
  }

  oracle::problem problem() const {
    oracle::problem p;
    p.rows = s.rows;
    p.cols = s.cols;
    p.logits.resize(s.rows * s.cols);
    for (std::int64_t n = 0; n < s.rows; ++n)
      for (std::int64_t c = 0; c < s.cols; ++c) p.logits[n * s.cols + c] = to_double(x(n, c));
    p.soft = s.kind == target_kind::soft;
    if (p.soft) {
      p.probs.resize(s.rows * s.cols);
      for (std::int64_t n = 0; n < s.rows; ++n)
        for (std::int64_t c = 0; c < s.cols; ++c)
          p.probs[n * s.cols + c] = to_double(probs[n * s.ld() + c]);
    } else {
      p.targets.resize(s.rows);
      for (std::int64_t n = 0; n < s.rows; ++n) p.targets[n] = target(n);
    }
    p.reduce = static_cast<oracle::reduction>(static_cast<int>(s.reduce));
    static_assert(static_cast<int>(xent::reduction::none) == 0 &&
                      static_cast<int>(xent::reduction::mean) == 1 &&
                      static_cast<int>(xent::reduction::sum) == 2,
                  "oracle::reduction mirrors xent::reduction");
    p.ignore_index = s.ignore_index;
    p.label_smoothing = static_cast<double>(s.label_smoothing);
    if (s.weights) p.weights.assign(weights.begin(), weights.end());
    p.z_loss = static_cast<double>(s.z_loss);
    p.softcap = static_cast<double>(s.softcap);
    return p;
  }

  oracle::upstream oracle_upstream() const {
    oracle::upstream u;
    u.scale = static_cast<double>(s.scale);
    if (s.up == upstream_mode::pointer_or_rows) {
      if (s.reduce == xent::reduction::none) {
        for (acc r : up_rows) u.rows.push_back(static_cast<double>(s.scale) * r);
      } else {
        u.scale *= static_cast<double>(scale_value);
      }
    }
    return u;
  }
};

/// Random inputs for a case: logits ~ N(0, sigma) rounded to T; class ids uniform, a quarter of
/// them set to the row's argmax (so num_correct counts something); ignored rows as the case says;
/// soft targets a random distribution with some exact zeros; weights in [0.25, 2].
template <class T>
dataset<T> make_dataset(const spec& s) {
  dataset<T> d;
  d.s = s;
  std::mt19937_64 rng(s.seed * 0x9E3779B97F4A7C15ull + 12345);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const std::int64_t ld = s.ld();
  d.logits.assign(s.rows * ld, sentinel<T>());
  for (std::int64_t n = 0; n < s.rows; ++n)
    for (std::int64_t c = 0; c < s.cols; ++c) d.x(n, c) = from_double<T>(s.sigma * normal(rng));

  if (s.kind == target_kind::soft) {
    d.probs.assign(s.rows * ld, sentinel<T>());
    std::vector<double> row(s.cols);
    for (std::int64_t n = 0; n < s.rows; ++n) {
      double total = 0.0;
      for (std::int64_t c = 0; c < s.cols; ++c) {
        row[c] = uniform(rng) < 0.2 ? 0.0 : std::exp(1.5 * normal(rng));
        total += row[c];
      }
      for (std::int64_t c = 0; c < s.cols; ++c)
        d.probs[n * ld + c] = from_double<T>(total > 0 ? row[c] / total : 1.0 / s.cols);
    }
  } else {
    d.t32.assign(s.rows, 0);
    d.t64.assign(s.rows, 0);
    std::vector<bool> ignore(s.rows, s.ignore == ignore_mode::all);
    if (s.ignore == ignore_mode::some) {
      for (std::int64_t n = 0; n < s.rows; ++n) ignore[n] = uniform(rng) < 0.35;
      if (s.rows >= 2) {  // at least one of each
        ignore[0] = true;
        ignore[s.rows - 1] = false;
      }
    }
    for (std::int64_t n = 0; n < s.rows; ++n) {
      std::int64_t y;
      if (ignore[n]) {
        y = s.ignore_index;
      } else {
        y = std::uniform_int_distribution<std::int64_t>(0, s.cols - 1)(rng);
        if (uniform(rng) < 0.25) {  // the row's argmax (of the rounded logits)
          y = 0;
          for (std::int64_t c = 1; c < s.cols; ++c)
            if (to_double(d.x(n, c)) > to_double(d.x(n, y))) y = c;
        }
        // A valid ignore_index hides that class: draw again (V = 1 leaves it ignored).
        for (int tries = 0; y == s.ignore_index && tries < 64; ++tries)
          y = std::uniform_int_distribution<std::int64_t>(0, s.cols - 1)(rng);
      }
      d.set_target(n, y);
    }
  }
  d.weights.resize(s.cols);
  for (auto& w : d.weights) w = static_cast<float>(0.25 + 1.75 * uniform(rng));
  d.up_rows.resize(s.rows);
  for (auto& r : d.up_rows) r = static_cast<typename dataset<T>::acc>(uniform(rng) * 4.0 - 2.0);
  if (!d.up_rows.empty()) d.up_rows[0] = d.up_rows.size() > 2 ? 0 : d.up_rows[0];
  return d;
}

// ---------------------------------------------------------------------------------------------
// Outputs, poisoned, with a guard element on each side
// ---------------------------------------------------------------------------------------------

template <class U>
struct guarded {
  std::vector<U> buf;
  U poison;
  guarded(std::int64_t n, U poison_) : buf(n + 2, poison_), poison(poison_) {}
  U* data() { return buf.data() + 1; }
  std::int64_t size() const { return static_cast<std::int64_t>(buf.size()) - 2; }
  const U& operator[](std::int64_t i) const { return buf[i + 1]; }
  bool guards_intact() const {
    return same_bits(buf.front(), poison) && same_bits(buf.back(), poison);
  }
  xent::vector_view<U> view() { return {data(), size()}; }
};

/// Forward outputs of a call accumulating in A (float; double for float64 logits).
template <class A>
struct basic_forward_result {
  guarded<A> row_loss;
  guarded<A> lse;
  guarded<std::int64_t> argmax;
  guarded<A> loss{1, A(12345.0f)};
  guarded<std::int64_t> correct{1, -777};

  explicit basic_forward_result(std::int64_t rows)
      : row_loss(rows, A(12345.0f)), lse(rows, A(12345.0f)), argmax(rows, -777) {}

  /// Every output the case allows: `loss` only under mean / sum, `num_correct` only with class
  /// ids (soft targets have no class to be correct about; xent rejects it).
  xent::basic_forward_outputs<A> all(bool with_loss, bool soft) {
    xent::basic_forward_outputs<A> o;
    if (with_loss) o.loss = loss.data();
    o.row_loss = row_loss.view();
    o.lse = lse.view();
    o.argmax = argmax.view();
    if (!soft) o.num_correct = correct.data();
    return o;
  }
};
using forward_result = basic_forward_result<float>;

/// A gradient buffer rows x ld, poisoned, padding columns holding the sentinel.
template <class G>
std::vector<G> poisoned_grad(const spec& s) {
  return std::vector<G>(s.rows * s.ld(), sentinel<G>());
}

// ---------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------

inline std::string num(double v) {
  std::ostringstream o;
  o.precision(9);
  o << v;
  return o.str();
}

/// |got - ref| <= tol, NaN only where ref is NaN, infinities exactly.
inline bool close(double got, double ref, double tol) {
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isinf(ref)) return got == ref;
  return std::fabs(got - ref) <= tol;  // false for NaN got
}

/// Checks forward outputs against the oracle (`r` from dataset::problem()).
template <class T, class A = xent::accumulator_t<T>>
std::string check_forward(const dataset<T>& d, const oracle::result& r, basic_forward_result<A>& f,
                          bool expect_loss) {
  const spec& s = d.s;
  const double tol = s.fwd_tol() * tolerance_scale<A>(), u = unit_roundoff<A>();
  std::ostringstream err;
  auto fail = [&](const std::string& m) {
    if (err.tellp() < 2000) err << "  " << m << "\n";
  };
  if (!f.row_loss.guards_intact() || !f.lse.guards_intact() || !f.argmax.guards_intact() ||
      !f.loss.guards_intact() || !f.correct.guards_intact())
    fail("an output was written outside its range");
  double magnitude = 0.0;
  std::int64_t correct = 0;
  for (std::int64_t n = 0; n < s.rows; ++n) {
    double zmax = 0.0;
    for (std::int64_t c = 0; c < s.cols; ++c)
      if (std::isfinite(r.z[n * s.cols + c])) zmax = std::max(zmax, std::fabs(r.z[n * s.cols + c]));
    magnitude += r.row_magnitude[n];
    const bool ignored = s.kind != target_kind::soft && d.target(n) == s.ignore_index;
    std::ostringstream where;
    where << "row " << n << ": ";
    if (ignored) {
      if (!same_bits(f.row_loss[n], A(0)) || !same_bits(f.lse[n], A(0)) || f.argmax[n] != -1)
        fail(where.str() + "ignored row must have loss 0, lse 0, argmax -1; got " +
             num(f.row_loss[n]) + ", " + num(f.lse[n]) + ", " + std::to_string(f.argmax[n]));
      continue;
    }
    if (!close(f.row_loss[n], r.row_loss[n], tol * r.row_magnitude[n] + 1e-30))
      fail(where.str() + "row_loss " + num(f.row_loss[n]) + " vs oracle " + num(r.row_loss[n]) +
           " (tol " + num(tol * r.row_magnitude[n]) + ")");
    if (!close(f.lse[n], r.lse[n], tol * (1.0 + std::fabs(r.lse[n]) + zmax)))
      fail(where.str() + "lse " + num(f.lse[n]) + " vs oracle " + num(r.lse[n]));
    // argmax: the oracle's, or a different index whose capped logit is within float rounding of
    // the maximum (float soft-capping can tie or swap what double keeps apart). Exact ties in
    // double must resolve to the first index.
    const std::int64_t got = f.argmax[n], want = r.argmax[n];
    if (got != want) {
      bool ok = got >= 0 && got < s.cols;
      if (ok) {
        const double zg = r.z[n * s.cols + got], zw = r.z[n * s.cols + want];
        ok = !std::isnan(zw) && zg != zw && std::fabs(zg - zw) <= 8 * u * (std::fabs(zw) + 1e-30);
      }
      if (!ok)
        fail(where.str() + "argmax " + std::to_string(got) + " vs oracle " + std::to_string(want));
    }
    if (s.kind != target_kind::soft && got == d.target(n)) ++correct;
  }
  if (s.kind == target_kind::soft ? f.correct[0] != -777 : f.correct[0] != correct)
    fail("num_correct " + std::to_string(f.correct[0]) + " but the rows' argmax give " +
         std::to_string(correct) + " (oracle " + std::to_string(r.num_correct) + ")");
  if (expect_loss) {
    const double denom = s.reduce == xent::reduction::mean ? r.normalizer : 1.0;
    const double ltol = tol * magnitude / denom + 4 * u * std::fabs(r.loss);
    if (!close(f.loss[0], r.loss, ltol))
      fail("loss " + num(f.loss[0]) + " vs oracle " + num(r.loss) + " (tol " + num(ltol) + ")");
  } else if (!same_bits(f.loss[0], A(12345.0f))) {
    fail("loss written though it was not requested");
  }
  return err.str();
}

/// Checks a gradient (rows x ld at `g`) against the oracle's, and that padding kept its sentinel.
template <class T, class G>
std::string check_gradient(const dataset<T>& d, const oracle::result& r, const G* g) {
  using A = xent::accumulator_t<T>;
  const spec& s = d.s;
  const double tol = s.bwd_tol() * tolerance_scale<A>(), u = unit_roundoff<G>(),
               floor_step = subnormal_step<G>();
  std::ostringstream err;
  auto fail = [&](const std::string& m) {
    if (err.tellp() < 2000) err << "  " << m << "\n";
  };
  for (std::int64_t n = 0; n < s.rows; ++n) {
    for (std::int64_t c = s.cols; c < s.ld(); ++c)
      if (!same_bits(g[n * s.ld() + c], sentinel<G>())) {
        fail("row " + std::to_string(n) + ": padding column " + std::to_string(c) + " written");
        break;
      }
    const bool ignored = s.kind != target_kind::soft && d.target(n) == s.ignore_index;
    double rowmax = 0.0, err2 = 0.0, ref2 = 0.0, maxerr = 0.0;
    std::int64_t bad = -1;
    for (std::int64_t c = 0; c < s.cols; ++c) {
      const double got = to_double(g[n * s.ld() + c]);
      const double ref = r.grad[n * s.cols + c];
      if (ignored) {
        if (!same_bits(g[n * s.ld() + c], G(0.0f)) && bad < 0) bad = c;
        continue;
      }
      const double z = r.z[n * s.cols + c];
      double t = tol * (1.0 + (std::isfinite(z) ? std::fabs(z) : 0.0) + std::fabs(r.lse[n])) *
                 r.grad_magnitude[n * s.cols + c];
      if (s.softcap > 0 && std::isfinite(z)) {
        // The slope 1 - (z / cap)^2 is formed in A from the capped z: an absolute error of a
        // few ulps of 1, so relative to the slope it grows as 1 / slope where tanh saturates.
        const double slope = 1.0 - (z / s.softcap) * (z / s.softcap);
        if (slope > 0) t += 8 * unit_roundoff<A>() * r.grad_magnitude[n * s.cols + c] / slope;
      }
      if (!close(got, ref, t + u * (std::fabs(ref) + t) * 2 + floor_step) && bad < 0) bad = c;
      if (std::isfinite(ref)) {
        rowmax = std::max(rowmax, std::fabs(ref));
        maxerr = std::max(maxerr, std::fabs(got - ref));
        err2 += (got - ref) * (got - ref);
        ref2 += ref * ref;
      }
    }
    if (bad >= 0) {
      std::ostringstream m;
      m << "row " << n << (ignored ? " (ignored)" : "") << ": grad[" << bad
        << "] = " << to_double(g[n * s.ld() + bad]) << " vs oracle " << r.grad[n * s.cols + bad]
        << "; row max-abs error / row max = " << (rowmax > 0 ? maxerr / rowmax : maxerr)
        << ", ||err|| / ||ref|| = " << (ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2));
      fail(m.str());
    }
  }
  return err.str();
}

// ---------------------------------------------------------------------------------------------
// The runner
// ---------------------------------------------------------------------------------------------

/// Runs forward (all outputs, then the required ones only), backward from the LSE forward produced
/// and forward_backward (in place when the case says so and G == T), each on poisoned outputs, and
/// checks everything against the oracle, the lean forward against the full one bitwise, and
/// forward_backward's argmax / num_correct against forward's. Reports failures through gtest;
/// returns whether the case passed.
template <class T, class G = T>
bool run_case(const dataset<T>& d) {
  using A = xent::accumulator_t<T>;
  const spec& s = d.s;
  const oracle::problem pb = d.problem();
  const oracle::upstream oup = d.oracle_upstream();
  const oracle::result r = oracle::evaluate(pb, &oup);
  const xent::options opts = d.options();
  const xent::basic_upstream<A> up = d.upstream();
  const bool has_loss = s.reduce != xent::reduction::none;
  const bool soft = s.kind == target_kind::soft;
  std::string errors;
  auto note = [&](const char* what, const std::string& e) {
    if (!e.empty()) errors += std::string(what) + ":\n" + e;
  };
  const std::vector<T> original = d.logits;

  // forward, every output.
  basic_forward_result<A> fwd(s.rows);
  d.with_targets([&](auto targets) {
    xent::forward(d.exec(), d.view(), targets, opts, fwd.all(has_loss, soft));
  });
  note("forward", check_forward(d, r, fwd, has_loss));

  // forward, only what the reduction needs: same values, bitwise.
  {
    basic_forward_result<A> lean(s.rows);
    xent::basic_forward_outputs<A> o;
    if (has_loss)
      o.loss = lean.loss.data();
    else
      o.row_loss = lean.row_loss.view();
    d.with_targets([&](auto targets) { xent::forward(d.exec(), d.view(), targets, opts, o); });
    if (has_loss && !same_bits(lean.loss[0], fwd.loss[0]))
      note("forward (loss only)", "  loss " + std::to_string(lean.loss[0]) + " differs from " +
                                      std::to_string(fwd.loss[0]) + "\n");
    for (std::int64_t n = 0; !has_loss && n < s.rows; ++n)
      if (!same_bits(lean.row_loss[n], fwd.row_loss[n])) {
        note("forward (row_loss only)", "  row " + std::to_string(n) + " differs\n");
        break;
      }
    for (std::size_t i = 0; i < lean.lse.buf.size(); ++i)
      if (!same_bits(lean.lse.buf[i], A(12345.0f)) || lean.argmax.buf[i] != -777 ||
          (has_loss && !same_bits(lean.row_loss.buf[i], A(12345.0f)))) {
        note("forward (required outputs only)", "  an absent output was written\n");
        break;
      }
    if (lean.correct[0] != -777) note("forward (required outputs only)", "  num_correct written\n");
  }

  // backward from forward's LSE.
  std::vector<G> gb = poisoned_grad<G>(s);
  d.with_targets([&](auto targets) {
    xent::backward(d.exec(), d.view(), targets, opts,
                   xent::vector_view<const A>(fwd.lse.data(), s.rows), up,
                   xent::matrix_view<G>(gb.data(), s.rows, s.cols, s.ld()));
  });
  note("backward", check_gradient<T, G>(d, r, gb.data()));

  // forward_backward, in place (over a copy of the logits) or into a fresh poisoned buffer.
  basic_forward_result<A> fb(s.rows);
  std::vector<G> gfb;
  std::vector<T> work;
  const G* gfb_data = nullptr;
  bool in_place = false;
  if constexpr (std::is_same<T, G>::value) {
    if (s.in_place) {
      in_place = true;
      work = d.logits;
      const xent::matrix_view<T> L(work.data(), s.rows, s.cols, s.ld());
      d.with_targets([&](auto targets) {
        xent::forward_backward(d.exec(), L, targets, opts, up, fb.all(has_loss, soft), L);
      });
      gfb_data = work.data();
    }
  }
  if (!in_place) {
    gfb = poisoned_grad<G>(s);
    d.with_targets([&](auto targets) {
      xent::forward_backward(d.exec(), d.view(), targets, opts, up, fb.all(has_loss, soft),
                             xent::matrix_view<G>(gfb.data(), s.rows, s.cols, s.ld()));
    });
    gfb_data = gfb.data();
  }
  note("forward_backward", check_forward(d, r, fb, has_loss));
  note("forward_backward", check_gradient<T, G>(d, r, gfb_data));
  // forward_backward's discrete outputs = forward's. (Its float outputs are held to the oracle
  // like forward's; bitwise equality is CpuForwardBackward.*BitwiseEqualToForward's business.)
  {
    std::ostringstream m;
    if (fb.correct[0] != fwd.correct[0]) m << "  num_correct differs from forward's\n";
    for (std::int64_t n = 0; n < s.rows; ++n)
      if (fb.argmax[n] != fwd.argmax[n]) {
        m << "  row " << n << ": argmax " << fb.argmax[n] << " vs forward's " << fwd.argmax[n]
          << "\n";
        break;
      }
    note("forward_backward vs forward", m.str());
  }
  // The logits of out-of-place calls are untouched, padding included.
  if (!original.empty() &&
      std::memcmp(original.data(), d.logits.data(), original.size() * sizeof(T)) != 0)
    note("logits", "  changed by an out-of-place call\n");

  if (!errors.empty()) {
    ADD_FAILURE() << "case " << dtype_name<T>() << " -> " << dtype_name<G>() << " grad, "
                  << s.describe() << "\n"
                  << errors;
    return false;
  }
  return true;
}

/// What one call (or forward then backward) produced, for tests that compare xent with itself;
/// A is the call's accumulator (double for float64 logits).
template <class G, class A = float>
struct call_result {
  std::vector<A> row_loss, lse;
  std::vector<std::int64_t> argmax;
  A loss = A(12345.0f);
  std::int64_t correct = -777;
  std::vector<G> grad;  ///< rows x ld
};

/// forward_backward out of place (fused), or forward then backward from its LSE (not fused), with
/// every output the case allows, into `res` (its buffers are reused when already sized: results
/// may depend on addresses, see CpuDeterminism.ResultsDoNotDependOnBufferAddresses).
template <class T, class G>
void call_into(const dataset<T>& d, bool fused, call_result<G, xent::accumulator_t<T>>& res) {
  using A = xent::accumulator_t<T>;
  const spec& s = d.s;
  const bool has_loss = s.reduce != xent::reduction::none;
  const bool soft = s.kind == target_kind::soft;
  res.loss = A(12345.0f);
  res.correct = -777;
  res.row_loss.resize(s.rows);
  res.lse.resize(s.rows);
  res.argmax.resize(s.rows);
  res.grad.resize(s.rows * s.ld());
  std::fill(res.row_loss.begin(), res.row_loss.end(), A(12345.0f));
  std::fill(res.lse.begin(), res.lse.end(), A(12345.0f));
  std::fill(res.argmax.begin(), res.argmax.end(), -777);
  std::fill(res.grad.begin(), res.grad.end(), sentinel<G>());
  xent::basic_forward_outputs<A> o;
  if (has_loss) o.loss = &res.loss;
  o.row_loss = {res.row_loss.data(), s.rows};
  o.lse = {res.lse.data(), s.rows};
  o.argmax = {res.argmax.data(), s.rows};
  if (!soft) o.num_correct = &res.correct;
  const xent::matrix_view<G> grad(res.grad.data(), s.rows, s.cols, s.ld());
  d.with_targets([&](auto targets) {
    if (fused) {
      xent::forward_backward(d.exec(), d.view(), targets, d.options(), d.upstream(), o, grad);
    } else {
      xent::forward(d.exec(), d.view(), targets, d.options(), o);
      xent::backward(d.exec(), d.view(), targets, d.options(),
                     xent::vector_view<const A>(res.lse.data(), s.rows), d.upstream(), grad);
    }
  });
}

template <class T, class G = T>
call_result<G, xent::accumulator_t<T>> call(const dataset<T>& d, bool fused = true) {
  call_result<G, xent::accumulator_t<T>> res;
  call_into(d, fused, res);
  return res;
}

/// Runs many cases, stopping a test after a few failures so the log stays readable.
class case_budget {
 public:
  explicit case_budget(int max_failures = 5) : max_(max_failures) {}
  /// false once the budget is spent (the caller should stop).
  bool record(bool passed) {
    ++cases_;
    if (!passed && ++failures_ >= max_) {
      ADD_FAILURE() << "stopping after " << failures_ << " failing cases of " << cases_;
      return false;
    }
    return true;
  }
  int cases() const { return cases_; }

 private:
  int max_;
  int failures_ = 0;
  int cases_ = 0;
};

/// The argument that the xent::error thrown by `f` names, or "" when `f` throws none.
template <class F>
std::string thrown_argument(F&& f) {
  try {
    f();
  } catch (const xent::error& e) {
    return e.argument();
  }
  return "";
}

/// The harness's vocabulary, for test files to write unqualified: `using namespace xt::names;`.
namespace names {
using xent::reduction;
using xt::bf16;
using xt::half;
using xt::ignore_mode;
using xt::spec;
using xt::target_kind;
using xt::upstream_mode;
}  // namespace names

}  // namespace xt
