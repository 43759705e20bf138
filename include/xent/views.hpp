// Non-owning views of the caller's memory. xent never allocates or owns tensors; every array is
// described by a pointer, its sizes and, for matrices, an explicit leading dimension (elements
// between the starts of consecutive rows, ld >= cols), as Eigen::Ref's outer stride.
//
// Each size is a run-time value (xent::dynamic, the default) or a compile-time constant, in the
// spirit of std::extents: matrix_view<const float, extents<32, 32000>> has 32 rows and 32000
// columns in its type, matrix_view<const float, extents<dynamic, 32000>> only its columns. A
// static extent is not stored, and the entry points reject at compile time the calls whose
// static extents disagree (detail/static_shape.hpp). matrix_view<T> and vector_view<T> are the
// run-time-sized views; a static view converts to one implicitly, and a run-time size given to
// a static view is checked (xent::error naming "rows", "cols" or "size").
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "config.hpp"
#include "error.hpp"

namespace xent {

/// The extent of a view whose size is known at run time only.
inline constexpr std::int64_t dynamic = -1;

/// The rows and columns of a matrix_view, each a size >= 0 or xent::dynamic.
template <std::int64_t Rows, std::int64_t Cols>
struct extents {
  static_assert(Rows >= 0 || Rows == dynamic, "xent::extents: rows must be >= 0 or dynamic");
  static_assert(Cols >= 0 || Cols == dynamic, "xent::extents: cols must be >= 0 or dynamic");
  static constexpr std::int64_t rows = Rows;
  static constexpr std::int64_t cols = Cols;
  static constexpr int rank_dynamic = (Rows == dynamic) + (Cols == dynamic);
};

/// The size of a vector_view, >= 0 or xent::dynamic.
template <std::int64_t Size>
struct extent {
  static_assert(Size >= 0 || Size == dynamic, "xent::extent: size must be >= 0 or dynamic");
  static constexpr std::int64_t size = Size;
  static constexpr int rank_dynamic = Size == dynamic;
};

using dynamic_extents = extents<dynamic, dynamic>;
using dynamic_extent = extent<dynamic>;

namespace detail {

/// Whether extents a and b can describe the same size: equal, or one of them dynamic.
constexpr bool compatible_extent(std::int64_t a, std::int64_t b) {
  return a == dynamic || b == dynamic || a == b;
}
/// Whether a view of extent `from` converts to one of extent `to` without a run-time check.
constexpr bool widens_to(std::int64_t from, std::int64_t to) { return to == dynamic || from == to; }

/// A static extent's check of the run-time size it is given.
inline void check_static_extent(const char* view, const char* arg, std::int64_t got,
                                std::int64_t want) {
  if (got != want)
    throw error(
        view, arg,
        "is " + std::to_string(got) + ", the view's static extent is " + std::to_string(want));
}

// Each extent is a data member when dynamic and a static constexpr one otherwise, so `v.rows`
// reads either way and a static view stores its pointer (and ld) only.
#define XENT_EXTENT_MEMBER(NAME)            \
  template <std::int64_t N>                 \
  struct NAME##_member {                    \
    static constexpr std::int64_t NAME = N; \
  };                                        \
  template <>                               \
  struct NAME##_member<dynamic> {           \
    std::int64_t NAME = 0;                  \
  };
XENT_EXTENT_MEMBER(rows)
XENT_EXTENT_MEMBER(cols)
XENT_EXTENT_MEMBER(size)
#undef XENT_EXTENT_MEMBER

}  // namespace detail

/// A row-major `rows x cols` matrix; row i starts at `data + i * ld`. Offsets are 64-bit, so a
/// matrix of more than 2^31 elements indexes correctly. E is its extents (dynamic by default).
template <class T, class E = dynamic_extents>
struct matrix_view : detail::rows_member<E::rows>, detail::cols_member<E::cols> {
  using extents_type = E;
  using element_type = T;

  T* data = nullptr;
  std::int64_t ld = E::cols == dynamic ? 0 : E::cols;

  constexpr matrix_view() = default;
  /// Every extent given; a static one must equal the size given for it.
  constexpr matrix_view(T* data_, std::int64_t rows_, std::int64_t cols_)
      : matrix_view(data_, rows_, cols_, cols_) {}
  constexpr matrix_view(T* data_, std::int64_t rows_, std::int64_t cols_, std::int64_t ld_)
      : data(data_), ld(ld_) {
    set_rows(rows_);
    set_cols(cols_);
  }
  /// Static extents only: a row-contiguous matrix (ld = cols).
  template <int D = E::rank_dynamic, std::enable_if_t<D == 0, int> = 0>
  explicit constexpr matrix_view(T* data_) : data(data_), ld(E::cols) {}
  /// One dynamic extent (the rows or the columns), given alone; ld = cols.
  template <int D = E::rank_dynamic, std::enable_if_t<D == 1, int> = 0>
  constexpr matrix_view(T* data_, std::int64_t dynamic_extent_) : data(data_) {
    if constexpr (E::rows == dynamic) this->rows = dynamic_extent_;
    if constexpr (E::cols == dynamic) this->cols = dynamic_extent_;
    ld = this->cols;
  }

