// A chunk of a row held in registers: each thread's 16-byte vectors of a chunk staged in shared
// memory, loaded once and then swept as often as the pass needs with no further shared-memory
// traffic. Included only by nvcc.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dtype.cuh"

namespace xent {
namespace cuda_detail {

template <class T>
__device__ __forceinline__ T negative_infinity() {
  return from_float<T>(-HUGE_VALF);
}

/// Elements of a row starting at `row` that lie past the 16-byte boundary before it: the `lead`
/// of a tile cut at the row's own boundaries (global_tile, tile_gradient).
template <class T>
__device__ __forceinline__ int lead_of(const T* row) {
  return static_cast<int>(reinterpret_cast<std::uintptr_t>(row) % 16 / sizeof(T));
}

/// The largest of a 16-byte vector's elements, folded into `acc` (kept in T's own packed form:
/// one HMNMX2 per two 16-bit elements, where converting first took three instructions each).
/// NaN is passed over, as fmaxf does; the sum of exponentials still meets it.
template <class T, int Vec>
__device__ __forceinline__ void fold_max(const vec_t<T, Vec>& v, vec_t<T, 2>& acc) {
  if constexpr (std::is_same<T, float>::value) {
#pragma unroll
    for (int e = 0; e < Vec; ++e) acc.v[e % 2] = fmaxf(acc.v[e % 2], v.v[e]);
  } else {
    using pair = std::conditional_t<std::is_same<T, __half>::value, __half2, __nv_bfloat162>;
    pair a;
    memcpy(&a, &acc, sizeof(pair));
#pragma unroll
    for (int e = 0; e < Vec; e += 2) {
      pair p;
      memcpy(&p, &v.v[e], sizeof(pair));
      a = __hmax2(a, p);
    }
    memcpy(&acc, &a, sizeof(pair));
  }
}

/// Vec floats rounded to G, two at a time for 16-bit G (one cvt.rn.{bf16,f16}x2.f32 per pair).
template <class G, int Vec>
__device__ __forceinline__ vec_t<G, Vec> round_vector(const float (&f)[Vec]) {
  vec_t<G, Vec> d;
  if constexpr (std::is_same<G, __nv_bfloat16>::value) {
#pragma unroll
    for (int e = 0; e < Vec; e += 2) {
      const __nv_bfloat162 p = __floats2bfloat162_rn(f[e], f[e + 1]);
      memcpy(&d.v[e], &p, sizeof(p));
    }
  } else if constexpr (std::is_same<G, __half>::value) {
#pragma unroll
    for (int e = 0; e < Vec; e += 2) {
      const __half2 p = __floats2half2_rn(f[e], f[e + 1]);
      memcpy(&d.v[e], &p, sizeof(p));
    }
  } else {
#pragma unroll
    for (int e = 0; e < Vec; ++e) d.v[e] = from_float<G>(f[e]);
  }
  return d;
}

/// Stores a vector of G whose address is a multiple of its size within a 16-byte aligned row, in
/// pieces of at most 16 bytes.
template <class G, int Vec>
__device__ __forceinline__ void store_vector(G* p, const vec_t<G, Vec>& d) {
  constexpr int piece = 16 / sizeof(G) < Vec ? 16 / sizeof(G) : Vec;
#pragma unroll
  for (int e = 0; e < Vec; e += piece) {
    vec_t<G, piece> q;
#pragma unroll
    for (int i = 0; i < piece; ++i) q.v[i] = d.v[e + i];
    store_vec<G, piece>(p + e, q);
  }
}

/// Which 16-byte vectors of a chunk of `count` elements this thread takes: vectors tid,
/// tid + Block, ... (`Regs` of them at most), so a warp's accesses are contiguous. Block 32: a
/// warp's own tile (warp_rows_kernel), tid its lane.
template <class T, int Regs, int Block>
struct tile_shape {
  using elem = T;
  static constexpr int vec = 16 / static_cast<int>(sizeof(T));
  static constexpr int regs = Regs, block = Block;
  /// This thread's place among the tile's Block threads.
  __device__ __forceinline__ static int thread() {
    if constexpr (Block == 32)
      return static_cast<int>(threadIdx.x) % 32;
    else
      return static_cast<int>(threadIdx.x);
  }
  /// Element offset, within the chunk, of this thread's vector r.
  __device__ __forceinline__ static int offset(int r) { return (r * Block + thread()) * vec; }
  __device__ __forceinline__ static bool has(int r, int count) { return offset(r) < count; }
  /// Elements of vector r inside the chunk (vec for all but the chunk's last vector).
  __device__ __forceinline__ static int valid(int r, int count) {
    return count - offset(r) < vec ? count - offset(r) : vec;
  }
  /// Vector r of a chunk staged in shared memory. `MaskTail`: elements past the chunk become
  /// -inf, so max and sum sweeps need no per-element test (exp2(-inf) = 0).
  template <bool MaskTail>
  __device__ __forceinline__ static vec_t<T, vec> fetch(const T* stage, int count, int r) {
    vec_t<T, vec> v = load_vec<T, vec>(stage + offset(r));
    if (MaskTail && valid(r, count) < vec) {
#pragma unroll
      for (int e = 0; e < vec; ++e)
        if (e >= valid(r, count)) v.v[e] = negative_infinity<T>();
    }
    return v;
  }
};

/// Element e (0..3 for fp32, 0..7 for 16-bit types) of a 16-byte vector held as four 32-bit
/// words, as a float. Indices are compile-time once the callers' loops are unrolled.
template <class T>
__device__ __forceinline__ float word_element(const unsigned (&w)[4], int e) {
  if constexpr (std::is_same<T, float>::value) {
    return __uint_as_float(w[e]);
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const unsigned x = w[e / 2];  // bf16 is the high half of a float
    return __uint_as_float(e % 2 ? x & 0xffff0000u : x << 16);
  } else {
    const unsigned x = w[e / 2];
    return __half2float(__ushort_as_half(static_cast<unsigned short>(e % 2 ? x >> 16 : x)));
  }
}

/// This thread's share of a chunk of `count` elements (the gradient sweep's view of it).
template <class T, int Regs, int Block>
struct tile_extent : tile_shape<T, Regs, Block> {
  using shape = tile_shape<T, Regs, Block>;
  static constexpr bool holds_exps = false;  ///< values, not exponentials (see exp_tile)
  static constexpr bool whole = false;       ///< every vector swept (see whole_extent)
  int count = 0;
  __device__ __forceinline__ bool has(int r) const { return shape::has(r, count); }
  __device__ __forceinline__ int valid(int r) const { return shape::valid(r, count); }
  /// Whether the gradient of vector r is stored (the vectors inside the chunk).
  __device__ __forceinline__ bool stored(int r) const { return shape::has(r, count); }
};

/// A tile swept whole (`Whole`), every vector of every thread, past the chunk too: the stage holds
/// -inf there (its exponential is 0), so the sweeps carry no per-vector test; only the stores of
/// the gradient keep to the chunk (stored). Slices of whole vectors only.
template <class T, int Regs, int Block, bool Whole>
struct whole_extent : tile_extent<T, Regs, Block> {
  using extent = tile_extent<T, Regs, Block>;
  static constexpr bool whole = Whole;
  __device__ __forceinline__ bool has(int r) const { return Whole || extent::has(r); }
  __device__ __forceinline__ int valid(int r) const {
    return Whole ? extent::vec : extent::valid(r);
  }
};

/// This thread's vectors of a chunk, held in registers from the moment its stage may be refilled
/// until the gradient sweep has used them. Held as 32-bit words: an array of 16-bit elements is
/// kept one element per register (twice the registers, and at three CTAs per SM the tile spilled
/// to local memory).
template <class T, int Regs, int Block, bool Whole = false>
struct row_tile : whole_extent<T, Regs, Block, Whole> {
  using shape = tile_shape<T, Regs, Block>;
  unsigned w[Regs][4];

