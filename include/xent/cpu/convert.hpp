// Conversions between the logits' dtype and the accumulator (float, or double) over a chunk, a
// packet at a time with Eigen's pcast (Eigen 3.4 converts arrays with .cast<>() one scalar at a
// time, which made bf16 and fp16 rows conversion-bound: 2x slower end to end). Whole packets from
// the start of the chunk and the remainder in scalar code, so which path an element takes depends
// on its position, not on the buffer's address. Rounding is Eigen's: to nearest even, as CUDA's.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace xent {
namespace cpu_detail {

/// dst[i] = D(src[i]) for n elements.
template <class S, class D>
void convert(const S* src, std::int64_t n, D* dst) {
  namespace ei = Eigen::internal;
  using Src = std::remove_const_t<S>;
  if constexpr (std::is_same<Src, D>::value) {
    std::copy(src, src + n, dst);
  } else {
    std::int64_t i = 0;
    using PS = typename ei::packet_traits<Src>::type;
    using PD = typename ei::packet_traits<D>::type;
    constexpr int width = ei::packet_traits<Src>::size;
    if constexpr (width > 1 && width == static_cast<int>(ei::packet_traits<D>::size) &&
                  static_cast<bool>(ei::type_casting_traits<Src, D>::VectorizedCast))
      for (; i + width <= n; i += width)
        ei::pstoreu<D>(dst + i, ei::pcast<PS, PD>(ei::ploadu<PS>(src + i)));
    for (; i < n; ++i) dst[i] = static_cast<D>(src[i]);
  }
}

}  // namespace cpu_detail
}  // namespace xent
