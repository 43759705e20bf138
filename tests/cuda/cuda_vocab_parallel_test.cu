// The CUDA backend's vocab-parallel calls (cuda/vocab_parallel.cuh). The shared vocab-parallel
// tests (tests/cpu/vocab_parallel_backend_tests.hpp: every option and dtype on 1-4 ranks, uneven,
// empty and reordered shards, edge vocabularies, long shards, many rows, ignored and absent rows,
// each case held to the ranks' agreement, the float64 oracle and the unsharded xent::cuda call)
// run on staged ranks; the device's own error reports (a bad tiling, class ids out of range), the
// workspace and stream errors; NCCL groups and stream capture.
//
// Three kinds of group (tests/cuda/groups.cuh) run the cases:
//   - staged_group: R ranks as threads on ONE GPU, the all-gather staged through the host (a test
//     communicator: it synchronises the rank's stream first). It runs on any machine with a GPU
//     and checks everything but the stream ordering of a real collective.
//   - an NCCL group of one rank on GPU 0 (ncclCommInitAll), also under CUDA graph capture;
//   - an NCCL group over every visible GPU (ncclCommInitAll, one thread per GPU): needs >= 2 GPUs,
//     skipped with the reason otherwise.
// The NCCL tests are compiled where NCCL is (XENT_HAS_NCCL); without a GPU every test skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>
#include <xent/xent.hpp>

#include "cpu/harness.hpp"
#include "cpu/vocab_parallel_backend_tests.hpp"
#include "cpu/vocab_parallel_harness.hpp"
#include "cpu/vocab_split.hpp"
#include "cuda/device_util.cuh"
#include "cuda/groups.cuh"
#include "oracle/oracle.hpp"

namespace {

using xent::reduction;
using xent_test::dbuf;
using xent_test::ok;
using xent_test::staged_group;
using xt::spec;
using xt::split;
// CUDA declares a global `half`; the test names Eigen's fp16 type this way.
using fp16 = xt::half;
using xt::bf16;

/// `v` and one element more: a device buffer is never empty (an empty shard's views still point
/// into an allocation), and a read one past the last element lands on it, not outside.
template <class T>
std::vector<T> padded(std::vector<T> v) {
  v.push_back(T(0.0f));
  return v;
}

/// A case (or a rank's shard of it, xvp::shard_of) on the current device: logits, targets, soft
/// targets, class weights and the upstream gradient's device parts, with the options, upstream and
/// targets pointing at them.
template <class T>
struct device_case {
  const xt::dataset<T>& d;
  dbuf<T> logits, probs;
  dbuf<std::int32_t> t32;
  dbuf<std::int64_t> t64;
  dbuf<float> weights, up_rows, scale;

  explicit device_case(const xt::dataset<T>& d_)
      : d(d_),
        logits(padded(d_.logits)),
        probs(padded(d_.probs)),
        t32(padded(d_.t32)),
        t64(padded(d_.t64)),
        weights(padded(d_.weights)),
        up_rows(padded(d_.up_rows)),
        scale(std::vector<float>{d_.scale_value}) {}

  xent::matrix_view<const T> view() const { return {logits.ptr, d.s.rows, d.s.cols, d.s.ld()}; }
  xent::options options() const {
    xent::options o = d.options();
    if (d.s.weights) o.class_weights = {weights.ptr, static_cast<std::int64_t>(d.weights.size())};
    return o;
  }
  xent::upstream upstream() const {
    xent::upstream u = d.upstream();
    if (u.scale_ptr) u.scale_ptr = scale.ptr;
    if (u.rows.data) u.rows = {up_rows.ptr, u.rows.size};
    return u;
  }
  /// Calls f with the device targets in the form the case asks for (the host targets' shape).
  template <class F>
  void with_targets(F&& f) const {
    d.with_targets([&](auto t) { f(device_targets(t)); });
  }

