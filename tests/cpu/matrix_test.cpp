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

using namespace xt::names;  // NOLINT(google-build-using-namespace): the harness's vocabulary

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

/// The options an option mix turns on (each at the value the small-vocabulary product uses).
enum option : unsigned {
  smoothing = 1,
  class_weights = 2,
  z_loss = 4,
  softcap = 8,
  per_row_upstream = 16,  ///< scale_ptr for mean and sum, per-row values for none
  in_place = 32,
};

struct option_mix {
  target_kind kind;
  reduction reduce;
  ignore_mode ignore;
  std::int64_t ignore_index;
  std::int64_t pad;
  unsigned on;  ///< the `option`s turned on
};

/// A handful of option mixes that together touch every option, for the sampled sizes.
std::vector<spec> option_mixes(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  const option_mix table[] = {
      // plain mean over int64 class ids.
      {target_kind::int64, reduction::mean, ignore_mode::none, -100, 0, 0},
      // sum, int32, some ignored, label smoothing, weights, padding.
      {target_kind::int32, reduction::sum, ignore_mode::some, -100, 16, smoothing | class_weights},
      // none with per-row upstream, z-loss, softcap, in place.
      {target_kind::int64, reduction::none, ignore_mode::none, -100, 1,
       z_loss | softcap | per_row_upstream | in_place},
      // soft targets, mean, everything on.
      {target_kind::soft, reduction::mean, ignore_mode::none, -100, 0,
       smoothing | class_weights | z_loss | softcap | per_row_upstream},
      // mean with scale_ptr, class id 0 as ignore_index, weights, z-loss.
      {target_kind::int64, reduction::mean, ignore_mode::some, 0, 0,
       class_weights | z_loss | per_row_upstream | in_place},
  };
  std::vector<spec> mixes;
  for (const option_mix& m : table) {
    spec s;
    s.rows = rows;
    s.cols = cols;
    s.seed = seed + mixes.size();
    s.kind = m.kind;
    s.reduce = m.reduce;
    s.ignore = m.ignore;
    s.ignore_index = m.ignore_index;
    s.pad = m.pad;
    s.label_smoothing = m.on & smoothing ? 0.1f : 0.0f;
    s.weights = m.on & class_weights;
    s.z_loss = m.on & z_loss ? 1e-3f : 0.0f;
    s.softcap = m.on & softcap ? 30.0f : 0.0f;
    s.up = m.on & per_row_upstream ? upstream_mode::pointer_or_rows : upstream_mode::scale;
    s.in_place = m.on & in_place;
    mixes.push_back(s);
  }
  return mixes;
}

enum class dtype { f32, bf16, f16, f64 };

/// One size's option mixes: logits of `type`, rows x cols, on `threads` threads, chunk `chunk`
/// (0: the default).
struct mix_run {
  dtype type;
  std::int64_t rows;
  std::int64_t cols;
  int threads;
  std::int64_t chunk;
};

template <class T>
bool run_mixes(const mix_run& r, std::uint64_t seed, xt::case_budget& budget) {
  for (spec s : option_mixes(r.rows, r.cols, seed)) {
    s.threads = r.threads;
    s.chunk = r.chunk;
    if (!budget.record(xt::run_case<T>(xt::make_dataset<T>(s)))) return false;
  }
  return true;
}

/// Each run's option mixes, the k-th seeded seed + 10 k, until the case budget is spent.
void run_mix_table(std::uint64_t seed, const std::vector<mix_run>& runs) {
  xt::case_budget budget;
  for (const mix_run& r : runs) {
    const bool go_on = r.type == dtype::f32    ? run_mixes<float>(r, seed, budget)
                       : r.type == dtype::bf16 ? run_mixes<bf16>(r, seed, budget)
                       : r.type == dtype::f16  ? run_mixes<half>(r, seed, budget)
                                               : run_mixes<double>(r, seed, budget);
    if (!go_on) return;
    seed += 10;
  }
}

/// V in {chunk - 1, chunk, chunk + 1} at the default chunk (2048), one thread and several.
TEST(CpuMatrixChunkEdges, DefaultChunkBoundariesMatchFloat64Oracle) {
  std::vector<mix_run> runs;
  for (std::int64_t V : {kChunk - 1, kChunk, kChunk + 1, 2 * kChunk + 1})
    runs.insert(runs.end(), {{dtype::f32, 7, V, 1, 0},
                             {dtype::bf16, 3, V, 4, 0},
                             {dtype::f16, 19, V, 7, 0},
                             {dtype::f64, 5, V, 3, 0}});
  run_mix_table(110, runs);
}

/// Chunk sizes outside [16, 8192] are clamped (cpu/policy.hpp). Chunk 1 -> 16 with V = 5000 also
/// puts more than 256 chunks in a row, past what forward_backward's exp cache holds.
TEST(CpuMatrixChunkEdges, ClampedChunkSizesMatchFloat64Oracle) {
  std::vector<mix_run> runs;
  for (std::int64_t V : {15, 16, 17, 5000})
    runs.insert(runs.end(), {{dtype::f32, 3, V, 1, 1}, {dtype::f64, 2, V, 1, 1}});
  for (std::int64_t V : {8191, 8193, 20000}) runs.push_back({dtype::bf16, 2, V, 1, 100000});
  run_mix_table(160, runs);
}

/// 733 rows over several threads: the row partition (rows >= threads, >= 65536 logits).
TEST(CpuMatrixThreads, RowPartitionMatchesFloat64Oracle) {
  std::vector<mix_run> runs;
  for (std::int64_t V : {127, 128, 129})
    runs.insert(runs.end(), {{dtype::f32, 733, V, 4, 64}, {dtype::bf16, 733, V, 7, 64}});
  runs.insert(runs.end(), {{dtype::f16, 733, 1000, 7, 0}, {dtype::f64, 733, 129, 4, 64}});
  run_mix_table(210, runs);
}

/// Fewer rows than threads on a long vocabulary: each row's vocabulary is split across threads
/// and the slices merge through online_lse (cpu/backend.hpp, make_plan).
TEST(CpuMatrixThreads, VocabularySplitMatchesFloat64Oracle) {
  run_mix_table(300, {{dtype::f32, 1, 32000, 7, 0},
                      {dtype::bf16, 3, 32000, 4, 0},
                      {dtype::f16, 3, 50257, 7, 64},
                      {dtype::f32, 2, 65537, 7, 0},
                      {dtype::bf16, 5, 17000, 7, 0},  // 5 rows, 2 slices each
                      {dtype::f64, 2, 40000, 7, 0}});
}

/// The large vocabularies of real models, a handful of option mixes each; the 1- and 3-row
/// cases split a row's vocabulary across 7 threads.
TEST(CpuMatrixLargeVocab, RealModelVocabulariesMatchFloat64Oracle) {
  run_mix_table(400, {{dtype::f32, 19, 32000, 4, 0},
                      {dtype::bf16, 7, 32000, 1, 0},
                      {dtype::f64, 7, 32000, 4, 0},
                      {dtype::bf16, 7, 50257, 4, 0},
                      {dtype::f16, 3, 50257, 1, 0},
                      {dtype::f32, 3, 65537, 1, 0},
                      {dtype::f16, 7, 65537, 4, 0},
                      {dtype::bf16, 3, 262145, 7, 0},
                      {dtype::f32, 1, 262145, 1, 0},
                      {dtype::f16, 1, 262145, 7, 0}});
}

}  // namespace
