// What the vocab-parallel tests of every backend share (tests/cpu/vocab_parallel_test.cpp,
// tests/cuda/cuda_vocab_parallel_test.cu): a rank's shard of a case (harness.hpp's dataset), what
// the ranks' calls wrote, and the checks of those results put together. Host memory only.
//
// A case runs on every rank twice: forward_backward, and forward then backward from forward's LSE.
// The checks of each: every rank's forward outputs are bitwise equal; rank 0's outputs and the
// gradient shards side by side are held to the float64 oracle with the harness's tolerances; and,
// run again with float gradients, to the unsharded call's float results within twice those (both
// err). The comparison with the unsharded call is made in float because a bf16 / fp16 element of
// each may round to neighbouring values: the oracle check judges that rounding.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/harness.hpp"
#include "cpu/vocab_split.hpp"

namespace xvp {

using xent::reduction;
using xt::spec;
using xt::split;
using xt::target_kind;

/// A rank's view of a case: the logits (and soft targets) cut to classes [first, first + cols),
/// ld = cols + pad with the padding holding the sentinel, spec.cols = cols. Targets (global class
/// ids), class weights (all V of them) and the upstream gradient stay the case's, so that its
/// options(), upstream() and with_targets() are the rank's arguments as they are.
template <class T>
xt::dataset<T> shard_of(const xt::dataset<T>& d, std::int64_t first, std::int64_t cols) {
  xt::dataset<T> r = d;
  r.s.cols = cols;
  const std::int64_t ld = r.s.ld();
  const bool soft = d.s.kind == target_kind::soft;
  r.logits.assign(d.s.rows * ld, xt::sentinel<T>());
  r.probs.assign(soft ? d.s.rows * ld : 0, xt::sentinel<T>());
  for (std::int64_t n = 0; n < d.s.rows; ++n)
    for (std::int64_t c = 0; c < cols; ++c) {
      r.logits[n * ld + c] = d.x(n, first + c);
      if (soft) r.probs[n * ld + c] = d.probs[n * d.s.ld() + first + c];
    }
  return r;
}

template <class T>
std::vector<xt::dataset<T>> shards_of(const xt::dataset<T>& d, const split& sp) {
  std::vector<xt::dataset<T>> out;
  for (int r = 0; r < sp.ranks(); ++r) out.push_back(shard_of(d, sp.first(r), sp.cols(r)));
  return out;
}

/// A rank's outputs before its calls, poisoned as harness.hpp's are: the forward outputs and a
/// gradient of `rows` x `ld` elements, so that what a call must not write can be told.
template <class G>
xt::call_result<G> poisoned(std::int64_t rows, std::int64_t ld) {
  xt::call_result<G> r;
  r.row_loss.assign(rows, 12345.0f);
  r.lse.assign(rows, 12345.0f);
  r.argmax.assign(rows, -777);
  r.grad.assign(rows * ld, xt::sentinel<G>());
  return r;
}

/// Every forward output a case allows (the loss only under mean / sum, num_correct only with class
/// ids), at the given addresses of a call of `rows` rows: a call_result's, or device copies.
inline xent::forward_outputs all_outputs(const spec& s, std::int64_t rows, float* loss,
                                         float* row_loss, float* lse, std::int64_t* argmax,
                                         std::int64_t* correct) {
  xent::forward_outputs o;
  if (s.reduce != reduction::none) o.loss = loss;
  o.row_loss = {row_loss, rows};
  o.lse = {lse, rows};
  o.argmax = {argmax, rows};
  if (s.kind != target_kind::soft) o.num_correct = correct;
  return o;
}

/// A rank's calls of one form on any backend and group: forward_backward (fused), or forward, then
/// backward from the LSE that forward wrote (out.lse).
template <class Exec, class Group, class T, class Targets, class G>
void rank_calls(const Exec& exec, const Group& group, xent::matrix_view<const T> logits,
                xent::vocab_shard shard, const Targets& targets, const xent::options& opts,
                const xent::upstream& up, const xent::forward_outputs& out,
                xent::matrix_view<G> grad, bool fused) {
  if (fused) {
    xent::vocab_parallel_forward_backward(exec, group, logits, shard, targets, opts, up, out, grad);
    return;
  }
  xent::vocab_parallel_forward(exec, group, logits, shard, targets, opts, out);
  xent::vocab_parallel_backward(exec, group, logits, shard, targets, opts,
                                xent::vector_view<const float>(out.lse.data, logits.rows), up,
                                grad);
}

/// What every rank's calls of one form wrote (rank r's gradient: rows x its shard's ld), and what
/// the backend found wrong beyond the values (a rank's device error count): empty when nothing.
template <class G>
struct ranks_result {
  std::vector<xt::call_result<G>> ranks;
  std::string errors;
};

/// A result's forward outputs as bytes (loss, num_correct, then each row's loss, LSE and argmax):
/// two ranks agree when these are equal.
template <class G>
std::vector<unsigned char> forward_bytes(const xt::call_result<G>& c) {
  std::vector<unsigned char> b;
  auto put = [&b](const void* p, std::size_t n) {
    const auto* u = static_cast<const unsigned char*>(p);
    b.insert(b.end(), u, u + n);
  };
  put(&c.loss, sizeof c.loss);
  put(&c.correct, sizeof c.correct);
  put(c.row_loss.data(), c.row_loss.size() * sizeof(float));
  put(c.lse.data(), c.lse.size() * sizeof(float));
  put(c.argmax.data(), c.argmax.size() * sizeof(std::int64_t));
  return b;
}

/// Every rank's forward outputs equal rank 0's, bit for bit.
template <class G>
std::string check_ranks_agree(const std::vector<xt::call_result<G>>& res) {
  std::string e;
  for (std::size_t r = 1; r < res.size(); ++r)
    if (forward_bytes(res[r]) != forward_bytes(res[0]))
      e += "  rank " + std::to_string(r) + "'s forward outputs differ from rank 0's\n";
  return e;
}

/// The ranks' results as one unsharded result: rank 0's forward outputs, the gradient shards side
/// by side (rows x ld of the case, padding holding the sentinel). A rank that wrote its shard's
/// padding is named in `errors`.
template <class T, class G>
xt::call_result<G> assemble(const xt::dataset<T>& d, const split& sp,
                            const std::vector<xt::call_result<G>>& res, std::string& errors) {
  const spec& s = d.s;
  xt::call_result<G> all = res[0];
  all.grad.assign(s.rows * s.ld(), xt::sentinel<G>());
  for (int r = 0; r < sp.ranks(); ++r) {
    const std::int64_t cols = sp.cols(r), ld = cols + s.pad;
    for (std::int64_t n = 0; n < s.rows; ++n) {
      std::copy_n(res[r].grad.begin() + n * ld, cols, all.grad.begin() + n * s.ld() + sp.first(r));
      for (std::int64_t c = cols; c < ld; ++c)
        if (!xt::same_bits(res[r].grad[n * ld + c], xt::sentinel<G>()))
          errors += "  rank " + std::to_string(r) + " wrote padding column " + std::to_string(c) +
                    " of row " + std::to_string(n) + "\n";
    }
  }
  return all;
}

/// A call_result's forward outputs in the harness's guarded form, for check_forward.
template <class G>
xt::forward_result as_forward(const xt::call_result<G>& c) {
  xt::forward_result f(static_cast<std::int64_t>(c.lse.size()));
  std::copy(c.row_loss.begin(), c.row_loss.end(), f.row_loss.data());
  std::copy(c.lse.begin(), c.lse.end(), f.lse.data());
  std::copy(c.argmax.begin(), c.argmax.end(), f.argmax.data());
  f.loss.data()[0] = c.loss;
  f.correct.data()[0] = c.correct;
  return f;
}

/// The oracle's result with the unsharded call's values in place of the float64 ones (its
/// magnitudes, which size the tolerances, kept).
template <class G>
oracle::result as_reference(oracle::result r, const spec& s, const xt::call_result<G>& u) {
  for (std::int64_t n = 0; n < s.rows; ++n) {
    r.row_loss[n] = u.row_loss[n];
    r.lse[n] = u.lse[n];
    r.argmax[n] = u.argmax[n];
    for (std::int64_t c = 0; c < s.cols; ++c)
      r.grad[n * s.cols + c] = xt::to_double(u.grad[n * s.ld() + c]);
  }
  r.loss = u.loss;
  return r;
}

/// The assembled results of one form, held to `ref` (the oracle's, or as_reference's) within the
/// case's tolerances; a rank's padding written and the backend's own findings included.
template <class T, class G>
std::string check_form(const xt::dataset<T>& d, const split& sp, const ranks_result<G>& res,
                       const oracle::result& ref, xt::call_result<G>& all) {
  std::string e = res.errors;
  all = assemble(d, sp, res.ranks, e);
  xt::forward_result f = as_forward(all);
  return e + xt::check_forward(d, ref, f, d.s.reduce != reduction::none) +
         xt::check_gradient<T, G>(d, ref, all.grad.data());
}

/// One case on one split, both call forms, on every rank of `backend`, which provides
///   template <class T, class G> ranks_result<G> ranks(const dataset<T>&, const split&,
///                                                     bool fused) const;
///       every rank's calls of one form (fused: forward_backward; else forward, then backward
///       from forward's LSE) on the rank's shard (shard_of), outputs poisoned as poisoned() does;
///   template <class T> xt::call_result<float> unsharded(const dataset<T>&, bool fused) const;
///       the same calls of the unsharded backend on the whole vocabulary, float gradients.
/// Reports failures through gtest; returns whether the case passed.
template <class T, class G, class Backend>
bool run_case(const Backend& backend, const xt::dataset<T>& d, const split& sp) {
  const oracle::upstream oup = d.oracle_upstream();
  const oracle::result r = oracle::evaluate(d.problem(), &oup);
  xt::dataset<T> loose = d;  // the unsharded call errs too: twice the tolerances
  loose.s.forward_tol = 2 * d.s.fwd_tol();
  loose.s.grad_tol = 2 * d.s.bwd_tol();
  std::string errors;
  auto note = [&](const std::string& what, const std::string& e) {
    if (!e.empty()) errors += what + ":\n" + e;
  };
  for (bool fused : {true, false}) {
    const std::string form = fused ? "forward_backward" : "forward + backward";
    const ranks_result<G> res = backend.template ranks<T, G>(d, sp, fused);
    note(form + ", ranks", check_ranks_agree(res.ranks));
    xt::call_result<G> all;
    note(form + " vs oracle", check_form(d, sp, res, r, all));
    ranks_result<float> wide;
    if constexpr (std::is_same<G, float>::value)
      wide = res;
    else
      wide = backend.template ranks<T, float>(d, sp, fused);
    const xt::call_result<float> u = backend.template unsharded<T>(d, fused);
    xt::call_result<float> wide_all;
    std::string e = check_form(loose, sp, wide, as_reference(r, d.s, u), wide_all);
    if (wide_all.correct != u.correct || wide_all.argmax != u.argmax)
      e += "  argmax / num_correct differ\n";
    note(form + " vs unsharded (float gradients)", e);
  }
  if (errors.empty()) return true;
  ADD_FAILURE() << "case " << xt::dtype_name<T>() << " -> " << xt::dtype_name<G>() << ", "
                << d.s.describe() << ", " << sp.name() << "\n"
                << errors;
  return false;
}

/// The option sweep's cases of `rows` x `vocab`: six variants (class ids; some ignored with class
/// weights; label smoothing; smoothing with weights; z-loss with softcap; soft targets with
/// smoothing and weights) under each reduction, int32 / int64 ids and padded rows alternating,
/// the upstream gradient a scale or also a pointer (per-row values under none).
inline std::vector<spec> every_option(std::int64_t rows, std::int64_t vocab, std::uint64_t seed) {
  std::vector<spec> out;
  for (reduction red : {reduction::mean, reduction::sum, reduction::none})
    for (int variant = 0; variant < 6; ++variant) {
      spec s;
      s.rows = rows;
      s.cols = vocab;
      s.pad = variant % 2;
      s.reduce = red;
      s.seed = ++seed;
      s.kind = variant == 5 ? target_kind::soft
                            : (variant % 2 ? target_kind::int32 : target_kind::int64);
      s.ignore = variant == 1 ? xt::ignore_mode::some : xt::ignore_mode::none;
      s.label_smoothing = variant >= 2 ? 0.1f : 0.0f;
      s.weights = variant == 3 || variant == 5 || variant == 1;
      s.z_loss = variant == 4 ? 1e-3f : 0.0f;
      s.softcap = variant == 4 ? 5.0f : 0.0f;
      s.up = variant % 3 == 0 ? xt::upstream_mode::pointer_or_rows : xt::upstream_mode::scale;
      out.push_back(s);
    }
  return out;
}

}  // namespace xvp