  /// A view of mutable elements converts to a view of const ones, and a static extent to a
  /// dynamic one.
  template <
      class U, class E2,
      std::enable_if_t<std::is_convertible<U*, T*>::value && detail::widens_to(E2::rows, E::rows) &&
                           detail::widens_to(E2::cols, E::cols),
                       int> = 0>
  constexpr matrix_view(const matrix_view<U, E2>& other)  // NOLINT(google-explicit-constructor)
      : data(other.data), ld(other.ld) {
    if constexpr (E::rows == dynamic) this->rows = other.rows;
    if constexpr (E::cols == dynamic) this->cols = other.cols;
  }
  /// A dynamic extent made static: checked (xent::error naming "rows" or "cols").
  template <
      class U, class E2,
      std::enable_if_t<
          std::is_convertible<U*, T*>::value && detail::compatible_extent(E2::rows, E::rows) &&
              detail::compatible_extent(E2::cols, E::cols) &&
              !(detail::widens_to(E2::rows, E::rows) && detail::widens_to(E2::cols, E::cols)),
          int> = 0>
  explicit matrix_view(const matrix_view<U, E2>& other)
      : matrix_view(other.data, other.rows, other.cols, other.ld) {}

  XENT_HOST_DEVICE T* row(std::int64_t i) const { return data + i * ld; }
  XENT_HOST_DEVICE T& operator()(std::int64_t i, std::int64_t j) const { return data[i * ld + j]; }
  XENT_HOST_DEVICE std::int64_t size() const { return this->rows * this->cols; }
  XENT_HOST_DEVICE bool empty() const { return this->rows == 0 || this->cols == 0; }

 private:
  constexpr void set_rows(std::int64_t r) {
    if constexpr (E::rows == dynamic)
      this->rows = r;
    else
      detail::check_static_extent("xent::matrix_view", "rows", r, E::rows);
  }
  constexpr void set_cols(std::int64_t c) {
    if constexpr (E::cols == dynamic)
      this->cols = c;
    else
      detail::check_static_extent("xent::matrix_view", "cols", c, E::cols);
  }
};

/// A contiguous vector of `size` elements; an empty view (size 0, data null) means "absent" for
/// optional inputs and outputs. E is its extent (dynamic by default).
template <class T, class E = dynamic_extent>
struct vector_view : detail::size_member<E::size> {
  using extents_type = E;
  using element_type = T;

  T* data = nullptr;

  constexpr vector_view() = default;
  /// The size given; a static extent must equal it.
  constexpr vector_view(T* data_, std::int64_t size_) : data(data_) {
    if constexpr (E::size == dynamic)
      this->size = size_;
    else
      detail::check_static_extent("xent::vector_view", "size", size_, E::size);
  }
  /// A static extent only.
  template <int D = E::rank_dynamic, std::enable_if_t<D == 0, int> = 0>
  explicit constexpr vector_view(T* data_) : data(data_) {}

  /// Mutable to const elements and static to dynamic extent.
  template <
      class U, class E2,
      std::enable_if_t<std::is_convertible<U*, T*>::value && detail::widens_to(E2::size, E::size),
                       int> = 0>
  constexpr vector_view(const vector_view<U, E2>& other)  // NOLINT(google-explicit-constructor)
      : data(other.data) {
    if constexpr (E::size == dynamic) this->size = other.size;
  }
  /// A dynamic extent made static: checked (xent::error naming "size").
  template <
      class U, class E2,
      std::enable_if_t<
          std::is_convertible<U*, T*>::value && E2::size == dynamic && E::size != dynamic, int> = 0>
  explicit vector_view(const vector_view<U, E2>& other) : vector_view(other.data, other.size) {}

  XENT_HOST_DEVICE T& operator[](std::int64_t i) const { return data[i]; }
  XENT_HOST_DEVICE bool empty() const { return this->size == 0; }
};

namespace detail {

/// An optional input or output (class weights, per-row outputs and upstream, linear gradients)
/// as the run-time sized view the backends take: a static view with null data has no other way
/// to say it is absent, so it becomes the empty view (null data, size 0). Null data with a
/// run-time size other than 0 passes unchanged, for the checks to refuse: it is a caller's
/// mistake, not an absent view (taken as one, a per-row upstream was silently dropped).
template <class T, class E>
vector_view<T> optional_view(const vector_view<T, E>& v) {
  const bool sized = E::size == dynamic && v.size != 0;
  return v.data || sized ? vector_view<T>(v) : vector_view<T>();
}
template <class T, class E>
matrix_view<T> optional_view(const matrix_view<T, E>& m) {
  const bool sized = (E::rows == dynamic && m.rows != 0) || (E::cols == dynamic && m.cols != 0);
  return m.data || sized ? matrix_view<T>(m) : matrix_view<T>();
}

}  // namespace detail
}  // namespace xent
