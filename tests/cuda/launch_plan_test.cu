// The CUDA backend's launch plans and the row kernel's queue, checked on the host: they need no
// GPU and instantiate no kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>
#include <xent/cuda/block/row_queue.cuh>
#include <xent/cuda/cuda.cuh>
#include <xent/cuda/dispatch/plan.cuh>
#include <xent/cuda/tuning/policy.cuh>

namespace {

// Host-only (runs without a GPU): the small-batch kernel's cut of a row over a cluster.
TEST(CudaLaunchPlan, SmallBatchesCutEachRowOverAClusterThatHoldsIt) {
  using xent::cuda_detail::make_small_plan;
  using xent::cuda_detail::policy;
  if (policy::small_regs == 0) GTEST_SKIP() << "no small-batch kernel (XENT_CUDA_SMALL_REGS=0)";
  const int sms = 132;
  // A static shape's plan is the same arithmetic, at compile time (fixed_plan_sms).
  static_assert(make_small_plan(32, 32000, 4, xent::cuda_detail::fixed_plan_sms).cluster ==
                    (policy::small_regs == 0 ? 0 : 9),
                "the seed shape's plan, fixed at compile time");
  // The seed shapes: 32 x 32000 fp32 (125 KiB rows) over 9 CTAs of 3556 classes, 32 x 50257 over
  // 13; 128 x 32000 over 8 (1024 CTAs, within 8 per SM).
  EXPECT_EQ(make_small_plan(32, 32000, 4, sms).cluster, 9);
  EXPECT_EQ(make_small_plan(32, 32000, 4, sms).slice, 3556);
  EXPECT_EQ(make_small_plan(32, 50257, 4, sms).cluster, 13);
  EXPECT_EQ(make_small_plan(128, 32000, 4, sms).cluster, 8);
  // Not small: too many rows, or rows longer than 16 CTAs hold, or more rows than the workspace
  // keeps records for (however many SMs there are).
  EXPECT_EQ(make_small_plan(8192, 32000, 2, sms).cluster, 0);
  EXPECT_EQ(make_small_plan(4, 262144, 4, sms).cluster, 0);
  EXPECT_GT(make_small_plan(xent::cuda_detail::workspace_records, 3, 4, 1000).cluster, 0);
  EXPECT_EQ(make_small_plan(xent::cuda_detail::workspace_records + 1, 3, 4, 1000).cluster, 0);
  for (std::int64_t rows : {1, 2, 7, 32, 100})
    for (std::int64_t cols : {1, 3, 255, 4097, 32000, 50257, 65536})
      for (int bytes : {2, 4}) {
        const auto p = make_small_plan(rows, cols, bytes, sms);
        if (p.cluster == 0) continue;
        const std::int64_t vec = 16 / bytes;
        EXPECT_LE(p.cluster, policy::cluster_max);
        EXPECT_EQ(p.slice % vec, 0);
        EXPECT_LE(p.slice, std::int64_t{policy::small_regs} * policy::block * vec);
        EXPECT_GE(p.slice * p.cluster, cols) << rows << " x " << cols;
        EXPECT_LE(rows * p.cluster, std::int64_t{policy::small_ctas_per_sm} * sms);
      }
}

// Host-only (runs without a GPU): which fused rows take the wide shape (policy::wide_rows), and
// its cut of them: every such row held on chip (one chunk per CTA) by a cluster of at most 16.
TEST(CudaLaunchPlan, LongFusedRowsTakeTheWideShapeUpTo1MiB) {
  using xent::cuda_detail::make_launch_plan;
  using xent::cuda_detail::policy;
  using xent::cuda_detail::wide_rows_for;
  using xent::cuda_detail::wide_shape;
  if (!policy::wide_rows) GTEST_SKIP() << "no wide shape (XENT_CUDA_WIDE_ROWS=0)";
  const std::int64_t most =
      std::int64_t{policy::cluster_max} * static_cast<std::int64_t>(wide_shape::chunk_bytes);
  EXPECT_FALSE(wide_rows_for(policy::wide_from_bytes));
  EXPECT_TRUE(wide_rows_for(policy::wide_from_bytes + 16));
  EXPECT_TRUE(wide_rows_for(most));
  EXPECT_FALSE(wide_rows_for(most + 16));
  const int sms = 132;
  auto wide = [&](std::int64_t rows, std::int64_t cols, int bytes) {
    return make_launch_plan(rows, cols, bytes, sms, policy::cluster_max, wide_shape::chunk_bytes);
  };
  // The benchmark's shapes: bf16 4096 x 262144 over 8 CTAs (16 of the default shape), 16384 x
  // 128256 over 4, fp32 8192 x 128256 over 8.
  EXPECT_EQ(wide(4096, 262144, 2).cluster, 8);
  EXPECT_EQ(wide(16384, 128256, 2).cluster, 4);
  EXPECT_EQ(wide(8192, 128256, 4).cluster, 8);
  for (std::int64_t rows : {1, 3, 60, 4096})
    for (std::int64_t row_bytes : {policy::wide_from_bytes + 16, std::int64_t{600000}, most})
      for (int bytes : {2, 4}) {
        const std::int64_t cols = row_bytes / bytes;
        ASSERT_TRUE(wide_rows_for(cols * bytes));
        const auto p = wide(rows, cols, bytes);
        EXPECT_EQ(p.chunks, 1) << rows << " x " << cols;
        EXPECT_LE(p.cluster, policy::cluster_max);
        EXPECT_EQ(p.slice % (16 / bytes), 0);
        EXPECT_GE(p.slice * p.cluster, cols);
        EXPECT_LE(p.slice * bytes, static_cast<std::int64_t>(wide_shape::chunk_bytes));
      }
}

TEST(CudaLaunchPlan, PersistentGridsWalkEvenShares) {
  using xent::cuda_detail::ceil_div;
  using xent::cuda_detail::persistent_grid;
  using xent::cuda_detail::policy;
  EXPECT_EQ(persistent_grid(0, 396), 0);
  EXPECT_EQ(persistent_grid(7, 396), 7);
  EXPECT_EQ(persistent_grid(396, 396), 396);
  EXPECT_EQ(persistent_grid(5, 0), 1);  // a device that holds none still gets one
  // bf16 8192 x 32000 backward in 8 KiB tiles over three CTAs per SM of 132: 65536 tiles.
  EXPECT_EQ(persistent_grid(65536, 396), policy::balanced_grid ? 395 : 396);
  for (std::int64_t units : {397, 1000, 32768, 65536, 1000003})
    for (std::int64_t most : {1, 2, 132, 396, 528}) {
      const std::int64_t grid = persistent_grid(units, most);
      ASSERT_GE(grid, 1);
      EXPECT_LE(grid, most);
      // No CTA walks more units than with the largest grid, and the grid covers them all.
      EXPECT_EQ(ceil_div(units, grid), ceil_div(units, most)) << units << " over " << most;
    }
}

// The row kernel's queue (row_queue.cuh), its counting on the host: clusters in a random order,
// each with its first two rows dealt out in turn, then a ticket per row taken while its last one
// was a row, as the kernel's taker does. Every row is taken once, and the take that resets the
// counter is the launch's last.
TEST(CudaRowQueue, EveryRowOnceAndTheLastTakeResetsTheCounter) {
  constexpr int stages = 2;
  std::mt19937 rng(11);
  for (std::int64_t rows : {1, 2, 3, 131, 132, 133, 263, 264, 265, 700, 4000})
    for (std::int64_t clusters : {1, 2, 7, 132}) {
      if (clusters > rows) continue;  // the launch's grid has at most a cluster a row
      const std::int64_t takes = xent::cuda_detail::row_queue_takes(rows, clusters, stages);
      struct cluster_state {
        std::vector<std::int64_t> item;  // each item's row, rows past the last
        std::size_t next = 0;
        bool dry = false;
      };
      std::vector<cluster_state> c(static_cast<std::size_t>(clusters));
      for (std::int64_t b = 0; b < clusters; ++b) {
        for (int k = 0; k < stages; ++k) c[b].item.push_back(std::min(b + k * clusters, rows));
        c[b].dry = c[b].item.back() == rows;
      }
      std::vector<int> seen(static_cast<std::size_t>(rows));
      std::int64_t counter = 0, taken = 0, resets = 0;
      for (;;) {
        std::vector<std::size_t> live;
        for (std::size_t b = 0; b < c.size(); ++b)
          if (c[b].item[c[b].next] < rows) live.push_back(b);
        if (live.empty()) break;
        cluster_state& s = c[live[rng() % live.size()]];
        ++seen[static_cast<std::size_t>(s.item[s.next])];
        if (!s.dry) {  // item next + stages's ticket
          ASSERT_EQ(resets, 0) << "a take after the last";
          const std::int64_t t = counter++;
          ++taken;
          if (t == takes - 1) {
            counter = 0;
            ++resets;
          }
          const std::int64_t n = std::min(stages * clusters + t, rows);
          s.item.push_back(n);
          s.dry = n == rows;
        }
        ++s.next;
        ASSERT_LT(s.next, s.item.size()) << "an item without a row";
      }
      EXPECT_EQ(taken, takes) << rows << " rows, " << clusters << " clusters";
      EXPECT_EQ(counter, 0) << rows << " rows, " << clusters << " clusters";
      EXPECT_EQ(resets, takes > 0 ? 1 : 0) << rows << " rows, " << clusters << " clusters";
      for (std::int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(seen[static_cast<std::size_t>(r)], 1)
            << "row " << r << " of " << rows << ", " << clusters << " clusters";
    }
}

}  // namespace
