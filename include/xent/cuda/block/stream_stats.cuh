// A thread's running statistics of a row streamed tile by tile from global memory (the streaming
// forward's and the warp-rows kernel's). Included only by nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../loss_math.hpp"
#include "../../online_lse.hpp"
#include "chunk_stats.cuh"
#include "row_reduce.cuh"
#include "tile.cuh"

namespace xent {
namespace cuda_detail {

/// Which elements of a register tile a sweep takes: all (a whole tile), each vector present
/// (the row's last tile when the row is a whole number of vectors: one test per vector), or each
/// element inside the row (any other last tile).
enum class tile_part { whole, vectors, elements };

/// This thread's running statistics of a row streamed tile by tile: the largest value seen and
/// the sum of exponentials relative to it (a tile with a larger one rescales the sum first).
struct stream_stats {
  float max = -HUGE_VALF;
  float sum = 0.0f;

  /// Folds in this thread's vectors of tile `t` (`Part`: which of its elements).
  template <tile_part Part, class Tile>
  __device__ __forceinline__ void add(const Tile& t) {
    using T = typename Tile::elem;
    constexpr bool full = Part == tile_part::whole;
    float m = -HUGE_VALF;
    if constexpr (Part != tile_part::elements && sizeof(T) == 2) {
      // Packed 16-bit maxima in two chains (one HMNMX2 per two elements, where converting first
      // took three instructions per element).
      using pair = std::conditional_t<std::is_same<T, __half>::value, __half2, __nv_bfloat162>;
      pair acc[2];
      if constexpr (full) {
        memcpy(&acc[0], &t.w[0][0], 4);
      } else {  // vector 0 may be absent from a last tile
        const unsigned both = std::is_same<T, __half>::value ? 0xfc00fc00u : 0xff80ff80u;
        memcpy(&acc[0], &both, 4);
      }
      acc[1] = acc[0];
#pragma unroll
      for (int r = 0; r < Tile::regs; ++r)
        if (full || t.has(r)) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            pair p;
            memcpy(&p, &t.w[r][k], 4);
            acc[k % 2] = __hmax2(acc[k % 2], p);  // passes over NaN; the sum below meets it
          }
        }
      acc[0] = __hmax2(acc[0], acc[1]);
      const float x0 = to_float(acc[0].x), x1 = to_float(acc[0].y);
      m = x0 > x1 ? x0 : x1;
    } else {
#pragma unroll
      for (int r = 0; r < Tile::regs; ++r)
#pragma unroll
        for (int e = 0; e < Tile::vec; ++e)  // fmaxf passes over NaN; the sum below meets it
          if (full || (t.has(r) && (Part == tile_part::vectors || e < t.valid(r))))
            m = fmaxf(m, t.value(r, e));
    }
    if (m > max) {  // 2^-inf = 0 rescales an empty sum
      sum *= fast_exp2((max - m) * log2e);
      max = m;
    }
    sum += tile_exp_sum<full, Tile, Part == tile_part::vectors>(
        t, max == -HUGE_VALF ? 0.0f : max * log2e);
  }

  /// Folds in tile `t` of `count` elements: swept whole where it is full (`span` elements), by
  /// vectors where the row ends on a vector's end (`vectors_end`), element by element otherwise.
  template <class Tile>
  __device__ __forceinline__ void add(const Tile& t, int count, int span, bool vectors_end) {
    if (count == span)
      add<tile_part::whole>(t);
    else if (vectors_end)
      add<tile_part::vectors>(t);
    else
      add<tile_part::elements>(t);
  }

  /// The statistics of every lane of the warp merged, in every lane.
  __device__ __forceinline__ row_partial warp_total() const {
    row_partial p;
    p.lse = online_lse::of_block(max, sum);
    return warp_merge<32>(p);
  }
};

}  // namespace cuda_detail
}  // namespace xent