 private:
  xent::vector_view<const std::int32_t> device_targets(
      xent::vector_view<const std::int32_t> t) const {
    return {t32.ptr, t.size};
  }
  xent::vector_view<const std::int64_t> device_targets(
      xent::vector_view<const std::int64_t> t) const {
    return {t64.ptr, t.size};
  }
  xent::soft_targets<T> device_targets(const xent::soft_targets<T>& t) const {
    return {xent::matrix_view<const T>(probs.ptr, t.probs.rows, t.probs.cols, t.probs.ld)};
  }
};

/// A call's outputs on the device, starting as xvp::poisoned's, its device error count, and the
/// way back into a call_result.
template <class G>
struct device_result {
  std::int64_t rows;
  dbuf<float> row_loss, lse, loss;
  dbuf<std::int64_t> argmax, correct;
  dbuf<G> grad;
  dbuf<int> errors;

  explicit device_result(const xt::call_result<G>& p)
      : rows(static_cast<std::int64_t>(p.lse.size())),
        row_loss(padded(p.row_loss)),
        lse(padded(p.lse)),
        loss(std::vector<float>{p.loss}),
        argmax(padded(p.argmax)),
        correct(std::vector<std::int64_t>{p.correct}),
        grad(padded(p.grad)),
        errors(std::vector<int>{0}) {}

  xent::forward_outputs all(const spec& s) {
    return xvp::all_outputs(s, rows, loss.ptr, row_loss.ptr, lse.ptr, argmax.ptr, correct.ptr);
  }
  xt::call_result<G> fetch() const {
    xt::call_result<G> r;
    r.row_loss = row_loss.download();
    r.lse = lse.download();
    r.argmax = argmax.download();
    r.grad = grad.download();
    for (auto* v : {&r.row_loss, &r.lse}) v->pop_back();
    r.argmax.pop_back();
    r.grad.pop_back();
    r.loss = loss.download()[0];
    r.correct = correct.download()[0];
    return r;
  }
};

/// A rank of `Group` whose calls go through the split phases (parallel/vocab_parallel_phases.hpp):
/// the group's all-gather stands for the caller's own collective between them.
template <class Group>
struct split_phases {
  Group group;
  int rank() const { return group.rank(); }
  int size() const { return group.size(); }
  cudaStream_t stream() const { return group.stream(); }
};

}  // namespace

namespace xvp {

/// xvp::rank_calls through the split phases: records, the all-gather, finish; the unfused form's
/// backward from the LSE and the rows' target mass that its forward finish wrote. The exchange's
/// buffers are device memory of the rank's own.
template <class Group, class T, class Targets, class G>
void rank_calls(const xent::cuda& exec, const split_phases<Group>& s,
                xent::matrix_view<const T> logits, xent::vocab_shard shard, const Targets& targets,
                const xent::options& opts, const xent::upstream& up,
                const xent::forward_outputs& out, xent::matrix_view<G> grad, bool fused) {
  const int R = s.size();
  const std::int64_t N = logits.rows;
  const bool argmax = out.argmax.data || out.num_correct;
  const std::size_t block = xent::vocab_parallel_exchange_bytes(
      exec, N, xent::detail::target_traits<Targets>::soft, opts, argmax);
  const xent_test::dbuf<unsigned char> send(block), recv(block * static_cast<std::size_t>(R));
  const xent_test::dbuf<float> mass(static_cast<std::size_t>(N) + 1);
  xent::vocab_parallel_records(exec, logits, shard, targets, opts, argmax,
                               {send.ptr, static_cast<std::int64_t>(block)});
  s.group.all_gather(send.ptr, recv.ptr, block);
  const xent::vector_view<const unsigned char> gathered(recv.ptr,
                                                        static_cast<std::int64_t>(recv.n));
  if (fused) {
    xent::vocab_parallel_finish(exec, R, logits, shard, targets, opts, gathered, out, up, grad);
  } else {
    xent::vocab_parallel_finish(exec, R, logits, shard, targets, opts, gathered, out,
                                xent::vector_view<float>(mass.ptr, N));
    xent::vocab_parallel_backward(exec, logits, shard, targets, opts,
                                  xent::vector_view<const float>(out.lse.data, N),
                                  xent::vector_view<const float>(mass.ptr, N), up, grad);
  }
  xent_test::ok(cudaStreamSynchronize(exec.stream));  // the buffers are freed on return
}

}  // namespace xvp

