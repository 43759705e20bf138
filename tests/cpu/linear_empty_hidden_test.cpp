// Fused linear calls whose hidden matrix has no columns: D = 0, null data, ld > 0, which
// validation accepts as empty. The problem is defined (every logit is its bias, 0 without one),
// so each call must give the cross-entropy of the bias alone. A minimal workspace puts every row
// in a chunk of its own, so the calls visit rows past the first: no row address may be formed
// from null data there (null + offset is undefined; the asan preset's UBSan reports it).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "xent/xent.hpp"

namespace {

using xent::dw_accumulation;
using xent::linear_pass;

constexpr std::int64_t N = 5, V = 7, ld = 3;
const std::int64_t targets_[N] = {0, 6, 3, 3, 1};

template <class T>
double tol() {
  return std::is_same<T, double>::value ? 1e-12 : std::is_same<T, float>::value ? 1e-5 : 1e-2;
}

/// The float64 answer: the row loss (the same for every row but its target term), its LSE, and
/// d_bias for the mean with upstream 1.
struct bias_only {
  std::vector<double> bias, row_loss, d_bias;
  double lse = 0, loss = 0;

  explicit bias_only(const std::vector<double>& b) : bias(b), d_bias(V, 0.0) {
    double m = b[0];
    for (double v : b) m = std::max(m, v);
    double s = 0;
    for (double v : b) s += std::exp(v - m);
    lse = m + std::log(s);
    for (std::int64_t i = 0; i < N; ++i) {
      row_loss.push_back(lse - b[targets_[i]]);
      loss += row_loss.back() / N;
      for (std::int64_t v = 0; v < V; ++v)
        d_bias[v] += (std::exp(b[v] - lse) - (v == targets_[i] ? 1.0 : 0.0)) / N;
    }
  }
};

template <class T>
struct empty_hidden_case {
  using A = xent::accumulator_t<T>;
  std::vector<T> bias;
  bias_only ref;
  // Gradients of no columns: null data, or real memory that must not be touched.
  std::vector<T> dx_memory = std::vector<T>(N * ld, T(7.0f)), dw_memory = std::vector<T>(V * ld);

  static std::vector<double> bias_values() {
    std::vector<double> b;
    for (std::int64_t v = 0; v < V; ++v) b.push_back(0.25 * static_cast<double>(v % 4) - 0.5);
    return b;
  }
  empty_hidden_case() : ref(bias_values()) {
    for (double b : ref.bias) bias.push_back(static_cast<T>(b));
  }

  xent::matrix_view<const T> hidden() const { return {nullptr, N, 0, ld}; }
  xent::matrix_view<const T> weight() const { return {nullptr, V, 0, ld}; }
  xent::vector_view<const T> bias_view() const { return {bias.data(), V}; }
  xent::vector_view<const std::int64_t> targets() const { return {targets_, N}; }
  xent::linear_grads<T> grads(bool null_matrices, std::vector<T>& db) {
    xent::linear_grads<T> g;
    g.d_hidden = {null_matrices ? nullptr : dx_memory.data(), N, 0, ld};
    g.d_weight = {null_matrices ? nullptr : dw_memory.data(), V, 0, ld};
    g.d_bias = {db.data(), V};
    return g;
  }
  std::vector<unsigned char> workspace(linear_pass pass, dw_accumulation acc) const {
    xent::linear_options opts;
    opts.accumulate = acc;
    const auto sizes = xent::linear_workspace_size<T, T>(xent::cpu{}, {N, 0, V}, pass, opts, 0);
    return std::vector<unsigned char>(sizes.minimal);
  }

