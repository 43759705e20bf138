// The sparse backward of fused linear cross-entropy on the CPU (linear_options::sparse_threshold):
// threshold 0 is the exact path bit for bit; a threshold leaves every forward output as it was
// and moves each gradient by at most what the skipped tiles' probability terms can (the bound of
// linear/options.hpp), judged against the float64 linear oracle on inputs shaped so that tiles
// are skipped (forward_backward, whose statistics pass marks the cold tiles, and linear_backward,
// which marks them from the panel's logits); the tile counts it reports match the tiles the oracle
// finds cold; bad thresholds and the calls without a sparse backward throw xent::error naming the
// option.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "linear_harness.hpp"
#include "oracle/linear_oracle.hpp"
#include "xent/cpu/linear.hpp"
#include "xent/cpu/vocab_parallel_linear.hpp"
#include "xent/parallel/vocab_parallel_linear.hpp"

namespace {

using namespace xtl;  // NOLINT(google-build-using-namespace): the shared linear test vocabulary

constexpr float tau = 1.0f / 32;  // large enough that these small vocabularies have cold tiles
constexpr std::int64_t peaked_rows = 128;

/// Rows [0, peaked_rows) shaped like a trained model's: hidden_n = c weight[t_n] / |weight[t_n]|^2
/// with t_n among the first 40 classes (the first weight block), so the row's softmax is peaked
/// there and every other block's probabilities are small; the class-id target is t_n (ignored
/// rows stay ignored), soft targets 3/4 on t_n and 1/4 on t_n + 1. Later rows stay random (every
/// tile of theirs is kept).
template <class T>
void shape_like_trained(ldata<T>& L) {
  const std::int64_t N = L.N(), D = L.D(), ld = L.s.ld();
  std::mt19937_64 rng(L.s.ce.seed + 5);
  std::uniform_int_distribution<std::int64_t> topic(0, 39);
  for (std::int64_t n = 0; n < std::min(N, peaked_rows); ++n) {
    const std::int64_t t = topic(rng);
    double norm2 = 0.0;
    for (std::int64_t k = 0; k < D; ++k) norm2 += std::pow(xt::to_double(L.w[t * ld + k]), 2);
    for (std::int64_t k = 0; k < D; ++k)
      L.x[n * ld + k] = xt::from_double<T>(14.0 * xt::to_double(L.w[t * ld + k]) / norm2);
    if (L.s.ce.kind == target_kind::soft) {
      for (std::int64_t v = 0; v < L.V(); ++v)
        L.d.probs[n * L.d.s.ld() + v] = xt::from_double<T>(v == t ? 0.75 : v == t + 1 ? 0.25 : 0.0);
    } else if (L.d.target(n) != L.s.ce.ignore_index) {
      L.d.set_target(n, t);
    }
  }
}

/// The case with the sparse bound added to its error bounds, and the oracle's count of the tiles
/// that are cold for certain and of those that may be (the float logits and LSE may put a tile
/// either side of log tau within their errors).
template <class T>
struct sparse_judged {
  ldata<T> L;
  oracle::linear_problem pb;
  oracle::upstream up;
  oracle::linear_result r;
  bounds e;
  std::int64_t surely_cold = 0, maybe_cold = 0;

  /// `chunk_rows`: the panel sub-chunks' rows of the call (tiles restart at each).
  sparse_judged(const lspec& s, std::int64_t chunk_rows) : L(make_data<T>(s)) {
    shape_like_trained(L);
    pb = L.problem();
    up = L.d.oracle_upstream();
    r = oracle::evaluate_linear(pb, &up);
    e = error_bounds(L, pb, r, 0.0);
    add_sparse_bound(chunk_rows);
  }

  /// Counts tile [r0, r1) x [v0, v1) and, when it may be cold, adds what it may drop.
  void add_tile(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1,
                const std::vector<double>& ga) {
    const oracle::problem& ce = pb.ce;
    const std::int64_t V = L.V(), D = L.D();
    const double log_tau = std::log(static_cast<double>(tau));
    bool maybe = true, surely = true;
    for (std::int64_t n = r0; n < r1; ++n) {
      if (ce.ignored(n)) continue;
      for (std::int64_t j = v0; j < v1; ++j) {
        const bool target = ce.soft ? ce.probs[n * V + j] != 0.0 : ce.targets[n] == j;
        const double margin = r.ce.z[n * V + j] - r.ce.lse[n] - log_tau;
        const double slack = e.lse[n] + 2.0 * e.dz[n * V + j] + 1e-6;
        if (target || margin >= slack) maybe = false;
        if (target || margin >= -slack) surely = false;
      }
    }
    surely_cold += surely;
    maybe_cold += maybe;
    if (!maybe) return;
    for (std::int64_t n = r0; n < r1; ++n)
      for (std::int64_t j = v0; j < v1; ++j) {
        const double drop = ga[n] * std::exp(r.ce.z[n * V + j] - r.ce.lse[n]);
        e.db[j] += drop;
        for (std::int64_t k = 0; k < D; ++k) {
          e.dx[n * D + k] += drop * std::fabs(pb.w[j * D + k]);
          e.dw[j * D + k] += drop * std::fabs(pb.x[n * D + k]);
        }
      }
  }

