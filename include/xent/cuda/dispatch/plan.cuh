// Launch plans of the row kernels: how a batch's rows are cut over CTAs, clusters and stages.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../cuda.cuh"
#include "../tuning/policy.cuh"

namespace xent {
namespace cuda_detail {
/// Whether plain fused aligned rows of `row_bytes` take the wide shape (policy::wide_rows).
inline bool wide_rows_for(std::int64_t row_bytes) {
  return policy::wide_rows && row_bytes > policy::wide_from_bytes &&
         row_bytes <=
             std::int64_t{policy::cluster_max} * static_cast<std::int64_t>(wide_shape::chunk_bytes);
}

/// What the dispatcher decided for one call.
struct launch_plan {
  int cluster = 1;              ///< CTAs per row
  std::int64_t slice = 0;       ///< classes per CTA
  std::int64_t chunk = 0;       ///< classes per stage
  std::int64_t chunks = 1;      ///< stages per slice (1: the slice stays resident)
  std::size_t chunk_bytes = 0;  ///< bytes per stage, a 16-byte multiple
  std::size_t smem_bytes = 0;   ///< dynamic shared memory per CTA
};

constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

/// Persistent CTAs (or clusters) for `units` of work when at most `most` are in flight at once
/// (policy::balanced_grid): the fewest that give none more units than the largest grid does, so
/// every one walks the same count or one fewer at the end of the grid, not half of them.
inline std::int64_t persistent_grid(std::int64_t units, std::int64_t most) {
  if (most < 1) most = 1;
  if (units <= most) return units;
  return policy::balanced_grid ? ceil_div(units, ceil_div(units, most)) : most;
}

/// Classes per CTA when `cols` are cut over `cluster` CTAs: whole vectors of `vec` elements.
constexpr std::int64_t slice_classes(std::int64_t cols, std::int64_t cluster, int vec) {
  return ceil_div(ceil_div(cols, cluster), vec) * vec;
}

/// CTAs per row for `rows` rows of `row_bytes`, from `c`: a short batch spreads each row over
/// more CTAs so rows * c covers the SMs twice, while a slice keeps at least min_slice_bytes.
constexpr std::int64_t spread_rows(std::int64_t c, std::int64_t rows, std::int64_t row_bytes,
                                   int sms, int max_cluster) {
  while (c < max_cluster && rows * c < 2 * sms && row_bytes / (c + 1) >= policy::min_slice_bytes)
    ++c;
  return c;
}

/// Cuts rows of `cols` elements of `elem_bytes` over a cluster: `sms` multiprocessors,
/// `max_cluster` 1 without clusters or when each CTA streams whole rows, stages of at most
/// `max_chunk_bytes`. Slices and chunks are whole 16-byte vectors (the register tiles' unit).
inline launch_plan make_launch_plan(std::int64_t rows, std::int64_t cols, int elem_bytes, int sms,
                                    int max_cluster,
                                    std::size_t max_chunk_bytes = policy::max_chunk_bytes) {
  const int vec = 16 / elem_bytes;
  launch_plan p;
  const std::int64_t row_bytes = cols * elem_bytes;
  std::int64_t c = ceil_div(row_bytes, static_cast<std::int64_t>(max_chunk_bytes));
  if (c <= max_cluster) {
    c = spread_rows(c, rows, row_bytes, sms, max_cluster);  // resident rows
  } else {
    c = max_cluster;  // rows too long for the cluster: each slice streams through in chunks
  }
  p.cluster = static_cast<int>(c < 1 ? 1 : c);
  p.slice = slice_classes(cols, p.cluster, vec);
  const std::int64_t max_chunk = static_cast<std::int64_t>(max_chunk_bytes) / elem_bytes;
  p.chunks = ceil_div(p.slice, max_chunk);
  p.chunk = ceil_div(ceil_div(p.slice, p.chunks), vec) * vec;
  p.chunk_bytes = static_cast<std::size_t>(ceil_div(p.chunk * elem_bytes, 16) * 16);
  p.smem_bytes = p.chunk_bytes * policy::stages;
  return p;
}

/// The multiprocessors a launch plan fixed at compile time assumes (a static shape's small batch,
/// fixed_sizes): those of the parts the tuning is measured on (H100 SXM, H200). On another count
/// the plan stays correct and only its spread over the SMs is off.
inline constexpr int fixed_plan_sms = 132;

/// The small-batch kernel's cut of rows of `cols` elements of `elem_bytes` over a cluster (each
/// CTA's slice whole 16-byte vectors, at most small_regs of them per thread), or cluster 0 when
/// the batch is not small: a row longer than a cluster holds so, more CTAs than
/// small_ctas_per_sm per SM, or more rows than the workspace keeps records for.
constexpr launch_plan make_small_plan(std::int64_t rows, std::int64_t cols, int elem_bytes,
                                      int sms) {
  launch_plan p;
  p.cluster = 0;
  if (policy::small_regs == 0) return p;
  const int vec = 16 / elem_bytes;
  const std::int64_t per_cta = std::int64_t{policy::small_regs} * 16 * policy::block;
  const std::int64_t row_bytes = cols * elem_bytes;
  std::int64_t c = ceil_div(row_bytes, per_cta);
  if (c > policy::cluster_max || rows > workspace_records) return p;
  c = spread_rows(c < 1 ? 1 : c, rows, row_bytes, sms, policy::cluster_max);
  if (rows * c > std::int64_t{policy::small_ctas_per_sm} * sms) return p;
  p.cluster = static_cast<int>(c);
  p.slice = slice_classes(cols, c, vec);
  return p;
}

}  // namespace cuda_detail
}  // namespace xent