  /// Element e of vector r, as a float.
  __device__ __forceinline__ float value(int r, int e) const { return word_element<T>(w[r], e); }

  __device__ __forceinline__ void load(const T* stage, int n) {
    this->count = n;
#pragma unroll
    for (int r = 0; r < Regs; ++r) {
      if (this->has(r)) {
        const uint4 q = *reinterpret_cast<const uint4*>(stage + shape::offset(r));
        w[r][0] = q.x;
        w[r][1] = q.y;
        w[r][2] = q.z;
        w[r][3] = q.w;
      }
    }
  }
};

/// This thread's exponentials of a resident chunk, 2^((z - max) log2e) with `max` the warp's, as
/// floats (policy::exp_once): the gradient sweep multiplies them by one per-row factor. Twice the
/// registers of a 16-bit row_tile.
template <class T, int Regs, int Block, bool Whole = false>
struct exp_tile : whole_extent<T, Regs, Block, Whole> {
  static constexpr bool holds_exps = true;
  float e[Regs][16 / sizeof(T)];
  float max = 0.0f;
};

/// This thread's vectors of a chunk loaded straight from global memory, for a pass that reads
/// each element once (the streaming forward and backward, the small-batch kernel): 16-byte
/// streaming loads (ld.global.cs: the gradient may overwrite the logits in the same kernel, so
/// not the read-only path), the row's last partial vector element by element. `Aligned`: `src`
/// is 16-byte aligned (otherwise every vector is read element by element). `Lead` (with
/// Aligned): the tile starts `lead` elements before the row, inside thread 0's first vector,
/// which is then read element by element from its lead-th element, the elements before it -inf
/// (nothing outside the row is read; exp2(-inf) = 0 leaves the sums as they are).
template <class T, int Regs, int Block>
struct global_tile : tile_extent<T, Regs, Block> {
  using shape = tile_shape<T, Regs, Block>;
  unsigned w[Regs][4];

