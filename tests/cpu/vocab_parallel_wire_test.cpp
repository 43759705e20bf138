// What the vocab-parallel calls put on the wire: a communicator that counts the bytes of every
// all-gather (around inprocess_group) holds each call to the records parallel/records.hpp
// documents, per row and per rank, for every option set: 12 bytes for plain class ids, forward
// and forward_backward alike, and the fused linear calls' per chunk.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "vocab_split.hpp"
#include "xent/xent.hpp"

namespace {

/// One rank's handle on an inprocess_group whose all-gathers are counted: the bytes of each, in
/// call order, per rank.
class counting_comm {
 public:
  counting_comm(xent::inprocess_group::communicator comm, std::vector<std::size_t>* bytes)
      : comm_(comm), bytes_(bytes) {}
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  void all_gather(const void* send, void* recv, std::size_t bytes) const {
    bytes_->push_back(bytes);
    comm_.all_gather(send, recv, bytes);
  }

 private:
  xent::inprocess_group::communicator comm_;
  std::vector<std::size_t>* bytes_;
};

/// A block of `rows` records of `record` bytes behind the 32-byte header, padded to 8 bytes.
std::size_t block_bytes(std::int64_t rows, std::size_t record) {
  return (32 + static_cast<std::size_t>(rows) * record + 7) / 8 * 8;
}

/// The option sets the records depend on, and the bytes each documents per row.
struct wire_case {
  const char* name;
  bool soft;
  float label_smoothing;
  bool argmax;        ///< argmax and, with class ids, num_correct asked for
  bool extras;        ///< class weights, z-loss, softcap and ignored rows: no bytes of their own
  std::size_t bytes;  ///< forward and forward_backward
};

const wire_case wire_cases[] = {
    {"class ids", false, 0.0f, false, false, 12},
    {"class ids, weights, z-loss, softcap, ignored rows", false, 0.0f, false, true, 12},
    {"class ids, label smoothing", false, 0.1f, false, true, 16},
    {"soft targets", true, 0.0f, false, false, 16},
    {"soft targets, label smoothing, weights", true, 0.1f, false, true, 16},
    {"class ids, argmax", false, 0.0f, true, false, 24},
    {"class ids, label smoothing, argmax", false, 0.1f, true, false, 28},
    {"soft targets, argmax", true, 0.0f, true, false, 28},
};

/// A small vocab-parallel problem: N rows of V = 37 classes, held whole; each rank cuts its shard.
struct problem {
  static constexpr std::int64_t vocab = 37;
  std::int64_t rows;
  std::vector<float> logits, probs, weights;
  std::vector<std::int64_t> targets;

  explicit problem(std::int64_t n) : rows(n), weights(vocab) {
    for (std::int64_t i = 0; i < n * vocab; ++i) {
      logits.push_back(static_cast<float>((i * 7919) % 101) / 17.0f - 3.0f);
      probs.push_back(static_cast<float>((i * 31) % 13 + 1) / (13.0f * vocab));
    }
    for (std::int64_t c = 0; c < vocab; ++c) weights[c] = 0.5f + static_cast<float>(c % 5) / 4.0f;
    for (std::int64_t r = 0; r < n; ++r) targets.push_back((r * 11) % vocab);
  }

  xent::options options_of(const wire_case& c) {
    xent::options o;
    o.label_smoothing = c.label_smoothing;
    if (c.extras) {
      o.class_weights = {weights.data(), vocab};
      if (!c.soft) {
        o.z_loss = 1e-3f;
        o.softcap = 20.0f;
        targets[1] = o.ignore_index;
      }
    }
    return o;
  }
};

/// Every rank's all-gathers of one call form: `form` runs a rank's call given its communicator,
/// logits shard, shard, targets (class ids or soft), options, outputs and gradient.
template <class Form>
std::vector<std::vector<std::size_t>> gathers(problem& p, const wire_case& c, int ranks,
                                              const Form& form) {
  const xent::options opts = p.options_of(c);
  const xt::split sp = xt::even_split(p.vocab, ranks);
  std::vector<std::vector<std::size_t>> bytes(static_cast<std::size_t>(ranks));
  xent::inprocess_group group(ranks);
  group.run([&](xent::inprocess_group::communicator comm) {
    const int r = comm.rank();
    const counting_comm counted(comm, &bytes[static_cast<std::size_t>(r)]);
    const std::int64_t first = sp.first(r), cols = sp.cols(r), N = p.rows;
    std::vector<float> x(static_cast<std::size_t>(N * cols)), t(x.size()), g(x.size());
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t k = 0; k < cols; ++k) {
        x[n * cols + k] = p.logits[n * p.vocab + first + k];
        t[n * cols + k] = p.probs[n * p.vocab + first + k];
      }
    std::vector<float> row_loss(N), lse(N);
    std::vector<std::int64_t> argmax(N);
    std::int64_t correct = 0;
    xent::forward_outputs out;
    out.row_loss = {row_loss.data(), N};
    out.lse = {lse.data(), N};
    if (c.argmax) {
      out.argmax = {argmax.data(), N};
      if (!c.soft) out.num_correct = &correct;
    }
    xent::options o = opts;
    o.reduce = xent::reduction::none;
    const xent::matrix_view<const float> logits(x.data(), N, cols);
    const xent::matrix_view<float> grad(g.data(), N, cols);
    const xent::vocab_shard shard{first, p.vocab};
    if (c.soft)
      form(counted, logits, shard, xent::soft(xent::matrix_view<const float>(t.data(), N, cols)), o,
           out, grad);
    else
      form(counted, logits, shard, xent::vector_view<const std::int64_t>(p.targets.data(), N), o,
           out, grad);
  });
  return bytes;
}

