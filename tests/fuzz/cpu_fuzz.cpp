// libFuzzer target over xent::cpu's entry points: forward, forward_backward, backward and the
// three fused linear calls. The input's bytes choose the call, the dtype (float, double, bfloat16,
// half), the shapes (0 included, ld >= cols, sizes past the CPU's 2048-element chunk and past its
// threading threshold), every loss option, the values (moderate, or with inf, NaN, huge and
// subnormal entries), the workspace (exact, one byte short, none) and at most one argument to
// spoil. What must hold:
//   - a spoiled argument throws xent::error before the loss output is written; nothing else may
//     escape, and a valid call may not throw;
//   - with moderate values, every result is finite where the float64 oracle's is, and the losses
//     (and the logit gradients of the plain calls) match it.
// Anything else aborts, which libFuzzer reports with the input that did it.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <vector>

#include "oracle/linear_oracle.hpp"
#include "xent/xent.hpp"

namespace {

using bf16 = Eigen::bfloat16;
using half = Eigen::half;

[[noreturn]] void fail(const char* what, double got = 0, double want = 0) {
  std::fprintf(stderr, "xent fuzz: %s (got %.17g, expected %.17g)\n", what, got, want);
  std::abort();
}

enum class call { forward, forward_backward, backward, linear_forward, linear_fb, linear_backward };
constexpr int calls = 6;

/// The one argument a case spoils (none: the call is valid and must succeed).
enum class spoil {
  none,
  ld,           // logits / hidden ld < cols
  negative,     // a negative row count
  class_id,     // a class id outside [0, V) that is not ignore_index
  smoothing,    // label_smoothing outside [0, 1]
  z_loss,       // negative or NaN
  softcap,      // negative, infinite, or so small that 1 / softcap overflows
  weights,      // class_weights of the wrong size
  reduce,       // not an enumerator
  output,       // the reduction's required output missing
  soft_shape,   // soft targets of the wrong shape
  num_correct,  // num_correct asked of soft targets
  upstream,     // per-row upstream of the wrong size, or with mean / sum
  lse,          // backward's LSE of the wrong size
  grad,         // gradient of the wrong shape / d_weight of the wrong shape
  bias,         // bias of the wrong size
  workspace,    // one byte short, or none at all
  count
};

/// T's value as a double, and a double rounded to T (bfloat16 and half through float, which is
/// what Eigen converts them from).
template <class T>
using wide_t = std::conditional_t<std::is_same<T, double>::value, double, float>;
template <class T>
double widen(T v) {
  return static_cast<double>(static_cast<wide_t<T>>(v));
}
template <class T>
T narrow(double v) {
  return static_cast<T>(static_cast<wide_t<T>>(v));
}

/// A case's random source: the fuzzer's bytes (zeros once they run out).
struct source {
  FuzzedDataProvider& f;
  int pick(int n) { return f.ConsumeIntegralInRange<int>(0, n - 1); }
  std::int64_t size(std::int64_t lo, std::int64_t hi) {
    return f.ConsumeIntegralInRange<std::int64_t>(lo, hi);
  }
  bool coin() { return f.ConsumeBool(); }
  double uniform(double lo, double hi) {
    return lo + (hi - lo) * f.ConsumeIntegral<std::uint16_t>() / 65535.0;
  }
  /// A logit (or hidden / weight value): moderate, or one of the extremes of T.
  template <class T>
  double value(bool extreme, double scale) {
    if (extreme && pick(4) == 0) {
      using lim = std::numeric_limits<T>;
      const double special[] = {widen(lim::infinity()),
                                -widen(lim::infinity()),
                                widen(lim::quiet_NaN()),
                                widen(lim::max()),
                                widen(lim::lowest()),
                                widen(lim::denorm_min()),
                                -0.0,
                                1e30};
      return widen(narrow<T>(special[pick(8)]));
    }
    return widen(narrow<T>(uniform(-scale, scale)));
  }
};

/// The options and targets of a case, and their float64 image for the oracle.
struct loss_case {
  xent::linear_options opts;
  std::vector<float> weights;
  bool soft = false;
  bool int32 = false;
  std::vector<std::int64_t> ids;
  std::vector<std::int32_t> ids32;
  std::vector<double> probs;  // N x V
  oracle::problem pb;

