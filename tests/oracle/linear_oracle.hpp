// The float64 oracle of fused linear cross-entropy: the logits x · wᵀ + b in double, the
// cross-entropy oracle (oracle.hpp) on them, then
//   dx = G · w,   dw = Gᵀ · x,   db = column sums of G,
// with G the oracle's gradient of the (upstream-scaled) loss with respect to the logits. Plain
// loops, independent of the library, like oracle.hpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "oracle.hpp"

namespace oracle {

/// x (N x D), w (V x D) and b (V; empty for no bias), dense; `ce` holds the targets and the
/// options (its rows and cols are N and V; its logits are filled by evaluate_linear).
struct linear_problem {
  std::int64_t hidden = 0;
  std::vector<double> x, w, b;
  problem ce;
};

struct linear_result {
  result ce;                   ///< the cross-entropy oracle on the logits
  std::vector<double> logits;  ///< N x V: x · wᵀ + b, before any softcap
  /// N x V: sum_d |x_nd w_vd| + |b_v|, the size of the terms each logit sums (a float GEMM errs
  /// by a few ulps of it per term).
  std::vector<double> logit_magnitude;
  std::vector<double> dx, dw, db;  ///< only with an upstream gradient
};

inline linear_result evaluate_linear(linear_problem pb, const upstream* up = nullptr) {
  const std::int64_t N = pb.ce.rows, V = pb.ce.cols, D = pb.hidden;
  linear_result r;
  pb.ce.logits.assign(N * V, 0.0);
  r.logit_magnitude.assign(N * V, 0.0);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t v = 0; v < V; ++v) {
      double z = pb.b.empty() ? 0.0 : pb.b[v];
      double m = std::fabs(z);
      for (std::int64_t d = 0; d < D; ++d) {
        z += pb.x[n * D + d] * pb.w[v * D + d];
        m += std::fabs(pb.x[n * D + d] * pb.w[v * D + d]);
      }
      pb.ce.logits[n * V + v] = z;
      r.logit_magnitude[n * V + v] = m;
    }
  r.logits = pb.ce.logits;
  r.ce = evaluate(pb.ce, up);
  if (!up) return r;
  r.dx.assign(N * D, 0.0);
  r.dw.assign(V * D, 0.0);
  r.db.assign(V, 0.0);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t v = 0; v < V; ++v) {
      const double g = r.ce.grad[n * V + v];
      r.db[v] += g;
      for (std::int64_t d = 0; d < D; ++d) {
        r.dx[n * D + d] += g * pb.w[v * D + d];
        r.dw[v * D + d] += g * pb.x[n * D + d];
      }
    }
  return r;
}

/// The scalar whose gradients evaluate_linear returns (see oracle::objective).
inline double linear_objective(const linear_problem& pb, const upstream& up) {
  const linear_result r = evaluate_linear(pb);
  if (pb.ce.reduce != reduction::none) return up.scale * r.ce.loss;
  double s = 0.0;
  for (std::int64_t n = 0; n < pb.ce.rows; ++n)
    s += (up.rows.empty() ? up.scale : up.rows[n]) * r.ce.row_loss[n];
  return s;
}

}  // namespace oracle
