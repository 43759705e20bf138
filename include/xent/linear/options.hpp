// Fused linear cross-entropy: its options, its gradients and its workspace. The logits
// hidden · weightᵀ (+ bias) are never materialised whole: a call computes them a chunk of rows at
// a time inside a caller-sized workspace.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../options.hpp"
#include "../views.hpp"

namespace xent {

/// How d_weight (V x D) is summed over the row chunks of a call.
enum class dw_accumulation {
  /// In a float V x D buffer inside the workspace (double for double inputs: the accumulator),
  /// rounded to d_weight's dtype once at the end.
  /// Summing in bf16 across chunks made training diverge (Liger #512), so this is the default.
  /// When d_weight is float it is its own accumulator and costs nothing extra; otherwise the
  /// workspace holds 4 V D more bytes (1 GiB for V = 128256, D = 2048).
  fp32,
  /// In d_weight itself: each chunk's float contribution is added to d_weight and rounded, once
  /// per chunk. Saves the 4 V D bytes; the error grows with the number of chunks (up to half an
  /// ulp of d_weight's dtype per chunk). Identical to fp32 when d_weight is float.
  output,
};

/// The order a training call (linear_forward_backward, linear_backward) computes in. Forward calls
/// have one order.
enum class linear_order {
  /// fast when the workspace holds fast's minimal, else low_memory when it holds low_memory's
  /// minimal, else the call throws naming the smaller of the two. The default stays the fast order
  /// (3 GEMMs), and a caller who sizes the workspace from a low_memory query gets that order
  /// without naming it: the bytes given are the caller's statement of what memory there is.
  automatic,
  /// Row chunks outer: each chunk's logits over the whole vocabulary, d_weight summed across the
  /// chunks as dw_accumulation says (its float sum is 4 V D bytes: 2 GiB at 128256 x 4096).
  fast,
  /// The vocabulary outer, in panels: a forward pass for each row's LSE (linear_backward is given
  /// it), then per panel its logits for every row, d_weight[panel] summed over all rows in float
  /// and written once, d_hidden added into an N x D float sum (d_hidden itself when it is float).
  /// Exact as fast is; one GEMM more in forward_backward (4 against 3); no V x D buffer. Ignores
  /// dw_accumulation (nothing is summed across chunks in d_weight's dtype).
  low_memory,
};

/// What a training call with a sparse backward did (linear_options::sparse_counts): its gradient
/// tiles (a block of rows x a block of classes, backend-defined) and how many it skipped.
struct linear_sparse_counts {
  std::int64_t tiles = 0;
  std::int64_t skipped = 0;
};

/// A threshold to start from for linear_options::sparse_threshold with bf16 gradients: 2^-12,
/// Cut Cross-Entropy's. Each dropped term is below 2^-12 |g alpha|, a sixteenth of bf16's unit
/// roundoff (2^-8) of an element of the row's scale |g alpha|.
constexpr float linear_sparse_threshold_bf16 = 0x1p-12f;

/// The loss options of xent::options (every one applies to the logits hidden · weightᵀ + bias),
/// how d_weight is accumulated, the training order and the sparse backward. W: the extent of
/// class_weights, as in basic_options.
template <class W = dynamic_extent>
struct basic_linear_options : basic_options<W> {
  dw_accumulation accumulate = dw_accumulation::fp32;
  linear_order order = linear_order::automatic;
  /// The sparse backward (Cut Cross-Entropy's gradient filtering), off at 0 (exact). tau in
  /// [0, 1]: a training call skips the gradient GEMM work (in linear_forward_backward the panel's
  /// logits too) of each tile (a block of rows x a block of classes) in which every row's softmax
  /// probability p_nj is below tau, no row's class-id
  /// target lies, and (soft targets) every target probability is 0. A row's logit gradient is
  /// g_n (alpha_n p_nj - w_j t'_nj) s_nj (loss_math.hpp; s the softcap slope, at most 1), and
  /// only its first term is dropped in a skipped tile; targets' terms are never dropped, and label
  /// smoothing's term -g_n w_j eps / V is kept for every class as a rank-1 correction (the reason
  /// softcap with label smoothing is refused: the slope makes that term full rank). So each
  /// gradient moves by at most what dropping every g_n alpha_n p_nj with p_nj < tau would move it:
  ///   |d d_hidden[n,k]| <= |g_n alpha_n| sum_{j: p_nj < tau} p_nj |weight[j,k]|,
  ///   |d d_weight[j,k]| <= sum_{n: p_nj < tau} |g_n alpha_n| p_nj |hidden[n,k]|,
  ///   |d d_bias[j]|     <= sum_{n: p_nj < tau} |g_n alpha_n| p_nj,
  /// each at most tau |g_n alpha_n| times the sum of the |weight| (|hidden|, 1) terms. The loss
  /// and every forward output are unchanged. Only the low-memory order takes it (a training call
  /// with linear_order::automatic and tau > 0 runs low_memory; fast refuses tau > 0), in
  /// linear_forward_backward and linear_backward; the vocab-parallel calls refuse it. The CUDA
  /// backend takes it with bf16 or fp16 inputs, class-id targets, no label smoothing or softcap,
  /// and D and the leading dimensions multiples of 8 (cuda/dispatch/linear_sparse.cuh), and
  /// refuses it otherwise, naming the argument. linear_sparse_threshold_bf16 is a threshold to
  /// start from.
  float sparse_threshold = 0.0f;
  /// Where a training call with sparse_threshold > 0 writes its tile counts (host memory for
  /// xent::cpu, device memory for xent::cuda, written in stream order), or null: a measurement,
  /// not needed for the gradients.
  linear_sparse_counts* sparse_counts = nullptr;