  void make(source& s, std::int64_t N, std::int64_t V, bool extreme) {
    const xent::reduction reductions[] = {xent::reduction::none, xent::reduction::mean,
                                          xent::reduction::sum};
    opts.reduce = reductions[s.pick(3)];
    const std::int64_t ignores[] = {-100, 0, 1, -1};
    opts.ignore_index = ignores[s.pick(4)];
    const float smoothing[] = {0.0f, 0.0f, 0.1f, 1.0f, static_cast<float>(s.uniform(0, 1))};
    opts.label_smoothing = smoothing[s.pick(5)];
    opts.z_loss = s.pick(3) == 0 ? static_cast<float>(s.uniform(0, 0.5)) : 0.0f;
    const float caps[] = {0.0f, 0.0f, 1.0f, 30.0f, static_cast<float>(s.uniform(0.05, 10))};
    opts.softcap = caps[s.pick(5)];
    opts.accumulate = s.coin() ? xent::dw_accumulation::fp32 : xent::dw_accumulation::output;
    if (s.pick(3) == 0) {
      for (std::int64_t v = 0; v < V; ++v)
        weights.push_back(s.pick(5) == 0 ? 0.0f : static_cast<float>(s.uniform(0, 4)));
      opts.class_weights = {weights.data(), V};
    }
    soft = V > 0 && s.pick(4) == 0;
    int32 = s.coin();
    for (std::int64_t n = 0; n < N; ++n) {
      if (soft) {
        double sum = 0;
        for (std::int64_t v = 0; v < V; ++v) {
          probs.push_back(extreme ? s.value<float>(true, 1) : s.uniform(0, 1));
          sum += probs.back();
        }
        if (!extreme && sum > 0)
          for (std::int64_t v = 0; v < V; ++v) probs[n * V + v] /= sum;
      } else {
        ids.push_back(s.pick(5) == 0 ? opts.ignore_index
                                     : s.size(0, std::max<std::int64_t>(V - 1, 0)));
        if (V == 0) ids.back() = opts.ignore_index;  // no class to name
      }
    }
    for (std::int64_t y : ids) ids32.push_back(static_cast<std::int32_t>(y));

    pb.rows = N;
    pb.cols = V;
    pb.soft = soft;
    pb.targets = ids;
    pb.reduce = static_cast<oracle::reduction>(static_cast<int>(opts.reduce));
    pb.ignore_index = opts.ignore_index;
    pb.label_smoothing = opts.label_smoothing;
    pb.weights.assign(weights.begin(), weights.end());
    pb.z_loss = opts.z_loss;
    pb.softcap = opts.softcap;
  }

  /// Spoils what `what` names in the options or targets; false when it does not apply here.
  bool spoil_options(spoil what, source& s, std::int64_t V) {
    switch (what) {
      case spoil::class_id: {
        if (soft || ids.empty()) return false;
        const std::int64_t bad[] = {V, -2, V + 1000};
        ids[0] = bad[s.pick(3)];
        if (ids[0] == opts.ignore_index) ids[0] = V + 7;
        ids32[0] = static_cast<std::int32_t>(ids[0]);
        return true;
      }
      case spoil::smoothing:
        opts.label_smoothing = s.coin() ? -0.25f : 1.5f;
        return true;
      case spoil::z_loss:
        opts.z_loss = s.coin() ? -1.0f : std::numeric_limits<float>::quiet_NaN();
        return true;
      case spoil::softcap: {
        const float bad[] = {-1.0f, std::numeric_limits<float>::infinity(), 1e-39f};
        opts.softcap = bad[s.pick(3)];
        return true;
      }
      case spoil::weights:
        weights.assign(static_cast<std::size_t>(V + 1), 1.0f);
        opts.class_weights = {weights.data(), V + 1};
        return true;
      case spoil::reduce:
        opts.reduce = static_cast<xent::reduction>(3);
        return true;
      default:
        return false;
    }
  }

