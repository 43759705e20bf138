// The option matrix against the float64 oracle: forward (row_loss, loss, lse, argmax,
// num_correct), backward from forward's LSE and forward_backward (in place and not), each on
// poisoned outputs with sentinels in the ld padding (tests/cpu/harness.hpp does the checking).
//
// The full product of the options runs only over small vocabularies with a 64-element chunk, so
// that V in {63, 64, 65} crosses chunk boundaries cheaply; what varies case by case but not worth
// multiplying (rows, ld padding, in place, upstream form, ignore_index, threads) is drawn from a
// generator seeded by the case number, so every run checks the same cases. The large vocabularies
// (chunk +- 1 at the default chunk, 32000 ... 262145) run a handful of option mixes each; so do
// the multi-threaded row partition and the vocabulary split across threads (rows < threads).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "harness.hpp"

namespace {

using xent::reduction;
using xt::bf16;
using xt::half;
using xt::ignore_mode;
using xt::spec;
using xt::target_kind;
using xt::upstream_mode;

constexpr std::int64_t kChunk = xent::cpu_detail::policy::chunk;

/// Every combination of the options and row counts over V in {1, 2, 3, 63, 64, 65} with chunk 64.
std::vector<spec> small_vocab_product(std::uint64_t salt) {
  std::vector<spec> out;
  const std::int64_t vocabs[] = {1, 2, 3, 63, 64, 65};
  const std::int64_t row_counts[] = {0, 1, 3, 7, 19};
  const target_kind kinds[] = {target_kind::int32, target_kind::int64, target_kind::soft};
  const reduction reds[] = {reduction::none, reduction::mean, reduction::sum};
  const ignore_mode igs[] = {ignore_mode::none, ignore_mode::some, ignore_mode::all};
  std::uint64_t id = 0;
  for (std::int64_t V : vocabs)
    for (target_kind kind : kinds)
      for (reduction red : reds)
        for (ignore_mode ig : igs) {
          if (kind == target_kind::soft && ig != ignore_mode::none) continue;
          for (int eps = 0; eps < 2; ++eps)
            for (int w = 0; w < 2; ++w)
              for (int zl = 0; zl < 2; ++zl)
                for (int cap = 0; cap < 2; ++cap)
                  for (std::int64_t rows : row_counts) {
                    spec s;
                    s.seed = salt * 1000003 + (++id);
                    std::mt19937_64 pick(s.seed);
                    s.cols = V;
                    s.rows = rows;
                    s.pad = pick() % 2 ? 3 : 0;
                    s.kind = kind;
                    s.reduce = red;
                    s.ignore = ig;
                    // ignore_index: PyTorch's default, another negative, or a valid class id.
                    const std::int64_t iis[] = {-100, -1, V > 1 ? 1 : 0};
                    s.ignore_index = iis[pick() % 3];
                    s.label_smoothing = eps ? 0.1f : 0.0f;
                    s.weights = w;
                    s.z_loss = zl ? 1e-3f : 0.0f;
                    s.softcap = cap ? 30.0f : 0.0f;
                    s.chunk = 64;
                    s.threads = pick() % 3 == 0 ? 4 : 1;  // one thread below 65536 logits anyway
                    s.in_place = pick() % 2;
                    s.up = pick() % 2 ? upstream_mode::pointer_or_rows : upstream_mode::scale;
                    s.scale = pick() % 4 == 0 ? 1.0f : 0.75f;
                    out.push_back(s);
                  }
        }
  return out;
}

template <class T, class G = T>
void run_small_vocab_product(std::uint64_t salt) {
  xt::case_budget budget;
  for (const spec& s : small_vocab_product(salt))
    if (!budget.record(xt::run_case<T, G>(xt::make_dataset<T>(s)))) return;
  EXPECT_GT(budget.cases(), 10000);
}

TEST(CpuMatrixSmallVocab, Float32MatchesFloat64Oracle) { run_small_vocab_product<float>(1); }
TEST(CpuMatrixSmallVocab, Bfloat16MatchesFloat64Oracle) { run_small_vocab_product<bf16>(2); }
TEST(CpuMatrixSmallVocab, HalfMatchesFloat64Oracle) { run_small_vocab_product<half>(3); }
// float64 logits (unrounded double data) accumulate in double: held to about 1e-14 of the terms.
TEST(CpuMatrixSmallVocab, Float64MatchesFloat64OracleToDoublePrecision) {
  run_small_vocab_product<double>(9);
}

/// Logits of one dtype, gradient of another (always out of place): a sample of the product.
template <class T, class G>
void run_mixed(std::uint64_t salt) {
  xt::case_budget budget;
  std::uint64_t i = 0;
  for (const spec& s : small_vocab_product(salt))
    if (++i % 31 == 0 && !budget.record(xt::run_case<T, G>(xt::make_dataset<T>(s)))) return;
}

TEST(CpuMatrixSmallVocab, MixedDtypesMatchFloat64Oracle) {
  run_mixed<bf16, float>(4);
  run_mixed<half, float>(5);
  run_mixed<float, bf16>(6);
  run_mixed<float, half>(7);
  run_mixed<bf16, half>(8);
  run_mixed<double, float>(10);
  run_mixed<float, double>(11);
}

/// A handful of option mixes that together touch every option, for the sampled sizes.
std::vector<spec> option_mixes(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::vector<spec> mixes;
  spec s;
  s.rows = rows;
  s.cols = cols;
  s.seed = seed;
  // 1. plain mean over int64 class ids.
  mixes.push_back(s);
  // 2. sum, int32, some ignored, label smoothing, weights, padding.
  s.kind = target_kind::int32;
  s.reduce = reduction::sum;
  s.ignore = ignore_mode::some;
  s.label_smoothing = 0.1f;
  s.weights = true;
  s.pad = 16;
  s.seed = seed + 1;
  mixes.push_back(s);
  // 3. none with per-row upstream, z-loss, softcap, in place.
  s = spec{};
  s.rows = rows;
  s.cols = cols;
  s.reduce = reduction::none;
  s.up = upstream_mode::pointer_or_rows;
  s.z_loss = 1e-3f;
  s.softcap = 30.0f;
  s.in_place = true;
  s.pad = 1;
  s.seed = seed + 2;
  mixes.push_back(s);
  // 4. soft targets, mean, everything on.
  s = spec{};
  s.rows = rows;
  s.cols = cols;
  s.kind = target_kind::soft;
  s.label_smoothing = 0.1f;
  s.weights = true;
  s.z_loss = 1e-3f;
  s.softcap = 30.0f;
  s.up = upstream_mode::pointer_or_rows;
  s.seed = seed + 3;
  mixes.push_back(s);
  // 5. mean with scale_ptr, class id 0 as ignore_index, weights, z-loss.
  s = spec{};
  s.rows = rows;
  s.cols = cols;
  s.ignore = ignore_mode::some;
  s.ignore_index = 0;
  s.weights = true;
  s.z_loss = 1e-3f;
  s.up = upstream_mode::pointer_or_rows;
  s.in_place = true;
  s.seed = seed + 4;
  mixes.push_back(s);
  return mixes;
}

template <class T>
void run_mixes(std::int64_t rows, std::int64_t cols, int threads, std::int64_t chunk,
               std::uint64_t seed, xt::case_budget& budget, bool& go_on) {
  for (spec s : option_mixes(rows, cols, seed)) {
    if (!go_on) return;
    s.threads = threads;
    s.chunk = chunk;
    go_on = budget.record(xt::run_case<T>(xt::make_dataset<T>(s)));
  }
}

/// V in {chunk - 1, chunk, chunk + 1} at the default chunk (2048), one thread and several.
TEST(CpuMatrixChunkEdges, DefaultChunkBoundariesMatchFloat64Oracle) {
  xt::case_budget budget;
  bool go_on = true;
  std::uint64_t seed = 100;
  for (std::int64_t V : {kChunk - 1, kChunk, kChunk + 1, 2 * kChunk + 1}) {
    run_mixes<float>(7, V, 1, 0, seed += 10, budget, go_on);
    run_mixes<bf16>(3, V, 4, 0, seed += 10, budget, go_on);
    run_mixes<half>(19, V, 7, 0, seed += 10, budget, go_on);
    run_mixes<double>(5, V, 3, 0, seed += 10, budget, go_on);
  }
}

/// Chunk sizes outside [16, 8192] are clamped (cpu/policy.hpp). Chunk 1 -> 16 with V = 5000 also
/// puts more than 256 chunks in a row, past what forward_backward's exp cache holds.
TEST(CpuMatrixChunkEdges, ClampedChunkSizesMatchFloat64Oracle) {
  xt::case_budget budget;
  bool go_on = true;
  std::uint64_t seed = 150;
  for (std::int64_t V : {15, 16, 17, 5000}) {
    run_mixes<float>(3, V, 1, 1, seed += 10, budget, go_on);
    run_mixes<double>(2, V, 1, 1, seed += 10, budget, go_on);
  }
  for (std::int64_t V : {8191, 8193, 20000})
    run_mixes<bf16>(2, V, 1, 100000, seed += 10, budget, go_on);
}

/// 733 rows over several threads: the row partition (rows >= threads, >= 65536 logits).
TEST(CpuMatrixThreads, RowPartitionMatchesFloat64Oracle) {
  xt::case_budget budget;
  bool go_on = true;
  std::uint64_t seed = 200;
  for (std::int64_t V : {127, 128, 129}) {
    run_mixes<float>(733, V, 4, 64, seed += 10, budget, go_on);
    run_mixes<bf16>(733, V, 7, 64, seed += 10, budget, go_on);
  }
  run_mixes<half>(733, 1000, 7, 0, seed += 10, budget, go_on);
  run_mixes<double>(733, 129, 4, 64, seed += 10, budget, go_on);
}

/// Fewer rows than threads on a long vocabulary: each row's vocabulary is split across threads
/// and the slices merge through online_lse (cpu/backend.hpp, make_plan).
TEST(CpuMatrixThreads, VocabularySplitMatchesFloat64Oracle) {
  xt::case_budget budget;
  bool go_on = true;
  run_mixes<float>(1, 32000, 7, 0, 300, budget, go_on);
  run_mixes<bf16>(3, 32000, 4, 0, 310, budget, go_on);
  run_mixes<half>(3, 50257, 7, 64, 320, budget, go_on);
  run_mixes<float>(2, 65537, 7, 0, 330, budget, go_on);
  run_mixes<bf16>(5, 17000, 7, 0, 340, budget, go_on);  // 5 rows, 2 slices each
  run_mixes<double>(2, 40000, 7, 0, 350, budget, go_on);
}

/// The large vocabularies of real models, a handful of option mixes each.
TEST(CpuMatrixLargeVocab, Vocab32000MatchesFloat64Oracle) {
  xt::case_budget budget;
  bool go_on = true;
  run_mixes<float>(19, 32000, 4, 0, 400, budget, go_on);
  run_mixes<bf16>(7, 32000, 1, 0, 410, budget, go_on);
  run_mixes<double>(7, 32000, 4, 0, 420, budget, go_on);
}

TEST(CpuMatrixLargeVocab, Vocab50257MatchesFloat64Oracle) {
  xt::case_budget budget;
  bool go_on = true;
  run_mixes<bf16>(7, 50257, 4, 0, 500, budget, go_on);
  run_mixes<half>(3, 50257, 1, 0, 510, budget, go_on);
}

TEST(CpuMatrixLargeVocab, Vocab65537MatchesFloat64Oracle) {
  xt::case_budget budget;
  bool go_on = true;
  run_mixes<float>(3, 65537, 1, 0, 600, budget, go_on);
  run_mixes<half>(7, 65537, 4, 0, 610, budget, go_on);
}

TEST(CpuMatrixLargeVocab, Vocab262145MatchesFloat64Oracle) {
  xt::case_budget budget;
  bool go_on = true;
  run_mixes<bf16>(3, 262145, 7, 0, 700, budget, go_on);
  run_mixes<float>(1, 262145, 1, 0, 710, budget, go_on);
  run_mixes<half>(1, 262145, 7, 0, 720, budget, go_on);  // 7 slices of one row
}

}  // namespace