namespace {

/// `calls(exec, logits, targets, options, upstream, outputs, grad)` on `in` (a case or a rank's
/// shard of one) on `stream`, with the workspace of a group of `ranks`, into outputs poisoned as
/// xvp::poisoned's; returns what they wrote, the device error count in `errors`.
template <class T, class G, class Calls>
xt::call_result<G> on_device(const xt::dataset<T>& in, int ranks, cudaStream_t stream, int& errors,
                             const Calls& calls) {
  const std::int64_t N = in.s.rows;
  const device_case<T> d(in);
  device_result<G> out(xvp::poisoned<G>(N, in.s.ld()));
  dbuf<char> ws(xent::cuda_vocab_parallel_workspace_size(N, ranks));
  const xent::cuda exec{stream, ws.ptr, ws.n, out.errors.ptr};
  const xent::matrix_view<G> g(out.grad.ptr, N, in.s.cols, in.s.ld());
  ok(cudaDeviceSynchronize());  // the buffers' fills, made on the default stream, are done
  d.with_targets(
      [&](auto t) { calls(exec, d.view(), t, d.options(), d.upstream(), out.all(in.s), g); });
  ok(cudaStreamSynchronize(stream));
  errors = out.errors.download()[0];
  return out.fetch();
}

/// A rank's calls of one form as the rank of `group` holding classes [first, first + in.s.cols)
/// of `vocab`.
template <class T, class G, class Group>
xt::call_result<G> rank_on_device(const xt::dataset<T>& in, std::int64_t first, std::int64_t vocab,
                                  const Group& group, bool fused, int& errors) {
  return on_device<T, G>(
      in, group.size(), group.stream(), errors,
      [&](const xent::cuda& exec, auto x, const auto& t, const auto& opts, const auto& up,
          const auto& o, auto g) {
        xvp::rank_calls(exec, group, x, {first, vocab}, t, opts, up, o, g, fused);
      });
}

/// The CUDA backend of the shared vocab-parallel tests over a way of starting ranks:
/// `launch(ranks, f)` calls f(group) on every rank of a group of that many.
template <class Launch>
struct device_ranks {
  Launch launch;

  template <class T, class G>
  xvp::ranks_result<G> ranks(const xt::dataset<T>& d, const split& sp, bool fused) const {
    const std::vector<xt::dataset<T>> shards = xvp::shards_of(d, sp);
    xvp::ranks_result<G> res;
    res.ranks.resize(static_cast<std::size_t>(sp.ranks()));
    std::vector<int> errors(static_cast<std::size_t>(sp.ranks()), 0);
    launch(sp.ranks(), [&](const auto& group) {
      const int r = group.rank();
      res.ranks[r] =
          rank_on_device<T, G>(shards[r], sp.first(r), d.s.cols, group, fused, errors[r]);
    });
    for (int r = 0; r < sp.ranks(); ++r)
      if (errors[r] != 0)
        res.errors += "  rank " + std::to_string(r) + " counted " + std::to_string(errors[r]) +
                      " device errors\n";
    return res;
  }

  /// The unsharded xent::cuda calls on the current device's default stream.
  template <class T>
  xt::call_result<float> unsharded(const xt::dataset<T>& d, bool fused) const {
    int errors = 0;
    xt::call_result<float> u = on_device<T, float>(
        d, 1, nullptr, errors,
        [&](const xent::cuda& exec, auto x, const auto& t, const auto& opts, const auto& up,
            const auto& o, auto g) {
          if (fused) {
            xent::forward_backward(exec, x, t, opts, up, o, g);
          } else {
            xent::forward(exec, x, t, opts, o);
            xent::backward(exec, x, t, opts, xent::vector_view<const float>(o.lse.data, x.rows), up,
                           g);
          }
        });
    EXPECT_EQ(errors, 0) << "the unsharded call counted device errors";
    return u;
  }

