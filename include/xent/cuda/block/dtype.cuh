// Element types on the device. The CPU's Eigen::bfloat16 / Eigen::half are bit-compatible with
// CUDA's __nv_bfloat16 / __half, so one buffer serves both backends: the CUDA backend reads either
// spelling through the CUDA type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <Eigen/Core>
#include <type_traits>

namespace xent {
namespace cuda_detail {

template <class T>
struct device_type {
  using type = void;  // unsupported
};
template <>
struct device_type<float> {
  using type = float;
};
template <>
struct device_type<__nv_bfloat16> {
  using type = __nv_bfloat16;
};
template <>
struct device_type<Eigen::bfloat16> {
  using type = __nv_bfloat16;
};
template <>
struct device_type<__half> {
  using type = __half;
};
template <>
struct device_type<Eigen::half> {
  using type = __half;
};

template <class T>
using device_t = typename device_type<std::remove_const_t<T>>::type;

template <class T>
constexpr bool is_device_dtype = !std::is_void<device_t<T>>::value;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

/// VEC elements moved as one access: 16 bytes when VEC * sizeof(T) == 16.
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) vec_t {
  T v[VEC];
};

template <class T, int VEC>
__device__ __forceinline__ vec_t<T, VEC> load_vec(const T* p) {
  return *reinterpret_cast<const vec_t<T, VEC>*>(p);
}

template <class T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const vec_t<T, VEC>& v) {
  *reinterpret_cast<vec_t<T, VEC>*>(p) = v;
}

}  // namespace cuda_detail
}  // namespace xent