  basic_linear_options() = default;
  /// Run-time sized options from static ones.
  template <class W2, class = std::enable_if_t<std::is_convertible<basic_options<W2>,
                                                                   basic_options<W>>::value>>
  basic_linear_options(const basic_linear_options<W2>& o)  // NOLINT(google-explicit-constructor)
      : basic_options<W>(o),
        accumulate(o.accumulate),
        order(o.order),
        sparse_threshold(o.sparse_threshold),
        sparse_counts(o.sparse_counts) {}
};
using linear_options = basic_linear_options<>;

/// The gradients of a training call, each optional (an empty view is not computed: a frozen
/// weight or bias, or a first layer without d_hidden). Each is written, not added to.
/// HE, WE: the extents of hidden (N x D) and weight (V x D), as in views.hpp.
template <class G, class HE = dynamic_extents, class WE = dynamic_extents>
struct linear_grads {
  matrix_view<G, HE> d_hidden{};              ///< N x D
  matrix_view<G, WE> d_weight{};              ///< V x D
  vector_view<G, extent<WE::rows>> d_bias{};  ///< V; only with a bias
};

/// The sizes of a call: hidden is rows x hidden, weight is vocab x hidden.
struct linear_shape {
  std::int64_t rows = 0;
  std::int64_t hidden = 0;
  std::int64_t vocab = 0;
};

/// Which calls a workspace is for: forward only, or the training calls (forward_backward and
/// backward), which also need room for the gradients' accumulators.
enum class linear_pass { forward, training };

/// Caller-owned memory of the backend's kind (host memory for xent::cpu). Any alignment.
struct linear_workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

/// The workspace of a vocab-parallel fused linear call (parallel/vocab_parallel_linear.hpp):
/// caller memory as above, and the rows per chunk, which must be the same on every rank of the
/// group (each chunk's all-gather holds the same rows from every rank; rows planned from each
/// rank's bytes would differ where the shards do). xent::vocab_parallel_linear_workspace_size
/// answers the same chunk_rows on every rank, and this rank's bytes for it.
struct vocab_parallel_linear_workspace : linear_workspace {
  std::int64_t chunk_rows = 0;
};

/// What xent::linear_workspace_size answers, for the order of the options it is given
/// (linear_order::automatic: the least is the smaller minimal of the two orders, and bytes and
/// chunk_rows are the fast order's; a query with linear_order::low_memory answers that order's).
struct linear_workspace_sizes {
  std::size_t minimal = 0;  ///< the least a call accepts: one row per chunk
  std::size_t bytes = 0;    ///< what a call uses when given the budget (minimal if that is more)
  std::int64_t chunk_rows = 0;  ///< rows per chunk with `bytes`
  /// The fast order's minimal: with linear_order::automatic, a training workspace of at least
  /// this many bytes runs the fast order and one byte less the low-memory order.
  std::size_t fast_minimal = 0;
};

/// The budget xent::linear_workspace_size plans for when none is given.
constexpr std::size_t linear_default_budget = std::size_t{256} << 20;

}  // namespace xent