  template <class T, class G = T>
  bool run(const spec& s, const split& sp) const {
    return xvp::run_case<T, G>(*this, xt::make_dataset<T>(s), sp);
  }
};

struct staged_launch {
  template <class F>
  void operator()(int ranks, F&& f) const {
    xent_test::on_staged_ranks(ranks, f);
  }
};

/// The CUDA backend of the shared vocab-parallel tests (cpu/vocab_parallel_backend_tests.hpp):
/// ranks as staged threads on one GPU.
struct staged_ranks : device_ranks<staged_launch> {
  /// A bf16 gradient of float logits does not compile: the kernels store whole 16-byte vectors
  /// of the gradient per vector of logits (block/tile_gradient.cuh's store_whole).
  static constexpr bool narrower_gradient = false;
  void set_up() { REQUIRE_GPU(); }
  void tear_down() {}
};

struct staged_split_launch {
  template <class F>
  void operator()(int ranks, F&& f) const {
    xent_test::on_staged_ranks(ranks,
                               [&](const staged_group& g) { f(split_phases<staged_group>{g}); });
  }
};

/// The split phases on staged ranks: the same cases as staged_ranks, held to the same checks.
struct staged_split_ranks : device_ranks<staged_split_launch> {
  static constexpr bool narrower_gradient = false;
  void set_up() { REQUIRE_GPU(); }
  void tear_down() {}
};

// ---------------------------------------------------------------------------------------------
// Errors the device reports: NaN outputs and the error count
// ---------------------------------------------------------------------------------------------

/// What one rank's forward_backward wrote and its device error count.
struct rank_outcome {
  xt::call_result<float> out;
  int errors = 0;
};

/// forward_backward on 2 staged ranks, rank 0 holding classes [first0, first0 + cols0) of the
/// case's, rank 1 [first1, first1 + cols1).
std::vector<rank_outcome> two_ranks(const xt::dataset<float>& d, std::int64_t first0,
                                    std::int64_t cols0, std::int64_t first1, std::int64_t cols1) {
  const std::int64_t first[2] = {first0, first1};
  const std::vector<xt::dataset<float>> in{xvp::shard_of(d, first0, cols0),
                                           xvp::shard_of(d, first1, cols1)};
  std::vector<rank_outcome> out(2);
  xent_test::on_staged_ranks(2, [&](const staged_group& g) {
    const int r = g.rank();
    out[r].out = rank_on_device<float, float>(in[r], first[r], d.s.cols, g, true, out[r].errors);
  });
  return out;
}

TEST(CudaVocabParallelErrors, ShardsThatDoNotTileGiveNanOutputsAndOneErrorOnEveryRank) {
  REQUIRE_GPU();
  spec s;
  s.rows = 5;
  s.cols = 20;
  const auto d = xt::make_dataset<float>(s);
  // Overlapping shards [0, 12) and [8, 20); then a gap: [0, 8) and [12, 20).
  for (const auto& shards :
       {std::vector<std::int64_t>{0, 12, 8, 12}, std::vector<std::int64_t>{0, 8, 12, 8}}) {
    const auto out = two_ranks(d, shards[0], shards[1], shards[2], shards[3]);
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_EQ(out[r].errors, 1);
      EXPECT_TRUE(std::isnan(out[r].out.loss));
      for (std::int64_t n = 0; n < s.rows; ++n) {
        EXPECT_TRUE(std::isnan(out[r].out.row_loss[n]));
        EXPECT_TRUE(std::isnan(out[r].out.lse[n]));
        EXPECT_EQ(out[r].out.argmax[n], -1);
      }
      EXPECT_EQ(out[r].out.correct, 0);
    }
  }
}

