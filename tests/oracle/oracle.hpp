// The float64 oracle every xent test is judged against.
//
// Written plainly and on purpose independently of the library: it includes nothing of xent and
// follows the textbook formulas of ANCHORS.md ("Semantics to match"), one row at a time, in double:
//
//   z_c    = softcap * tanh(x_c / softcap)   (z = x when softcap is 0)
//   lse    = m + log(sum_c exp(z_c - m)),    m = max_c z_c
//   log p  = z - lse
//   t'_c   = (1 - eps) t_c + eps / V         (t one-hot at y for class ids)
//   l      = -sum_c w_c t'_c log p_c + z_loss * lse^2
//   dl/dz_j = (sum_c w_c t'_c) p_j - w_j t'_j + 2 z_loss lse p_j
//   dl/dx_j = dl/dz_j * (1 - tanh^2(x_j / softcap))
//
// Reductions: none keeps l_n; sum adds them; mean divides the sum by W = sum of w[y_n] over rows
// that are not ignored (N for soft targets); every row ignored (or N = 0) gives NaN under mean.
// Ignored rows (class ids only) are not read: loss 0, lse 0, argmax -1, gradient 0. The gradient
// is of the reduced loss times the upstream gradient: a scalar for mean and sum, per row for none.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace oracle {

enum class reduction { none, mean, sum };

/// One problem, all in double. Logits are dense N x V (row n at n * cols).
struct problem {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<double> logits;

  bool soft = false;
  std::vector<std::int64_t> targets;  ///< class ids (soft == false), N entries
  std::vector<double> probs;          ///< soft targets (soft == true), dense N x V

  reduction reduce = reduction::mean;
  std::int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  std::vector<double> weights;  ///< empty: every weight is 1
  double z_loss = 0.0;
  double softcap = 0.0;

  double x(std::int64_t n, std::int64_t c) const { return logits[n * cols + c]; }
  double weight(std::int64_t c) const { return weights.empty() ? 1.0 : weights[c]; }
  bool ignored(std::int64_t n) const { return !soft && targets[n] == ignore_index; }
};

/// The upstream gradient: `scale` for mean / sum; for none `rows[n]` (or `scale` when empty).
struct upstream {
  double scale = 1.0;
  std::vector<double> rows;
};

struct result {
  std::vector<double> row_loss;
  std::vector<double> lse;
  std::vector<std::int64_t> argmax;
  std::int64_t num_correct = 0;
  double loss = 0.0;      ///< reduced loss (mean / sum); the plain sum under none
  double normalizer = 0;  ///< W
  std::vector<double> z;  ///< soft-capped logits, dense N x V (for tie-aware argmax checks)
  /// For tolerances: per row, the sum of the magnitudes of the terms the loss is made of, so a
  /// float computation of l has an error of a few ulps of this (cancellation included).
  std::vector<double> row_magnitude;
  std::vector<double> grad;  ///< dense N x V, only when asked for
  /// Per gradient element, |g| (|alpha| p_j + |w_j t'_j|) * slope: the size of the terms whose
  /// difference the element is, so a float computation errs by a few ulps of this.
  std::vector<double> grad_magnitude;
};

inline double capped(const problem& pb, double x) {
  return pb.softcap > 0.0 ? pb.softcap * std::tanh(x / pb.softcap) : x;
}

inline double capped_slope(const problem& pb, double x) {
  if (!(pb.softcap > 0.0)) return 1.0;
  const double t = std::tanh(x / pb.softcap);
  return 1.0 - t * t;
}

/// t'_c of row n (without the weight).
inline double smoothed_target(const problem& pb, std::int64_t n, std::int64_t c) {
  const double eps = pb.label_smoothing;
  const double t = pb.soft ? pb.probs[n * pb.cols + c] : (c == pb.targets[n] ? 1.0 : 0.0);
  return (1.0 - eps) * t + eps / static_cast<double>(pb.cols);
}

/// w_c t'_c of row n as PyTorch forms it: class ids without smoothing are nll_loss, which reads
/// w_y alone, so another class adds nothing whatever its weight (inf and NaN included); soft
/// targets and smoothing weigh every class.
inline double weighted_target(const problem& pb, std::int64_t n, std::int64_t c) {
  if (!pb.soft && pb.label_smoothing == 0.0 && c != pb.targets[n]) return 0.0;
  return pb.weight(c) * smoothed_target(pb, n, c);
}

