// What the CUDA backend's test files share: a case of the float64 oracle comparison (spec), its
// check, and the entry-point calls the other files make, all defined in backend_values_test.cu.
//
// A call of a CUDA entry point instantiates every kernel of its dtype in the translation unit
// that makes it, and nvcc's device compile of those kernels is most of these tests' build time:
// so one file makes the calls, and the others call these (and include only light headers).
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>
#include <xent/cuda/cuda.cuh>
#include <xent/options.hpp>
#include <xent/views.hpp>

namespace xent_test {

/// One case of the oracle comparison: its shape, options and the layout of its buffers.
struct spec {
  std::int64_t rows = 7, cols = 1000, ld = 0;  // ld 0: cols
  xent::reduction reduce = xent::reduction::mean;
  float smoothing = 0.0f, z_loss = 0.0f, softcap = 0.0f;
  float spike = 0.0f;  ///< nonzero: one logit of each row, in its last columns, set to this
  bool weights = false, soft = false, some_ignored = false, all_ignored = false;
  bool last_ignored = false;  ///< the last row ignored too (a small batch's polling CTA's row)
  bool in_place = true, argmax = true;
  bool edge_targets = false;  ///< class ids at the edges of every cut of a row over 1..16 CTAs
  int edge_cluster = 0;       ///< nonzero: the edges of the cut over this many CTAs alone
  /// Class ids at the edges of the small-batch kernel's cut of rows at their own 16-byte
  /// boundaries (row_start::shifted: each rank lead(n) classes earlier), over this many CTAs.
  int shifted_cluster = 0;
  /// Class ids at the edges of the streaming kernels' tiles of this many elements, cut at each
  /// row's own 16-byte boundaries (tile k > 0 of row n starts at k span - lead(n)).
  std::int64_t shifted_span = 0;
  /// Elements by which the out-of-place gradient starts past a 256-byte boundary (the logits
  /// start on one): nonzero puts its rows' 16-byte boundaries elsewhere than the logits'.
  std::int64_t grad_offset = 0;
  std::int64_t ignore_index = -100;
  std::uint64_t seed = 1;
  std::string name() const {
    return std::to_string(rows) + "x" + std::to_string(cols) + " ld " + std::to_string(ld) +
           " red " + std::to_string(static_cast<int>(reduce)) + " eps " +
           std::to_string(smoothing) + " z " + std::to_string(z_loss) + " cap " +
           std::to_string(softcap) + (weights ? " weights" : "") + (soft ? " soft" : "") +
           (some_ignored ? " some-ign" : "") + (all_ignored ? " all-ign" : "") +
           (last_ignored ? " last-ign" : "") + (in_place ? " in-place" : " out-of-place") +
           (argmax ? " argmax" : "") + (edge_targets ? " edge-targets" : "") +
           (shifted_cluster ? " shifted-edges " + std::to_string(shifted_cluster) : "") +
           (shifted_span ? " shifted-tiles " + std::to_string(shifted_span) : "") +
           (grad_offset ? " grad-offset " + std::to_string(grad_offset) : "") +
           (spike != 0.0f ? " spike " + std::to_string(spike) : "");
  }
};

/// Plain class-id rows (no argmax: the kernels without option paths), every third ignored:
/// `rows` of shape.first classes at leading dimension shape.second (0: packed), reduced by `red`.
inline spec plain_rows(std::int64_t rows, std::pair<std::int64_t, std::int64_t> shape,
                       xent::reduction red) {
  spec s;
  s.rows = rows;
  s.cols = shape.first;
  s.ld = shape.second;
  s.reduce = red;
  s.some_ignored = true;
  s.argmax = false;
  return s;
}

/// `count` bfloat16 logits drawn from N(0, 2^2) by a std::mt19937 seeded with `seed`.
inline std::vector<Eigen::bfloat16> normal_bf16(std::size_t count, unsigned seed) {
  std::vector<Eigen::bfloat16> x(count);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (auto& v : x) v = Eigen::bfloat16(nd(rng));
  return x;
}

/// Runs forward, backward and forward_backward on the device for one spec and checks each against
/// the oracle evaluated on the same (rounded) inputs. Defined for float, bfloat16 and half.
template <class T>
void check_spec(const spec& s);

/// The entry-point calls of the tests outside the oracle comparison, one per form they use: each
/// calls xent's own entry point (argument checks included) and returns without synchronising.
namespace calls {

using bf16 = Eigen::bfloat16;
using ids64 = xent::vector_view<const std::int64_t>;

void forward(const xent::cuda& exec, xent::matrix_view<const float> logits, ids64 targets,
             const xent::options& opts, const xent::forward_outputs& out);

void forward_backward(const xent::cuda& exec, xent::matrix_view<const float> logits, ids64 targets,
                      const xent::options& opts, const xent::upstream& up,
                      const xent::forward_outputs& out, xent::matrix_view<float> grad);
void forward_backward(const xent::cuda& exec, xent::matrix_view<const bf16> logits, ids64 targets,
                      const xent::options& opts, const xent::upstream& up,
                      const xent::forward_outputs& out, xent::matrix_view<bf16> grad);
/// A float gradient of bfloat16 logits.
void forward_backward(const xent::cuda& exec, xent::matrix_view<const bf16> logits, ids64 targets,
                      const xent::options& opts, const xent::upstream& up,
                      const xent::forward_outputs& out, xent::matrix_view<float> grad);

void backward(const xent::cuda& exec, xent::matrix_view<const bf16> logits, ids64 targets,
              const xent::options& opts, xent::vector_view<const float> lse,
              const xent::upstream& up, xent::matrix_view<bf16> grad);

}  // namespace calls
}  // namespace xent_test