  /// Each element a cold tile may drop is |g_n alpha_n| p_nj (times the softcap slope, at most
  /// 1); smoothing's rank-1 term, summed apart, adds a float rounding of its own sums.
  void add_sparse_bound(std::int64_t chunk_rows) {
    const oracle::problem& ce = pb.ce;
    const std::int64_t N = L.N(), V = L.V(), D = L.D();
    const std::int64_t tile = xent::cpu_detail::sparse_tile_rows;
    const std::int64_t block = xent::cpu_detail::linear_block_rows;
    const double u = xt::unit_roundoff<float>(), eps = ce.label_smoothing;
    std::vector<double> g(N, 0.0), ga(N, 0.0);
    for (std::int64_t n = 0; n < N; ++n) {
      if (ce.ignored(n)) continue;
      g[n] = ce.reduce == oracle::reduction::none   ? (up.rows.empty() ? up.scale : up.rows[n])
             : ce.reduce == oracle::reduction::mean ? up.scale / r.ce.normalizer
                                                    : up.scale;
      double mass = 0.0;
      for (std::int64_t c = 0; c < V; ++c) mass += ce.weight(c) * oracle::smoothed_target(ce, n, c);
      ga[n] = std::fabs(g[n] * (mass + 2.0 * ce.z_loss * r.ce.lse[n]));
    }
    for (std::int64_t c0 = 0; c0 < N; c0 += chunk_rows) {  // tiles restart at each sub-chunk
      const std::int64_t c1 = std::min(N, c0 + chunk_rows);
      for (std::int64_t r0 = c0; r0 < c1; r0 += tile)
        for (std::int64_t v0 = 0; v0 < V; v0 += block)
          add_tile(r0, std::min(c1, r0 + tile), v0, std::min(V, v0 + block), ga);
    }
    if (eps == 0.0) return;
    double gsum = 0.0;
    std::vector<double> s(D, 0.0), wu(D, 0.0);
    for (std::int64_t n = 0; n < N; ++n) {
      gsum += std::fabs(g[n]);
      for (std::int64_t k = 0; k < D; ++k) s[k] += std::fabs(g[n] * pb.x[n * D + k]);
    }
    for (std::int64_t j = 0; j < V; ++j)
      for (std::int64_t k = 0; k < D; ++k) wu[k] += std::fabs(ce.weight(j) * pb.w[j * D + k]);
    const double f = eps / static_cast<double>(V);
    for (std::int64_t j = 0; j < V; ++j) {
      e.db[j] += 4.0 * (N + 2) * u * f * std::fabs(ce.weight(j)) * gsum;
      for (std::int64_t k = 0; k < D; ++k)
        e.dw[j * D + k] += 4.0 * (N + 2) * u * f * std::fabs(ce.weight(j)) * s[k];
    }
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t k = 0; k < D; ++k)
        e.dx[n * D + k] += 4.0 * (V + 2) * u * f * std::fabs(g[n]) * wu[k];
  }
};

/// Whether two forward outputs hold the same bits.
template <class A>
bool same_outputs(const basic_outputs<A>& a, const basic_outputs<A>& b) {
  auto same = [](const auto& x, const auto& y) {
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!xt::same_bits(x[i], y[i])) return false;
    return true;
  };
  return xt::same_bits(a.loss, b.loss) && a.correct == b.correct && same(a.row_loss, b.row_loss) &&
         same(a.lse, b.lse) && a.argmax == b.argmax;
}