/// Evaluates everything; the gradient too when `up` is given.
inline result evaluate(const problem& pb, const upstream* up = nullptr) {
  const std::int64_t N = pb.rows, V = pb.cols;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  result r;
  r.row_loss.assign(N, 0.0);
  r.lse.assign(N, 0.0);
  r.argmax.assign(N, -1);
  r.row_magnitude.assign(N, 0.0);
  r.z.assign(N * V, 0.0);
  if (up) r.grad.assign(N * V, 0.0);
  if (up) r.grad_magnitude.assign(N * V, 0.0);

  // W, the mean's normalizer.
  double W = 0.0;
  for (std::int64_t n = 0; n < N; ++n) {
    if (pb.soft)
      W += 1.0;
    else if (!pb.ignored(n))
      W += pb.weight(pb.targets[n]);
  }
  r.normalizer = W;

  double total = 0.0;
  std::vector<double> z(V), logp(V);
  for (std::int64_t n = 0; n < N; ++n) {
    for (std::int64_t c = 0; c < V; ++c) r.z[n * V + c] = capped(pb, pb.x(n, c));
    if (pb.ignored(n)) continue;
    for (std::int64_t c = 0; c < V; ++c) z[c] = r.z[n * V + c];

    // argmax: first index of the largest value, NaN counting as largest (torch.argmax).
    std::int64_t am = 0;
    for (std::int64_t c = 1; c < V; ++c) {
      const bool best_nan = std::isnan(z[am]);
      if (!best_nan && (std::isnan(z[c]) || z[c] > z[am])) am = c;
    }
    r.argmax[n] = am;
    if (!pb.soft && am == pb.targets[n]) ++r.num_correct;

    // log-sum-exp with the maximum subtracted; a NaN anywhere makes it NaN.
    double m = -std::numeric_limits<double>::infinity();
    bool has_nan = false;
    for (std::int64_t c = 0; c < V; ++c) {
      if (std::isnan(z[c])) has_nan = true;
      if (z[c] > m) m = z[c];
    }
    double lse;
    if (has_nan) {
      lse = nan;
    } else {
      double s = 0.0;
      for (std::int64_t c = 0; c < V; ++c) s += std::exp(z[c] - m);
      lse = m + std::log(s);
    }
    r.lse[n] = lse;
    for (std::int64_t c = 0; c < V; ++c) logp[c] = z[c] - lse;

    // l = -sum_c w_c t'_c log p_c + z_loss lse^2, with the terms PyTorch forms: class ids
    // (1 - eps) (-w_y log p_y), plus for eps > 0 (eps / V) (-sum_c w_c log p_c) over every class;
    // soft targets -sum_c w_c t'_c log p_c over every class. So a masked (-inf) logit makes a term
    // it enters 0 * -inf = NaN where its class has no mass there (a zero weight, a zero
    // probability), as in PyTorch, and +inf where it has some.
    double loss = 0.0, magnitude = 0.0, mass = 0.0;
    const double eps = pb.label_smoothing;
    if (pb.soft) {
      for (std::int64_t c = 0; c < V; ++c)
        loss -= pb.weight(c) * smoothed_target(pb, n, c) * logp[c];
    } else {
      const std::int64_t y = pb.targets[n];
      loss -= (1.0 - eps) * pb.weight(y) * logp[y];
      if (eps > 0.0) {
        double smooth = 0.0;
        for (std::int64_t c = 0; c < V; ++c) smooth -= pb.weight(c) * logp[c];
        loss += eps / static_cast<double>(V) * smooth;
      }
    }
    for (std::int64_t c = 0; c < V; ++c) {
      const double a = weighted_target(pb, n, c);
      mass += a;
      if (a != 0.0) magnitude += std::fabs(a) * (std::fabs(z[c]) + std::fabs(lse));
    }
    loss += pb.z_loss * lse * lse;
    magnitude += pb.z_loss * lse * lse;
    r.row_loss[n] = loss;
    r.row_magnitude[n] = magnitude;
    total += loss;

    if (up) {
      double g;
      if (pb.reduce == reduction::none)
        g = up->rows.empty() ? up->scale : up->rows[n];
      else if (pb.reduce == reduction::mean)
        g = W == 0.0 ? nan : up->scale / W;  // PyTorch: its NaN mean's gradient is NaN
      else
        g = up->scale;
      const double alpha = mass + 2.0 * pb.z_loss * lse;
      for (std::int64_t j = 0; j < V; ++j) {
        const double p = std::exp(logp[j]);
        const double a = weighted_target(pb, n, j);
        const double slope = capped_slope(pb, pb.x(n, j));
        r.grad[n * V + j] = g * (alpha * p - a) * slope;
        // p = exp(z - lse) with z - lse formed in float carries about |z| + 2 |lse| roundings
        // of its own: the term grows with the row's scale (tests multiply magnitudes by 64 u).
        const double exponent = p > 0.0 ? 1.0 + (std::fabs(z[j]) + 2.0 * std::fabs(lse)) / 64.0
                                        : 1.0;  // z = -inf: p = 0
        r.grad_magnitude[n * V + j] =
            std::fabs(g) *
            ((mass + 2.0 * pb.z_loss * std::fabs(lse)) * p * exponent + std::fabs(a)) * slope;
      }
    }
  }
  // W = 0: NaN, as PyTorch's mean, also where a positive smoothing or z-loss total over 0 would
  // be +inf (its NLL term is 0 / 0 there).
  r.loss = pb.reduce == reduction::mean ? (W == 0.0 ? nan : total / W) : total;
  return r;
}

/// The scalar whose gradient `evaluate` returns: the reduced loss times the scalar upstream, or
/// sum_n g_n l_n under none. Used by the finite-difference checks of the oracle itself.
inline double objective(const problem& pb, const upstream& up) {
  const result r = evaluate(pb);
  if (pb.reduce != reduction::none) return up.scale * r.loss;
  double s = 0.0;
  for (std::int64_t n = 0; n < pb.rows; ++n)
    s += (up.rows.empty() ? up.scale : up.rows[n]) * r.row_loss[n];
  return s;
}

}  // namespace oracle
