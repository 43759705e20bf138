// Tunables of the CUDA backend, as data, and the choice among them.
#pragma once

#include <cstdint>

namespace xent {
namespace cuda_detail {

/// One CTA holds `block * elems` elements of a row in registers (a tile), `elems` per thread in
/// accesses of `vec` elements. A row is cut over the CTAs of a thread-block cluster (sm_90), so a
/// row of up to `cluster_max` tiles is read from HBM once and its gradient written from registers;
/// longer rows loop over tiles and re-read each from L2 for the gradient.
template <int Block, int Elems, int Vec, int MinBlocks>
struct tile_config {
  static constexpr int block = Block;
  static constexpr int elems = Elems;
  static constexpr int vec = Vec;
  static constexpr int loads = Elems / Vec;
  static constexpr int tile = Block * Elems;
  static constexpr int min_blocks = MinBlocks;  ///< __launch_bounds__: CTAs resident per SM
};

struct policy {
  /// 32 elements per thread become 32 float registers; with 512 threads and two CTAs per SM
  /// (64 registers a thread), one CTA's loads overlap the other's reductions and stores.
  static constexpr int big_block = 512;
  static constexpr int big_elems = 32;
  static constexpr int big_min_blocks = 2;
  /// Short batches: 256 threads x 16 elements, so a row spreads over more CTAs and fills the SMs.
  static constexpr int small_block = 256;
  static constexpr int small_elems = 16;
  static constexpr int small_min_blocks = 2;
  /// Portable cluster size limit; rows larger than 8 big tiles loop over tiles.
  static constexpr int cluster_max = 8;
  /// The grid's y dimension (rows in flight) is at most this; CTAs loop over further rows.
  static constexpr std::int64_t max_grid_rows = 65535;
};

/// What the dispatcher decided for one call.
struct launch_plan {
  bool small = false;       ///< small tile config
  bool vectorized = false;  ///< 16-byte accesses (alignment allows)
  int cluster = 1;          ///< CTAs per row
  std::int64_t slice = 0;   ///< elements of a row per CTA
  std::int64_t grid_rows = 0;
};

/// Chooses tile size and cluster size. `row_bytes` of each row, `rows` rows, `sms` multiprocessors,
/// `clusters` whether the device and binary support thread-block clusters.
inline launch_plan make_launch_plan(std::int64_t rows, std::int64_t cols, int elem_bytes,
                                    bool aligned, int sms, bool clusters) {
  launch_plan p;
  p.vectorized = aligned;
  const std::int64_t big_tile = std::int64_t{policy::big_block} * policy::big_elems;
  const std::int64_t small_tile = std::int64_t{policy::small_block} * policy::small_elems;
  const int max_cluster = clusters ? policy::cluster_max : 1;
  auto ceil_div = [](std::int64_t a, std::int64_t b) { return (a + b - 1) / b; };
  std::int64_t c = ceil_div(cols, big_tile);
  // Few rows (or misaligned ones, which take scalar accesses): small tiles and wider clusters so
  // that rows * cluster covers the SMs twice.
  if (!aligned || (rows * c < 2 * sms && cols <= small_tile * max_cluster)) {
    p.small = true;
    c = ceil_div(cols, small_tile);
    while (c < max_cluster && rows * c < 2 * sms && cols / (c + 1) >= 256) ++c;
  }
  p.cluster = static_cast<int>(c < 1 ? 1 : (c > max_cluster ? max_cluster : c));
  // Each CTA's slice is a whole number of 16-byte vectors, so vector accesses stay aligned.
  const std::int64_t vec = aligned ? 16 / elem_bytes : 1;
  p.slice = ceil_div(ceil_div(cols, p.cluster), vec) * vec;
  p.grid_rows = rows < policy::max_grid_rows ? rows : policy::max_grid_rows;
  return p;
}

}  // namespace cuda_detail
}  // namespace xent