  /// Calls f with the targets as the API takes them: class ids (int32 or int64) or soft targets
  /// of dtype T (N x V, or `soft_rows` rows when those are spoiled).
  template <class T, class F>
  void with_targets(std::int64_t N, std::int64_t V, std::vector<T>& soft_memory, bool bad_shape,
                    F&& f) {
    if (soft) {
      soft_memory.clear();
      for (double p : probs) soft_memory.push_back(narrow<T>(p));
      for (std::size_t i = 0; i < probs.size(); ++i) pb.probs.push_back(widen(soft_memory[i]));
      const std::int64_t rows = bad_shape ? N + 1 : N;
      soft_memory.resize(static_cast<std::size_t>(rows * V));
      f(xent::soft_targets<T>{xent::matrix_view<const T>(soft_memory.data(), rows, V)});
    } else if (int32) {
      f(xent::vector_view<const std::int32_t>(ids32.data(), static_cast<std::int64_t>(ids.size())));
    } else {
      f(xent::vector_view<const std::int64_t>(ids.data(), static_cast<std::int64_t>(ids.size())));
    }
  }
};

template <class A>
double tolerance() {
  return std::is_same<A, double>::value ? 1e-11 : 2e-4;
}

/// The loss outputs of one call, poisoned so that a throw can be seen to write nothing.
template <class A>
struct outputs {
  static constexpr float poison = 12345.0f;
  A loss = A(poison);
  std::vector<A> row_loss, lse;
  std::vector<std::int64_t> argmax;
  std::int64_t correct = -1;
  xent::basic_forward_outputs<A> view;

  outputs(std::int64_t N, const loss_case& c, bool drop_required, bool want_correct) {
    row_loss.assign(N, A(poison));
    lse.assign(N, A(poison));
    argmax.assign(N, -7);
    view.loss = &loss;
    view.row_loss = {row_loss.data(), N};
    view.lse = {lse.data(), N};
    view.argmax = {argmax.data(), N};
    if (want_correct) view.num_correct = &correct;
    if (drop_required) {
      if (c.opts.reduce == xent::reduction::none)
        view.row_loss = {};
      else
        view.loss = nullptr;
    }
  }
  bool untouched() const { return loss == A(poison); }
};

/// |got - want| within the float (or double) error of a sum whose terms are `magnitude` in size;
/// want not finite: nothing to hold got to (an infinite or NaN exact answer is not checked).
void expect_close(const char* what, double got, double want, double magnitude, double tol) {
  if (!std::isfinite(want)) return;
  if (!std::isfinite(got)) fail(what, got, want);
  if (std::fabs(got - want) > tol * (magnitude + std::fabs(want)) + 1e-30) fail(what, got, want);
}

template <class A>
void expect_loss(const outputs<A>& o, const oracle::result& r, const loss_case& c,
                 double extra_magnitude) {
  const double tol = tolerance<A>();
  const std::int64_t N = static_cast<std::int64_t>(r.row_loss.size());
  double total_magnitude = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    const double m = r.row_magnitude[n] + extra_magnitude;
    total_magnitude += m;
    if (o.view.row_loss.data) expect_close("row loss", o.row_loss[n], r.row_loss[n], m, tol);
    if (o.view.lse.data) expect_close("lse", o.lse[n], r.lse[n], m, tol);
  }
  if (c.opts.reduce != xent::reduction::none && o.view.loss) {
    const double scale = c.opts.reduce == xent::reduction::mean
                             ? 1.0 / std::max(std::fabs(r.normalizer), 1e-300)
                             : 1;
    expect_close("reduced loss", o.loss, r.loss, total_magnitude * scale, tol);
  }
}

