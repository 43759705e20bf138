// Non-owning views of the caller's memory. xent never allocates or owns tensors; every array is
// described by a pointer, its sizes and, for matrices, an explicit leading dimension (elements
// between the starts of consecutive rows, ld >= cols), as Eigen::Ref's outer stride.
#pragma once

#include <cstdint>
#include <type_traits>

#include "config.hpp"

namespace xent {

/// A row-major `rows x cols` matrix; row i starts at `data + i * ld`. Offsets are 64-bit, so a
/// matrix of more than 2^31 elements indexes correctly.
template <class T>
struct matrix_view {
  T* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;

  constexpr matrix_view() = default;
  constexpr matrix_view(T* data_, std::int64_t rows_, std::int64_t cols_)
      : data(data_), rows(rows_), cols(cols_), ld(cols_) {}
  constexpr matrix_view(T* data_, std::int64_t rows_, std::int64_t cols_, std::int64_t ld_)
      : data(data_), rows(rows_), cols(cols_), ld(ld_) {}
  /// A view of mutable elements converts to a view of const ones.
  template <class U, class = std::enable_if_t<std::is_convertible<U*, T*>::value>>
  constexpr matrix_view(const matrix_view<U>& other)  // NOLINT(google-explicit-constructor)
      : data(other.data), rows(other.rows), cols(other.cols), ld(other.ld) {}

  XENT_HOST_DEVICE T* row(std::int64_t i) const { return data + i * ld; }
  XENT_HOST_DEVICE T& operator()(std::int64_t i, std::int64_t j) const { return data[i * ld + j]; }
  XENT_HOST_DEVICE std::int64_t size() const { return rows * cols; }
  XENT_HOST_DEVICE bool empty() const { return rows == 0 || cols == 0; }
};

/// A contiguous vector of `size` elements; an empty view (size 0, data null) means "absent" for
/// optional inputs and outputs.
template <class T>
struct vector_view {
  T* data = nullptr;
  std::int64_t size = 0;

  constexpr vector_view() = default;
  constexpr vector_view(T* data_, std::int64_t size_) : data(data_), size(size_) {}
  template <class U, class = std::enable_if_t<std::is_convertible<U*, T*>::value>>
  constexpr vector_view(const vector_view<U>& other)  // NOLINT(google-explicit-constructor)
      : data(other.data), size(other.size) {}

  XENT_HOST_DEVICE T& operator[](std::int64_t i) const { return data[i]; }
  XENT_HOST_DEVICE bool empty() const { return size == 0; }
};

}  // namespace xent