/// One case in the low-memory order with the threshold tau: forward_backward's outputs the same
/// bits as at threshold 0, its gradients and linear_backward's within the sparse bound, their
/// tile counts those the oracle finds cold. Returns whether it passed (a failure is reported).
template <class T, class G = T>
bool run_sparse_case(lspec s) {
  using A = xent::accumulator_t<T>;
  s.order = xent::linear_order::low_memory;
  const xent::cpu exec(s.ce.threads);
  const ldata<T> plain = make_data<T>(s);
  const std::size_t exact_bytes = workspace_bytes<T, G>(exec, plain, xent::linear_pass::training);
  s.sparse_threshold = tau;
  const ldata<T> sized = make_data<T>(s);
  const std::size_t bytes = workspace_bytes<T, G>(exec, sized, xent::linear_pass::training);
  const std::int64_t chunk_rows =
      xent::cpu_detail::plan_low_memory<T, G>(exec, {s.ce.rows, s.hidden, s.ce.cols}, bytes, true)
          .panel.chunk_rows;
  const sparse_judged<T> J(s, chunk_rows);
  const ldata<T>& L = J.L;
  xent::linear_options sparse = L.options(), exact = sparse;
  exact.sparse_threshold = 0.0f;
  xent::linear_sparse_counts fb_counts{-1, -1}, b_counts{-1, -1};
  std::string errs;

  basic_outputs<A> dense_out(L.N()), out(L.N());
  gradients<G> dense_g(s), g(s), gb(s);
  workspace_buffer dense_ws(exact_bytes, s.ce.seed), ws(bytes, s.ce.seed);
  L.d.with_targets([&](auto t) {
    xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, exact, L.d.upstream(),
                                  dense_out.all(s.ce), dense_g.views(), dense_ws.ws);
    sparse.sparse_counts = &fb_counts;
    xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, sparse, L.d.upstream(),
                                  out.all(s.ce), g.views(), ws.ws);
    sparse.sparse_counts = &b_counts;
    xent::linear_backward(exec, L.hidden(), L.weight(), L.bias(), t, sparse, dense_out.lse_view(),
                          L.d.upstream(), gb.views(), ws.ws);
  });
  if (!same_outputs(out, dense_out)) errs += "  forward outputs differ from threshold 0's\n";
  errs += check_outputs(L, J.r, J.e, out);
  errs += check_gradients(L, J.r, J.e, g);
  errs += check_gradients(L, J.r, J.e, gb);
  for (const auto& c : {fb_counts, b_counts})
    if (c.skipped < J.surely_cold || c.skipped > J.maybe_cold || c.tiles < c.skipped)
      errs += "  " + std::to_string(c.skipped) + " of " + std::to_string(c.tiles) +
              " tiles skipped, the oracle finds " + std::to_string(J.surely_cold) + " to " +
              std::to_string(J.maybe_cold) + " cold\n";
  if (J.surely_cold == 0) errs += "  no tile is surely cold: the case checks nothing sparse\n";
  if (!errs.empty()) ADD_FAILURE() << s.describe() << " threshold=" << tau << "\n" << errs;
  return errs.empty();
}

/// every_option's cases at N = 150 (two whole row tiles and a part), D = 61, V = 600 (two whole
/// weight blocks and a part), except softcap with label smoothing (refused with a threshold).
std::vector<lspec> sparse_cases() {
  std::vector<lspec> out;
  for (lspec s : every_option(150, 61, 600)) {
    if (s.ce.softcap > 0 && s.ce.label_smoothing > 0) continue;
    s.ce.sigma = 1.0;
    out.push_back(s);
  }
  return out;
}

TEST(CpuLinearSparse, GradientsStayWithinTheSkippedProbabilitiesBoundWithEveryOption) {
  xt::case_budget b;
  for (const lspec& s : sparse_cases())
    if (!b.record(run_sparse_case<float>(s))) return;
  EXPECT_EQ(b.cases(), 216);
}

TEST(CpuLinearSparse, OtherDtypesStayWithinTheBound) {
  // bf16 / fp16 inputs and gradients (the sums in float, each output rounded once), float inputs
  // with bf16 gradients, and float64 (every sum in double): every eighth case.
  xt::case_budget b;
  int i = 0;
  for (const lspec& s : sparse_cases()) {
    if (i++ % 8 != 0) continue;
    if (!b.record(run_sparse_case<bf16>(s) && run_sparse_case<half>(s) &&
                  run_sparse_case<float, bf16>(s) && run_sparse_case<double>(s)))
      return;
  }
  EXPECT_EQ(b.cases(), 27);
}

/// Every result of a training call: outputs and gradients, as bytes.
template <class T>
std::vector<unsigned char> training_bits(const lspec& s, const xent::linear_options& opts,
                                         std::size_t bytes) {
  ldata<T> L = make_data<T>(s);
  shape_like_trained(L);
  basic_outputs<float> out(L.N());
  gradients<T> g(s);
  workspace_buffer ws(bytes, 0);
  L.d.with_targets([&](auto t) {
    xent::linear_forward_backward(xent::cpu(s.ce.threads), L.hidden(), L.weight(), L.bias(), t,
                                  opts, L.d.upstream(), out.all(s.ce), g.views(), ws.ws);
  });
  std::vector<unsigned char> bits;
  auto add = [&](const auto& v) {
    const auto* p = reinterpret_cast<const unsigned char*>(v.data());
    bits.insert(bits.end(), p, p + v.size() * sizeof(v[0]));
  };
  add(out.row_loss);
  add(out.lse);
  add(g.dx);
  add(g.dw);
  add(g.db);
  return bits;
}