/// What a call needs besides its targets: the logits (or hidden, weight, bias), gradients and
/// the workspace, for dtype T.
template <class T>
struct one_case {
  using A = xent::accumulator_t<T>;
  source& s;
  call op;
  spoil bad;
  bool extreme;
  loss_case c;
  std::int64_t N = 0, V = 0, D = 0, pad = 0;
  xent::cpu exec;
  std::vector<T> soft_memory;

  one_case(source& s_, call op_, spoil bad_, bool extreme_, int threads)
      : s(s_), op(op_), bad(bad_), extreme(extreme_), exec(threads) {}

  bool linear() const { return op >= call::linear_forward; }
  bool training() const { return op != call::forward && op != call::linear_forward; }

  /// Runs `f`; a spoiled case must throw xent::error and leave `o` untouched, a valid one must
  /// not throw. Returns whether f completed.
  template <class F>
  bool expect(F&& f, const outputs<A>& o) {
    try {
      f();
    } catch (const xent::error&) {
      if (bad == spoil::none) fail("a valid call threw xent::error");
      if (!o.untouched()) fail("a refused call wrote its loss output");
      return false;
    }
    if (bad != spoil::none) fail("a spoiled argument was accepted", static_cast<double>(bad));
    return true;
  }

  xent::basic_upstream<A> upstream(std::vector<A>& rows) {
    xent::basic_upstream<A> up;
    up.scale = narrow<A>(s.uniform(-4, 4));
    if (c.opts.reduce == xent::reduction::none && s.coin()) {
      for (std::int64_t n = 0; n < N; ++n) rows.push_back(narrow<A>(s.uniform(-4, 4)));
      up.rows = {rows.data(), N};
    }
    if (bad == spoil::upstream) {
      if (c.opts.reduce == xent::reduction::none) {
        rows.resize(static_cast<std::size_t>(N + 1));
        up.rows = {rows.data(), N + 1};
      } else {  // any per-row upstream, of N rows or not (an empty one would mean none)
        rows.assign(static_cast<std::size_t>(N + 1), A(1));
        up.rows = {rows.data(), N + 1};
      }
    }
    return up;
  }
  /// The oracle's upstream: xent's row n gets scale * rows[n], the oracle's rows[n] alone.
  oracle::upstream oracle_upstream(const xent::basic_upstream<A>& up) const {
    oracle::upstream u;
    u.scale = static_cast<double>(up.scale);
    for (std::int64_t n = 0; n < up.rows.size; ++n)
      u.rows.push_back(u.scale * static_cast<double>(up.rows[n]));
    return u;
  }

  void run() {
    if (linear())
      run_linear();
    else
      run_plain();
  }

  // -------------------------------------------------------------------------------------------
  // forward, forward_backward, backward
  // -------------------------------------------------------------------------------------------
  void run_plain() {
    const int shape_class = s.pick(8);
    if (shape_class < 6) {
      N = s.size(0, 9);
      V = s.size(0, 40);
    } else if (shape_class == 6) {  // past the 2048-element chunk
      N = s.size(0, 3);
      V = s.size(2040, 2100);
    } else {  // past the threading threshold, rows fewer than threads (vocabulary slices)
      N = s.size(1, 3);
      V = (std::int64_t{1} << 16) / N + s.size(0, 9000);
    }
    if (N > 0 && V == 0) V = 1;  // a row needs a class (spoiled below otherwise)
    pad = s.size(0, 3);
    c.make(s, N, V, extreme);
    if (!applies()) bad = spoil::none;

    std::int64_t ld = V + pad, rows = N;
    if (bad == spoil::ld) ld = V - 1;
    if (bad == spoil::negative) rows = -1;
    std::vector<T> logits(static_cast<std::size_t>(std::max<std::int64_t>(N * (V + pad), 1)));
    c.pb.logits.assign(static_cast<std::size_t>(N * V), 0.0);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t v = 0; v < V; ++v) {
        const double x = s.value<T>(extreme, 12);
        logits[n * (V + pad) + v] = narrow<T>(x);
        c.pb.logits[n * V + v] = widen(logits[n * (V + pad) + v]);
      }
    const xent::matrix_view<const T> L(logits.data(), rows, V, ld);
    const bool want_correct = !c.soft || bad == spoil::num_correct;
    outputs<A> o(N, c, bad == spoil::output, want_correct);

