// What a row kernel is given and what it writes for each row: one launch's arguments by value
// (row_args), a row's forward outputs or a skipped row's, the soft-capped logit, a class's
// target mass and the row's upstream scale. Shared by the row, small-batch, warp-rows, streaming
// and vocab-parallel kernels. Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../../loss_math.hpp"
#include "../../options.hpp"
#include "../../parallel/records.hpp"
#include "dtype.cuh"
#include "row_sums.cuh"

namespace xent {
namespace cuda_detail {

enum class pass { forward, fused, backward };

/// Everything one launch needs, passed by value.
template <class T, class G, class Tgt>
struct row_args {
  const T* logits;
  std::int64_t ld, rows, cols;
  Tgt targets;
  const float* weights;  ///< null: all 1
  loss_constants k;
  std::int64_t ignore_index;
  reduction reduce;
  // forward outputs (each optional)
  float* loss;
  float* row_loss;
  float* lse_out;
  std::int64_t* argmax;
  std::int64_t* num_correct;
  // backward input and gradient
  const float* lse_in;
  G* grad;
  std::int64_t grad_ld;
  float scale;
  const float* scale_ptr;
  const float* up_rows;
  // bookkeeping
  void* workspace;
  unsigned long long* queue;  ///< the row queue's counter (workspace_header::rows_taken) or null
  int* error_count;
  int cluster;
  std::int64_t slice;       ///< classes per CTA
  std::int64_t chunk;       ///< classes per shared-memory stage
  std::int64_t chunks;      ///< stages per slice: 1 = the slice is resident
  std::size_t chunk_bytes;  ///< bytes per stage (16-byte multiple)
  bool want_argmax;
  /// The mean's normaliser is in the workspace header, summed by normalizer_kernel launched
  /// ahead of this kernel (a programmatic dependent launch).
  bool normalizer_ahead;
  // Vocab-parallel calls (cuda/vocab_parallel.cuh); an unsharded call has first 0, vocab = cols
  // and null pointers. The logits are classes [first, first + cols) of `vocab`: class ids stay
  // global (valid in [0, vocab)), a row's target column is y - first (outside [0, cols) when
  // another shard holds it), and `weights` points at the weight of column 0 (the caller's full
  // vector + first), so local columns index logits, soft targets and weights alike.
  std::int64_t first;
  std::int64_t vocab;
  record_sink records;   ///< forward: each row's statistics go here instead of its outputs
  const float* mass_in;  ///< backward, soft targets: the row's sum_c w_c t'_c over all shards
};

/// The caller's whole weight vector (vocab entries) from a shard's view of it.
template <class T, class G, class Tgt>
__device__ __forceinline__ const float* full_weights(const row_args<T, G, Tgt>& a) {
  return a.weights ? a.weights - a.first : nullptr;
}

/// Row n's forward outputs, each where the call asked for it, and its entry for the reduced loss
/// (`reduce`): written by one thread per row, in the row kernel, the small-batch kernel and the
/// vocab-parallel merge alike.
template <class T, class G, class Tgt>
__device__ __forceinline__ void write_row_outputs(const row_args<T, G, Tgt>& a, std::int64_t n,
                                                  float loss, float lse, std::int64_t best,
                                                  bool correct, bool reduce) {
  if (a.row_loss) a.row_loss[n] = loss;
  if (a.lse_out) a.lse_out[n] = lse;
  if (a.argmax) a.argmax[n] = best;
  if (reduce) record_row(a.workspace, a.rows, n, loss, correct);
}

/// Whether a row with class-id target y takes no statistics and a zero gradient: y is the ignore
/// index, or outside [0, vocab) (then its loss is NaN and it counts as a device error).
__device__ __forceinline__ bool skipped_class(std::int64_t y, std::int64_t ignore_index,
                                              std::int64_t vocab) {
  return y == ignore_index || y < 0 || y >= vocab;
}
template <class T, class G, class Tgt>
__device__ __forceinline__ bool skipped_target(const row_args<T, G, Tgt>& a, std::int64_t y) {
  return skipped_class(y, a.ignore_index, a.vocab);
}

/// What one thread writes for row n that skipped_target leaves out: its forward outputs where
/// `outputs` (loss and LSE 0 if ignored, NaN if out of range; no argmax) and, out of range
/// (`invalid`), one device error.
template <class T, class G, class Tgt>
__device__ __forceinline__ void write_skipped_row(const row_args<T, G, Tgt>& a, std::int64_t n,
                                                  bool invalid, bool outputs, bool reduce) {
  if (outputs) {
    const float v = invalid ? NAN : 0.0f;
    write_row_outputs(a, n, v, v, -1, false, reduce);
  }
  if (invalid && a.error_count) atomicAdd(a.error_count, 1);
}

/// The soft-capped logit. `Plain` kernels (class ids; no softcap, smoothing or argmax) are
/// compiled without the option paths, so their sweeps are the bare conversion, exponential and
/// store.
template <bool Plain = false, class T>
__device__ __forceinline__ float capped(T raw, const loss_constants& k) {
  if constexpr (Plain) return to_float(raw);
  return apply_softcap(to_float(raw), k);
}

/// w_c t'_c for class c of row n (soft targets; class ids use the smoothing term alone).
template <class T, class G, class Tgt>
__device__ __forceinline__ float target_mass(const row_args<T, G, Tgt>& a, std::int64_t n,
                                             std::int64_t c) {
  const float w = a.weights ? a.weights[c] : 1.0f;
  if constexpr (Tgt::soft) {
    return w * (a.k.keep * to_float(a.targets.probs[n * a.targets.ld + c]) + a.k.smooth);
  } else {
    return w * a.k.smooth;
  }
}

__device__ __forceinline__ row_partial& stats_of(row_partial& p) { return p; }
__device__ __forceinline__ row_partial& stats_of(slice_partial& p) { return p.stats; }
__device__ __forceinline__ const row_partial& stats_of(const row_partial& p) { return p; }
__device__ __forceinline__ const row_partial& stats_of(const slice_partial& p) { return p.stats; }
__device__ __forceinline__ std::int64_t best_of(const row_partial&) { return -1; }
__device__ __forceinline__ std::int64_t best_of(const slice_partial& p) { return p.argmax.index; }
__device__ __forceinline__ argmax_state argmax_of(const row_partial&) { return {}; }
__device__ __forceinline__ argmax_state argmax_of(const slice_partial& p) { return p.argmax; }

/// The upstream gradient of row n (see xent::upstream), formed in double and rounded once;
/// `scalar` is scale * *scale_ptr / W for mean and sum, read once per launch.
template <class T, class G, class Tgt>
__device__ float row_scale(const row_args<T, G, Tgt>& a, std::int64_t n, double scalar) {
  if (a.reduce == reduction::none)
    return static_cast<float>(a.up_rows ? static_cast<double>(a.scale) * a.up_rows[n] : a.scale);
  return static_cast<float>(scalar);
}

}  // namespace cuda_detail
}  // namespace xent