TEST(CpuLinearSparse, ZeroThresholdIsTheExactPathBitForBit) {
  // Threshold 0 changes nothing, not even the order automatic takes; a threshold takes the
  // low-memory order under automatic whatever the workspace.
  const auto training = xent::linear_pass::training;
  for (const lspec& base : sparse_cases()) {
    if (base.ce.seed % 9 != 0) continue;
    lspec s = base;
    s.space = budget::all_rows;
    const xent::cpu exec(s.ce.threads);
    const ldata<float> L = make_data<float>(s);
    const xent::linear_shape shape{L.N(), L.D(), L.V()};
    xent::linear_options automatic = L.options(), low_memory = automatic, fast = automatic;
    automatic.order = xent::linear_order::automatic;
    low_memory.order = xent::linear_order::low_memory;
    fast.order = xent::linear_order::fast;
    const std::size_t fast_bytes =
        xent::linear_workspace_size<float>(exec, shape, training, fast).bytes;
    const std::size_t low_bytes =
        xent::linear_workspace_size<float>(exec, shape, training, low_memory).bytes;

    xent::linear_sparse_counts counts{-1, -1};
    xent::linear_options zero_low = low_memory;
    automatic.sparse_counts = zero_low.sparse_counts = &counts;
    EXPECT_EQ(training_bits<float>(s, automatic, fast_bytes),
              training_bits<float>(s, fast, fast_bytes))
        << s.describe();
    EXPECT_EQ(training_bits<float>(s, zero_low, low_bytes),
              training_bits<float>(s, low_memory, low_bytes))
        << s.describe();
    EXPECT_EQ(counts.tiles, -1) << "threshold 0 counted tiles";

    // With a threshold, automatic in a workspace the fast order would take runs low_memory.
    automatic.sparse_threshold = low_memory.sparse_threshold = tau;
    const std::size_t both = std::max(
        fast_bytes, xent::linear_workspace_size<float>(exec, shape, training, low_memory).minimal);
    const auto sparse_bits = training_bits<float>(s, automatic, both);
    EXPECT_EQ(sparse_bits, training_bits<float>(s, low_memory, both)) << s.describe();
    EXPECT_NE(sparse_bits, training_bits<float>(s, fast, both)) << s.describe();
    EXPECT_GT(counts.skipped, 0);
  }
}

TEST(CpuLinearSparse, BadThresholdsThrowNamingTheOptionBeforeWriting) {
  lspec s = make_spec(8, 6, 10);
  s.order = xent::linear_order::low_memory;
  const ldata<float> L = make_data<float>(s);
  const xent::cpu exec(1);
  const std::size_t bytes = workspace_bytes<float>(exec, L, xent::linear_pass::training);
  auto expect_refused = [&](xent::linear_options opts, const std::string& fragment) {
    outputs f(L.N());
    gradients<float> g(s);
    workspace_buffer ws(bytes, 0);
    L.d.with_targets([&](auto t) {
      expect_error("options.sparse_threshold", fragment, [&] {
        xent::linear_forward_backward(exec, L.hidden(), L.weight(), L.bias(), t, opts,
                                      L.d.upstream(), f.all(s.ce), g.views(), ws.ws);
      });
      expect_error("options.sparse_threshold", fragment, [&] {
        xent::linear_backward(exec, L.hidden(), L.weight(), L.bias(), t, opts, f.lse_view(),
                              L.d.upstream(), g.views(), ws.ws);
      });
    });
    expect_error("options.sparse_threshold", fragment, [&] {
      xent::linear_workspace_size<float>(exec, {8, 6, 10}, xent::linear_pass::training, opts);
    });
    EXPECT_TRUE(ws.untouched());
    EXPECT_EQ(f.loss, 12345.0f);
    EXPECT_TRUE(xt::same_bits(g.dw[0], xt::sentinel<float>()));
  };
  for (float bad : {-1e-3f, -1.0f, 1.5f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    xent::linear_options opts = L.options();
    opts.sparse_threshold = bad;
    expect_refused(opts, "must be in [0, 1]");
  }
  xent::linear_options capped = L.options();
  capped.sparse_threshold = tau;
  capped.softcap = 5.0f;
  capped.label_smoothing = 0.1f;
  expect_refused(capped, "softcap and label_smoothing");
  xent::linear_options fast = L.options();
  fast.sparse_threshold = tau;
  fast.order = xent::linear_order::fast;
  expect_refused(fast, "low-memory order only");

  // The vocab-parallel calls have no sparse backward yet.
  xent::linear_options vp;
  vp.sparse_threshold = tau;
  expect_error("options.sparse_threshold", "vocab-parallel", [&] {
    xent::vocab_parallel_linear_workspace_size<float>(exec, {8, 6, 5}, 10, 2,
                                                      xent::linear_pass::training, vp);
  });
}

}  // namespace