/// Every rank made one all-gather per entry of `expected`, of those bytes.
void expect_gathers(const std::vector<std::vector<std::size_t>>& got,
                    const std::vector<std::size_t>& expected, const std::string& what) {
  for (std::size_t r = 0; r < got.size(); ++r)
    EXPECT_EQ(got[r], expected) << what << ", rank " << r;
}

TEST(CpuVocabParallelWire, RecordsCarryOnlyWhatTheCallMerges) {
  for (std::int64_t rows : {6, 5})  // 5: the block is padded to 8 bytes
    for (const wire_case& c : wire_cases) {
      problem p(rows);
      const std::string what = std::string(c.name) + ", " + std::to_string(rows) + " rows";
      const std::vector<std::size_t> one{block_bytes(rows, c.bytes)};
      expect_gathers(gathers(p, c, 3,
                             [](const auto& comm, auto logits, auto shard, const auto& targets,
                                const auto& opts, const auto& out, auto) {
                               xent::vocab_parallel_forward(xent::cpu{1}, comm, logits, shard,
                                                            targets, opts, out);
                             }),
                     one, what + ", forward");
      expect_gathers(gathers(p, c, 3,
                             [](const auto& comm, auto logits, auto shard, const auto& targets,
                                const auto& opts, const auto& out, auto grad) {
                               xent::vocab_parallel_forward_backward(
                                   xent::cpu{1}, comm, logits, shard, targets, opts, {}, out, grad);
                             }),
                     one, what + ", forward_backward");
      // Backward from a saved LSE: class ids exchange nothing, soft targets their mass alone.
      const std::vector<std::size_t> backward =
          c.soft ? std::vector<std::size_t>{block_bytes(rows, 4)} : std::vector<std::size_t>{};
      expect_gathers(gathers(p, c, 3,
                             [&](const auto& comm, auto logits, auto shard, const auto& targets,
                                 const auto& opts, const auto&, auto grad) {
                               const std::vector<float> lse(rows, 1.0f), up(rows, 1.0f);
                               xent::upstream u;
                               u.rows = {up.data(), rows};
                               xent::vocab_parallel_backward(
                                   xent::cpu{1}, comm, logits, shard, targets, opts,
                                   xent::vector_view<const float>(lse.data(), rows), u, grad);
                             }),
                     backward, what + ", backward");
    }
}

TEST(CpuVocabParallelWire, FusedLinearCallsSendTheSameRecordsPerChunk) {
  // 6 rows in chunks of 4 and 2, hidden size 3, V = 37 over 2 ranks.
  constexpr std::int64_t N = 6, D = 3, chunk = 4;
  for (const wire_case& c : wire_cases) {
    problem p(N);
    const std::vector<std::size_t> chunks{block_bytes(chunk, c.bytes),
                                          block_bytes(N - chunk, c.bytes)};
    std::vector<float> hidden(N * D);
    for (std::int64_t i = 0; i < N * D; ++i) hidden[i] = static_cast<float>(i % 7) / 7.0f - 0.4f;
    auto linear = [&](const auto& comm, auto logits, auto shard, const auto& targets,
                      const auto& opts, const auto& out, auto) {
      // The weight shard, V_local x D (its values do not change the bytes).
      std::vector<float> w(static_cast<std::size_t>(logits.cols * D));
      for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 5) / 5.0f;
      std::vector<float> dw(w.size());
      xent::linear_options lo;
      static_cast<xent::options&>(lo) = opts;
      const auto sizes = xent::vocab_parallel_linear_workspace_size<float>(
          xent::cpu{1}, {N, D, logits.cols}, shard.vocab, comm.size(), xent::linear_pass::training,
          lo);
      std::vector<unsigned char> ws(sizes.bytes);
      xent::vocab_parallel_linear_workspace wsv;
      wsv.data = ws.data();
      wsv.bytes = ws.size();
      wsv.chunk_rows = chunk;
      xent::linear_grads<float> grads;
      grads.d_weight = {dw.data(), logits.cols, D};
      xent::vocab_parallel_linear_forward_backward(
          xent::cpu{1}, comm, xent::matrix_view<const float>(hidden.data(), N, D),
          xent::matrix_view<const float>(w.data(), logits.cols, D),
          xent::vector_view<const float>{}, shard, targets, lo, {}, out, grads, wsv);
    };
    expect_gathers(gathers(p, c, 2, linear), chunks, std::string(c.name) + ", fused linear");
  }
}

}  // namespace