  __device__ __forceinline__ float value(int r, int e) const { return word_element<T>(w[r], e); }

  template <bool Aligned = true, bool Lead = false>
  __device__ __forceinline__ void load(const T* src, int n, int lead = 0) {
    this->count = n;
#pragma unroll
    for (int r = 0; r < Regs; ++r) {
      if (!this->has(r)) continue;
      const int skip = Lead && r == 0 && shape::thread() == 0 ? lead : 0;
      if (Aligned && this->valid(r) == shape::vec && (!Lead || skip == 0)) {
        const uint4 q = __ldcs(reinterpret_cast<const uint4*>(src + shape::offset(r)));
        w[r][0] = q.x;
        w[r][1] = q.y;
        w[r][2] = q.z;
        w[r][3] = q.w;
      } else {
        // Element by element, packed as a 16-byte load would have them (element e in bits
        // 8 sizeof(T) e of the vector), so word_element reads them the same way. Unrolled raw
        // loads of T's width: a memcpy of a run-time length was a byte loop through local memory
        // (fp32 32 x 50257, rows 4-byte aligned: 23.6 us against 12.0 for 32 x 32000).
        using raw = std::conditional_t<sizeof(T) == 4, unsigned, unsigned short>;
        constexpr int per_word = 4 / static_cast<int>(sizeof(T));
        const raw* s = reinterpret_cast<const raw*>(src + shape::offset(r));
        const int valid = this->valid(r);
        raw ninf = 0;
        if constexpr (Lead) {
          const T x = negative_infinity<T>();
          memcpy(&ninf, &x, sizeof(raw));
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) w[r][k] = 0u;
#pragma unroll
        for (int e = 0; e < shape::vec; ++e)
          if (e < valid) {
            const raw x = !Lead || e >= skip ? s[e] : ninf;
            w[r][e / per_word] |= static_cast<unsigned>(x) << (8 * sizeof(T) * (e % per_word));
          }
      }
    }
  }
};

}  // namespace cuda_detail
}  // namespace xent