TEST(CudaVocabParallelErrors, OutOfRangeTargetIsNanWithZeroGradientCountedOncePerRank) {
  REQUIRE_GPU();
  spec s;
  s.rows = 4;
  s.cols = 20;
  s.reduce = reduction::sum;
  auto d = xt::make_dataset<float>(s);
  const oracle::result ref = oracle::evaluate(d.problem());
  d.set_target(1, 20);  // V: outside [0, V) although rank 1's columns end there
  d.set_target(2, -3);
  const auto out = two_ranks(d, 0, 10, 10, 10);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(out[r].errors, 2);
    EXPECT_TRUE(std::isnan(out[r].out.row_loss[1]));
    EXPECT_TRUE(std::isnan(out[r].out.row_loss[2]));
    EXPECT_FALSE(std::isnan(out[r].out.row_loss[0]));
    EXPECT_NEAR(out[r].out.row_loss[0], ref.row_loss[0], 1e-5 * (1 + ref.row_loss[0]));
    for (std::int64_t c = 0; c < 10; ++c) {
      EXPECT_EQ(out[r].out.grad[1 * 10 + c], 0.0f);
      EXPECT_EQ(out[r].out.grad[2 * 10 + c], 0.0f);
    }
  }
}

TEST(CudaVocabParallelErrors, SmallWorkspaceAndForeignStreamAreClearErrors) {
  REQUIRE_GPU();
  dbuf<float> x(std::vector<float>(30, 1.0f)), loss(1);
  dbuf<std::int64_t> y(std::vector<std::int64_t>{0, 1, 2});
  dbuf<char> ws(xent::cuda_vocab_parallel_workspace_size(3, 1) - 1);
  xent::inprocess_group group(1);
  cudaStream_t other;
  ok(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  auto argument = [&](cudaStream_t group_stream, std::size_t bytes) -> std::string {
    std::string arg = "(no error)";
    group.run([&](xent::inprocess_group::communicator comm) {
      try {
        xent::vocab_parallel_forward(
            xent::cuda{nullptr, ws.ptr, bytes, nullptr}, staged_group(comm, group_stream),
            xent::matrix_view<const float>(x.ptr, 3, 10), xent::vocab_shard{0, 10},
            xent::vector_view<const std::int64_t>(y.ptr, 3), xent::options{},
            xent::forward_outputs{loss.ptr});
      } catch (const xent::error& e) {
        arg = e.argument();
      }
    });
    return arg;
  };
  EXPECT_EQ(argument(nullptr, ws.n), "exec.workspace");
  EXPECT_EQ(argument(other, ws.n + 1), "group");
  cudaStreamDestroy(other);
}

#if defined(XENT_HAS_NCCL)

using xent_test::nccl_comms;
using xent_test::visible_gpus;

/// Ranks over NCCL: rank r on device r, one thread per rank (every communicator of `nc`).
struct nccl_launch {
  const nccl_comms* nc;
  template <class F>
  void operator()(int ranks, F&& f) const {
    if (static_cast<std::size_t>(ranks) != nc->comms.size())
      throw std::logic_error("a split of " + std::to_string(ranks) + " ranks on " +
                             std::to_string(nc->comms.size()) + " NCCL communicators");
    xent_test::on_nccl_ranks(*nc, f);
  }
};

using nccl_ranks = device_ranks<nccl_launch>;

TEST(NcclVocabParallel, OneRankGroupMatchesTheUnshardedCall) {
  REQUIRE_GPU();
  nccl_comms nc(1);
  ASSERT_EQ(nc.comms.size(), 1u);
  const nccl_ranks backend{{&nc}};
  for (const spec& s : xvp::every_option(7, 1000, 700))
    EXPECT_TRUE(backend.run<bf16>(s, xt::even_split(s.cols, 1)));
}

TEST(NcclVocabParallel, GroupOverEveryVisibleGpuMatchesUnshardedAndOracle) {
  REQUIRE_GPU();
  const int gpus = std::min(visible_gpus(), 8);
  if (gpus < 2)
    GTEST_SKIP() << "needs at least 2 GPUs for a multi-rank NCCL group; " << gpus
                 << " visible (the one-rank and staged tests cover the rest)";
  nccl_comms nc(gpus);
  ASSERT_EQ(nc.comms.size(), static_cast<std::size_t>(gpus));
  const nccl_ranks backend{{&nc}};
  xt::case_budget b;
  std::uint64_t seed = 900;
  auto sweep = [&](auto dtype_tag, std::int64_t rows, std::int64_t cols) {
    using T = decltype(dtype_tag);
    for (const spec& s : xvp::every_option(rows, cols, seed += 50))
      for (const split& sp : xt::splits(cols, gpus))
        if (!b.record(backend.run<T>(s, sp))) return false;
    return true;
  };
  if (sweep(float{}, 19, 3001) && sweep(bf16{}, 19, 32003)) sweep(fp16{}, 7, 50257);
}

/// The one-rank NCCL path in a CUDA graph: captured, replayed, equal to the direct call bit for bit
/// (NCCL collectives are capturable; nothing in the call waits for the host).
TEST(NcclVocabParallel, ForwardBackwardUnderStreamCaptureMatchesTheDirectCall) {
  REQUIRE_GPU();
  nccl_comms nc(1);
  ASSERT_EQ(nc.comms.size(), 1u);
  spec s;
  s.rows = 64;
  s.cols = 32000;
  s.label_smoothing = 0.1f;
  const auto data = xt::make_dataset<bf16>(s);
  cudaStream_t stream;
  ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const xent::nccl_group group(nc.comms[0], stream);
  const device_case<bf16> d(data);
  device_result<bf16> out(xvp::poisoned<bf16>(s.rows, s.ld()));
  dbuf<char> ws(xent::cuda_vocab_parallel_workspace_size(s.rows, 1));
  const xent::cuda exec{stream, ws.ptr, ws.n, out.errors.ptr};
  xent::forward_outputs o;
  o.loss = out.loss.ptr;
  o.lse = {out.lse.ptr, s.rows};
  const xent::matrix_view<bf16> g(out.grad.ptr, s.rows, s.cols);
  ok(cudaDeviceSynchronize());
  auto call = [&] {
    d.with_targets([&](auto t) {
      xent::vocab_parallel_forward_backward(exec, group, d.view(), {0, s.cols}, t, d.options(),
                                            d.upstream(), o, g);
    });
  };
  call();
  ok(cudaStreamSynchronize(stream));
  const auto direct = out.grad.download();
  const float direct_loss = out.loss.download()[0];
  ok(cudaMemset(out.grad.ptr, 0, out.grad.n * sizeof(bf16)));
  ok(cudaMemset(out.loss.ptr, 0, sizeof(float)));

  cudaGraph_t graph;
  cudaGraphExec_t inst;
  ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  call();
  ok(cudaStreamEndCapture(stream, &graph));
  ok(cudaGraphInstantiate(&inst, graph, 0));
  for (int replay = 0; replay < 2; ++replay) ok(cudaGraphLaunch(inst, stream));
  ok(cudaStreamSynchronize(stream));
  EXPECT_EQ(out.loss.download()[0], direct_loss);
  const auto captured = out.grad.download();
  EXPECT_EQ(std::memcmp(captured.data(), direct.data(), direct.size() * sizeof(bf16)), 0);
  EXPECT_EQ(out.errors.download()[0], 0);
  cudaGraphExecDestroy(inst);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

#else

TEST(NcclVocabParallel, SkippedWithoutNccl) {
  GTEST_SKIP() << "built without NCCL (XENT_HAS_NCCL undefined): the NCCL group tests are not "
                  "compiled; the staged-group tests cover the CUDA path";
}

#endif

}  // namespace

namespace xvp {
INSTANTIATE_TYPED_TEST_SUITE_P(Cuda, VocabParallelBackend, staged_ranks);
INSTANTIATE_TYPED_TEST_SUITE_P(CudaSplit, VocabParallelBackend, staged_split_ranks);
}  // namespace xvp