  void expect_forward(A loss, const std::vector<A>& lse) const {
    EXPECT_NEAR(static_cast<double>(loss), ref.loss, tol<A>());
    for (std::int64_t i = 0; i < N; ++i)
      EXPECT_NEAR(static_cast<double>(lse[i]), ref.lse, tol<A>()) << "row " << i;
  }
  void expect_grads(const std::vector<T>& db) const {
    for (std::int64_t v = 0; v < V; ++v)
      EXPECT_NEAR(static_cast<double>(static_cast<A>(db[v])), ref.d_bias[v], tol<T>())
          << "class " << v;
    for (const T& x : dx_memory) EXPECT_EQ(static_cast<double>(static_cast<A>(x)), 7.0);
  }
};

template <class T>
class CpuLinearEmptyHidden : public ::testing::Test {};
using dtypes = ::testing::Types<float, double, Eigen::bfloat16>;
TYPED_TEST_SUITE(CpuLinearEmptyHidden, dtypes);

TYPED_TEST(CpuLinearEmptyHidden, EveryCallGivesTheBiasAloneCrossEntropyInOneRowChunks) {
  using T = TypeParam;
  using A = xent::accumulator_t<T>;
  for (int threads : {1, 2}) {
    const xent::cpu exec(threads);
    for (dw_accumulation acc : {dw_accumulation::fp32, dw_accumulation::output}) {
      for (bool null_grads : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "threads " << threads << ", accumulate "
                                          << (acc == dw_accumulation::fp32 ? "fp32" : "output")
                                          << (null_grads ? ", null" : ", real") << " gradients");
        empty_hidden_case<T> c;
        xent::linear_options opts;
        opts.accumulate = acc;

        A loss = 0;
        std::vector<A> lse(N);
        xent::basic_forward_outputs<A> out;
        out.loss = &loss;
        out.lse = {lse.data(), N};
        auto fws = c.workspace(linear_pass::forward, acc);
        xent::linear_forward(exec, c.hidden(), c.weight(), c.bias_view(), c.targets(), opts, out,
                             {fws.data(), fws.size()});
        c.expect_forward(loss, lse);

        auto tws = c.workspace(linear_pass::training, acc);
        std::vector<T> db(V);
        A fused_loss = 0;
        xent::basic_forward_outputs<A> fused_out;
        fused_out.loss = &fused_loss;
        fused_out.lse = {lse.data(), N};
        xent::linear_forward_backward(exec, c.hidden(), c.weight(), c.bias_view(), c.targets(),
                                      opts, xent::basic_upstream<A>{}, fused_out,
                                      c.grads(null_grads, db), {tws.data(), tws.size()});
        c.expect_forward(fused_loss, lse);
        c.expect_grads(db);

        std::vector<T> db_backward(V);
        xent::linear_backward(exec, c.hidden(), c.weight(), c.bias_view(), c.targets(), opts,
                              xent::vector_view<const A>(lse.data(), N), xent::basic_upstream<A>{},
                              c.grads(null_grads, db_backward), {tws.data(), tws.size()});
        c.expect_grads(db_backward);
      }
    }
  }
}

TEST(CpuVocabParallelLinearEmptyHidden, EveryCallGivesTheBiasAloneCrossEntropyOnTwoRanks) {
  const int ranks = 2;
  const std::int64_t split[] = {0, 3, V};  // rank r holds classes [split[r], split[r + 1])
  empty_hidden_case<float> c;
  xent::inprocess_group group(ranks);
  std::vector<float> loss(ranks), fused_loss(ranks);
  std::vector<std::vector<float>> lse(ranks, std::vector<float>(N)), db(ranks);
  group.run([&](xent::inprocess_group::communicator comm) {
    const int r = comm.rank();
    const xent::cpu exec(1);
    const std::int64_t first = split[r], local = split[r + 1] - first;
    const xent::matrix_view<const float> weight(nullptr, local, 0, ld);
    const xent::vector_view<const float> bias(c.bias.data() + first, local);
    const xent::vocab_shard shard{first, V};
    auto workspace = [&](linear_pass pass) {
      const auto sizes = xent::vocab_parallel_linear_workspace_size<float>(exec, {N, 0, local}, V,
                                                                           ranks, pass, {}, 0);
      return std::vector<unsigned char>(sizes.minimal);
    };
    auto fws = workspace(linear_pass::forward), tws = workspace(linear_pass::training);
    auto ws = [&](std::vector<unsigned char>& b) {
      xent::vocab_parallel_linear_workspace w;
      w.data = b.data();
      w.bytes = b.size();
      w.chunk_rows = 1;
      return w;
    };

    xent::forward_outputs out;
    out.loss = &loss[r];
    out.lse = {lse[r].data(), N};
    xent::vocab_parallel_linear_forward(exec, comm, c.hidden(), weight, bias, shard, c.targets(),
                                        {}, out, ws(fws));

    db[r].assign(local, 0.0f);
    xent::linear_grads<float> grads;
    grads.d_hidden = {nullptr, N, 0, ld};
    grads.d_weight = {nullptr, local, 0, ld};
    grads.d_bias = {db[r].data(), local};
    xent::forward_outputs fused_out;
    fused_out.loss = &fused_loss[r];
    xent::vocab_parallel_linear_forward_backward(exec, comm, c.hidden(), weight, bias, shard,
                                                 c.targets(), {}, xent::upstream{}, fused_out,
                                                 grads, ws(tws));
    c.expect_forward(fused_loss[r], lse[r]);
    for (std::int64_t v = 0; v < local; ++v)
      EXPECT_NEAR(db[r][v], c.ref.d_bias[first + v], tol<float>()) << "class " << first + v;

    std::fill(db[r].begin(), db[r].end(), 0.0f);
    xent::vocab_parallel_linear_backward(exec, comm, c.hidden(), weight, bias, shard, c.targets(),
                                         {}, xent::vector_view<const float>(lse[r].data(), N),
                                         xent::upstream{}, grads, ws(tws));
    for (std::int64_t v = 0; v < local; ++v)
      EXPECT_NEAR(db[r][v], c.ref.d_bias[first + v], tol<float>()) << "class " << first + v;
  });
  for (int r = 0; r < ranks; ++r) c.expect_forward(loss[r], lse[r]);
}

}  // namespace