    c.with_targets<T>(N, V, soft_memory, bad == spoil::soft_shape, [&](const auto& targets) {
      if (op == call::forward) {
        if (!expect([&] { xent::forward(exec, L, targets, c.opts, o.view); }, o)) return;
        check_plain(o, nullptr, nullptr);
        return;
      }
      // A gradient of dtype T, or in place over the logits.
      std::vector<T> grad_memory(logits.size());
      const bool in_place = s.coin();
      const std::int64_t grad_rows = bad == spoil::grad ? N + 1 : N;
      if (bad == spoil::grad) grad_memory.resize(static_cast<std::size_t>((N + 1) * (V + pad)));
      xent::matrix_view<T> grad(in_place && bad != spoil::grad ? logits.data() : grad_memory.data(),
                                grad_rows, V, V + pad);
      std::vector<A> up_rows;
      const auto up = upstream(up_rows);
      if (op == call::forward_backward) {
        if (!expect([&] { xent::forward_backward(exec, L, targets, c.opts, up, o.view, grad); }, o))
          return;
        const oracle::upstream u = oracle_upstream(up);
        check_plain(o, &grad, &u);
        return;
      }
      // backward: the LSE of a valid forward (unless the spoil is in what both calls take).
      outputs<A> f(N, c, false, false);
      if (bad == spoil::lse || bad == spoil::grad || bad == spoil::upstream) {
        xent::forward(exec, L, targets, c.opts, f.view);
      } else if (!expect([&] { xent::forward(exec, L, targets, c.opts, f.view); }, f)) {
        return;
      }
      const std::int64_t lse_size = bad == spoil::lse ? N + 1 : N;
      f.lse.resize(static_cast<std::size_t>(lse_size));
      const xent::vector_view<const A> lse(f.lse.data(), lse_size);
      if (!expect([&] { xent::backward(exec, L, targets, c.opts, lse, up, grad); }, o)) return;
      const oracle::upstream u = oracle_upstream(up);
      check_plain(f, &grad, &u);
    });
  }

  /// Whether `bad` can be spoiled in this case (applying the option and target spoils).
  bool applies() {
    switch (bad) {
      case spoil::none:
        return true;
      case spoil::ld:
        return (linear() ? D : V) >= 1 && N >= 1;
      case spoil::negative:
        return true;
      case spoil::output:  // row_loss is not required of zero rows
        return (op == call::forward || op == call::linear_forward) &&
               (N >= 1 || c.opts.reduce != xent::reduction::none);
      case spoil::soft_shape:
        return c.soft;
      case spoil::num_correct:
        return c.soft && op != call::backward && op != call::linear_backward;
      case spoil::upstream:
      case spoil::grad:
        return training() && (bad != spoil::grad || N >= 1 || linear());
      case spoil::lse:
        return op == call::backward || op == call::linear_backward;
      case spoil::bias:
      case spoil::workspace:
        return linear();
      default:
        return c.spoil_options(bad, s, V);
    }
  }

  /// Results against the oracle, with moderate values only; the gradient's finiteness and values
  /// where one was computed.
  void check_plain(const outputs<A>& o, const xent::matrix_view<T>* grad,
                   const oracle::upstream* u) {
    if (extreme) return;
    const oracle::result r = oracle::evaluate(c.pb, u);
    expect_loss(o, r, c, 0.0);
    if (!grad) return;
    const double out_unit = std::is_same<T, bf16>::value   ? 1.0 / 128
                            : std::is_same<T, half>::value ? 1.0 / 1024
                                                           : 0.0;
    for (std::int64_t n = 0; n < N; ++n) {
      double zmax = 0;
      for (std::int64_t v = 0; v < V; ++v) zmax = std::max(zmax, std::fabs(r.z[n * V + v]));
      const double growth = 1 + zmax + std::fabs(r.lse[n]);
      // Where tanh saturates in double (slope 0, gradient 0) the float slope is still a few ulps
      // of 1, times the unsloped gradient: at most the upstream times 2 + 2 z_loss |lse| per unit
      // of class weight.
      const double up =
          u ? std::max(std::fabs(u->scale), u->rows.empty() ? 0.0 : std::fabs(u->rows[n])) : 1.0;
      const double saturated =
          0x1p-19 * std::max(1.0, up) * (2 + 2 * std::fabs(c.pb.z_loss * r.lse[n]));
      for (std::int64_t v = 0; v < V; ++v) {
        const double want = r.grad[n * V + v], got = widen((*grad)(n, v));
        // Under softcap the float slope 1 - tanh^2 errs by a few ulps of 1, not of itself (it is
        // 0 in float where tanh rounds to 1): the terms before the slope times 2^-20.
        const double slope = oracle::capped_slope(c.pb, c.pb.x(n, v));
        const double unsloped = slope > 0 ? r.grad_magnitude[n * V + v] / slope : 0.0;
        const double tol = tolerance<A>() * r.grad_magnitude[n * V + v] * growth +
                           (c.pb.softcap > 0 ? unsloped * 0x1p-20 : 0.0) +
                           out_unit * std::fabs(want) +
                           widen(std::numeric_limits<T>::denorm_min()) * 4 +
                           (c.pb.softcap > 0 && slope == 0 ? saturated : 0.0);
        if (!std::isfinite(want)) continue;
        if (!std::isfinite(got) || std::fabs(got - want) > tol) fail("logit gradient", got, want);
      }
    }
  }

  // -------------------------------------------------------------------------------------------
  // linear_forward, linear_forward_backward, linear_backward
  // -------------------------------------------------------------------------------------------
  void run_linear() {
    N = s.size(0, 8);
    D = s.size(0, 24);
    V = s.size(0, 40);
    if (N > 0 && V == 0) V = 1;
    pad = s.size(0, 3);
    const bool has_bias = s.coin();
    c.make(s, N, V, extreme);
    if (!applies()) bad = spoil::none;

    std::int64_t ld = D + pad, rows = N;
    if (bad == spoil::ld) ld = D - 1;
    if (bad == spoil::negative) rows = -1;
    oracle::linear_problem lp;
    lp.hidden = D;
    std::vector<T> x, w, b;
    auto fill = [&](std::vector<T>& m, std::vector<double>& image, std::int64_t r) {
      m.assign(static_cast<std::size_t>(r * (D + pad)), T(0.0f));
      for (std::int64_t i = 0; i < r; ++i)
        for (std::int64_t d = 0; d < D; ++d) {
          m[i * (D + pad) + d] = narrow<T>(s.value<T>(extreme, 2));
          image.push_back(widen(m[i * (D + pad) + d]));
        }
    };
    fill(x, lp.x, N);
    fill(w, lp.w, V);
    if (has_bias)
      for (std::int64_t v = 0; v < V; ++v) {
        b.push_back(narrow<T>(s.value<T>(extreme, 2)));
        lp.b.push_back(widen(b.back()));
      }
    // Zero columns: no memory behind the views, as a caller with D = 0 may pass.
    const xent::matrix_view<const T> hidden(D == 0 ? nullptr : x.data(), rows, D, ld);
    const xent::matrix_view<const T> weight(D == 0 ? nullptr : w.data(), V, D, D + pad);
    std::vector<T> long_bias(static_cast<std::size_t>(V + 1), T(0.0f));
    const xent::vector_view<const T> bias =
        bad == spoil::bias ? xent::vector_view<const T>(long_bias.data(), V + 1)
        : has_bias         ? xent::vector_view<const T>(b.data(), V)
                           : xent::vector_view<const T>{};

    const bool want_correct = !c.soft || bad == spoil::num_correct;
    outputs<A> o(N, c, bad == spoil::output, want_correct);
    const xent::linear_pass pass =
        training() ? xent::linear_pass::training : xent::linear_pass::forward;

    // Gradients of dtype T: each present or absent; d_weight of the wrong shape when spoiled.
    std::vector<T> dx(static_cast<std::size_t>(N * (D + pad) + 1)),
        dw(static_cast<std::size_t>((V + 1) * (D + pad) + 1)), db(static_cast<std::size_t>(V + 1));
    xent::linear_grads<T> grads;
    if (s.coin()) grads.d_hidden = {dx.data(), N, D, D + pad};
    if (s.coin() || bad == spoil::grad)
      grads.d_weight = {dw.data(), bad == spoil::grad ? V + 1 : V, D, D + pad};
    if (has_bias && s.coin()) grads.d_bias = {db.data(), V};
    const bool has_dw = grads.d_weight.data != nullptr;
    std::vector<unsigned char> ws_memory;
    xent::linear_workspace ws = workspace(pass, has_dw, ws_memory);

    c.with_targets<T>(N, V, soft_memory, bad == spoil::soft_shape, [&](const auto& targets) {
      if (op == call::linear_forward) {
        if (!expect(
                [&] {
                  xent::linear_forward(exec, hidden, weight, bias, targets, c.opts, o.view, ws);
                },
                o))
          return;
        check_linear(o, lp, nullptr, grads);
        return;
      }
      std::vector<A> up_rows;
      const auto up = upstream(up_rows);
      const oracle::upstream u = oracle_upstream(up);
      if (op == call::linear_fb) {
        if (!expect(
                [&] {
                  xent::linear_forward_backward(exec, hidden, weight, bias, targets, c.opts, up,
                                                o.view, grads, ws);
                },
                o))
          return;
        check_linear(o, lp, &u, grads);
        return;
      }
      // linear_backward: the LSE of a valid forward, in a workspace of its own.
      outputs<A> f(N, c, false, false);
      std::vector<unsigned char> fws_memory;
      const bool forward_spoiled = bad != spoil::lse && bad != spoil::grad &&
                                   bad != spoil::upstream && bad != spoil::workspace;
      const auto fws = forward_spoiled ? workspace(xent::linear_pass::forward, has_dw, fws_memory)
                                       : exact_workspace(xent::linear_pass::forward, fws_memory);
      if (forward_spoiled) {
        if (!expect(
                [&] {
                  xent::linear_forward(exec, hidden, weight, bias, targets, c.opts, f.view, fws);
                },
                f))
          return;
      } else {
        xent::linear_forward(exec, hidden, weight, bias, targets, c.opts, f.view, fws);
      }
      const std::int64_t lse_size = bad == spoil::lse ? N + 1 : N;
      f.lse.resize(static_cast<std::size_t>(lse_size));
      const xent::vector_view<const A> lse(f.lse.data(), lse_size);
      if (!expect(
              [&] {
                xent::linear_backward(exec, hidden, weight, bias, targets, c.opts, lse, up, grads,
                                      ws);
              },
              o))
        return;
      check_linear(f, lp, &u, grads);
    });
  }

  /// The sizes a call of `pass` plans: a training call without d_weight plans the accumulation
  /// mode whose least workspace is smaller, whatever the options say (linear.hpp,
  /// planned_options).
  xent::linear_workspace_sizes planned_sizes(xent::linear_pass pass, bool has_dw) {
    const auto sizes = [&](xent::dw_accumulation a) {
      xent::linear_options o = c.opts;
      o.accumulate = a;
      return xent::linear_workspace_size<T, T>(exec, {N, D, V}, pass, o);
    };
    if (pass == xent::linear_pass::forward || has_dw) return sizes(c.opts.accumulate);
    const auto fp32 = sizes(xent::dw_accumulation::fp32);
    const auto output = sizes(xent::dw_accumulation::output);
    return fp32.minimal < output.minimal ? fp32 : output;
  }

  /// The least workspace the size query gives for the call's options, or the one for every row
  /// at once, for a valid call: what the query promises must be enough.
  xent::linear_workspace exact_workspace(xent::linear_pass pass,
                                         std::vector<unsigned char>& memory) {
    if (N < 0 || D < 0 || V < 0) return {};
    const auto asked = xent::linear_workspace_size<T, T>(exec, {N, D, V}, pass, c.opts);
    memory.assign(s.coin() ? asked.minimal : asked.bytes, 0);
    return {memory.data(), memory.size()};
  }

  /// exact_workspace, or with the workspace spoiled: one byte short of what the call plans, or
  /// none.
  xent::linear_workspace workspace(xent::linear_pass pass, bool has_dw,
                                   std::vector<unsigned char>& memory) {
    if (bad != spoil::workspace) return exact_workspace(pass, memory);
    const auto sizes = planned_sizes(pass, has_dw);
    // Nothing to be short of: a null pointer with a size instead.
    if (sizes.minimal == 0) return {nullptr, 1};
    if (s.coin()) return {};
    memory.assign(sizes.minimal - 1, 0);
    return {memory.data(), memory.size()};
  }

  void check_linear(const outputs<A>& o, oracle::linear_problem& lp, const oracle::upstream* u,
                    const xent::linear_grads<T>& grads) {
    // Gradients: finite wherever the oracle's are (moderate values only).
    if (extreme) return;
    lp.ce = c.pb;
    const oracle::linear_result r = oracle::evaluate_linear(lp, u);
    // A logit's float error is a few ulps of the magnitude of its D + 1 terms; a row loss carries
    // it times sum_v |dl/dz_v| <= (1 + smoothing) max weight + 2 z_loss |lse|.
    double wmax = 1;
    for (double wc : c.pb.weights) wmax = std::max(wmax, wc);
    double mag = 0;
    for (double m : r.logit_magnitude) mag = std::max(mag, m);
    double lse_max = 0;
    for (double l : r.ce.lse) lse_max = std::max(lse_max, std::fabs(l));
    const double spread = (D + 2) * mag * (2 * wmax + 2 * c.pb.z_loss * (lse_max + 1));
    expect_loss(o, r.ce, c, spread);
    if (!u) return;
    auto finite = [](const char* what, const std::vector<double>& want, const T* got,
                     std::int64_t rows, std::int64_t cols, std::int64_t ld) {
      if (!got) return;
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j)
          if (std::isfinite(want[i * cols + j]) && !std::isfinite(widen(got[i * ld + j])))
            fail(what, widen(got[i * ld + j]), want[i * cols + j]);
    };
    finite("d_hidden", r.dx, grads.d_hidden.data, N, D, D + pad);
    finite("d_weight", r.dw, grads.d_weight.data, V, D, D + pad);
    finite("d_bias", r.db, grads.d_bias.data, 1, V, V);
  }
};

template <class T>
void run_case(source& s, call op, spoil bad, bool extreme, int threads) {
  one_case<T> k(s, op, bad, extreme, threads);
  k.run();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider f(data, size);
  source s{f};
  const auto op = static_cast<call>(s.pick(calls));
  const int dtype = s.pick(4);
  // Most cases valid; the rest spoil one argument each.
  const auto bad =
      s.pick(2) == 0 ? spoil::none : static_cast<spoil>(s.pick(static_cast<int>(spoil::count)));
  const bool extreme = s.pick(4) == 0;
  const int threads = 1 + s.pick(3);
  switch (dtype) {
    case 0:
      run_case<float>(s, op, bad, extreme, threads);
      break;
    case 1:
      run_case<double>(s, op, bad, extreme, threads);
      break;
    case 2:
      run_case<bf16>(s, op, bad, extreme, threads);
      break;
    default:
      run_case<half>(s, op, bad, extreme, threads);
      break;
  }
  return 0;
}
