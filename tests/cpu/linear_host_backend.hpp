// The CPU backend of the shared linear tests (linear_backend_tests.hpp lists what a backend
// provides, linear_sparse_harness.hpp what its sparse cases add): a case's host buffers as they
// are. tests/cpu/linear_test.cpp and linear_sparse_test.cpp run their cases through it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "linear_harness.hpp"
#include "xent/cpu/linear.hpp"

namespace xtl {

struct cpu_memory {
  template <class T>
  struct inputs {
    const ldata<T>& L;
    explicit inputs(const ldata<T>& L_) : L(L_) {}
    xent::matrix_view<const T> hidden() const { return L.hidden(); }
    xent::matrix_view<const T> weight() const { return L.weight(); }
    xent::vector_view<const T> bias() const { return L.bias(); }
    xent::linear_options options() const { return L.options(); }
    auto upstream() const { return L.d.upstream(); }
    template <class F>
    void with_targets(F&& f) const {
      L.d.with_targets(f);
    }
  };
  template <class A>
  using outputs = basic_outputs<A>;
  template <class G>
  using grads = gradients<G>;
  using workspace = workspace_buffer;
  struct error_count {  // the CPU backend counts no rows: a bad target throws before any work
    int read() const { return 0; }
  };
  /// Every fourth every-option case in bf16 / fp16, whose CPU arithmetic is emulated (slow).
  static constexpr int narrow_stride = 4;
  static constexpr bool low_memory_order = true;

  void set_up() {}
  void tear_down() {}
  xent::cpu exec(const lspec& s, error_count&) const { return xent::cpu(s.ce.threads); }
  static void sync() {}
  /// Workspaces at every byte offset from a 64-byte boundary.
  static std::size_t offset(std::uint64_t seed, int k) { return seed + k; }
  template <class T>
  static rounding stored() {  // the CPU keeps logits and their gradient in float
    return {};
  }
  template <class T, class G>
  static std::int64_t chunk_rows(const xent::cpu& exec, const xent::linear_shape& shape,
                                 xent::dw_accumulation accumulate, std::size_t bytes) {
    return xent::cpu_detail::plan_linear<T, G>(exec, shape, xent::linear_pass::training, accumulate,
                                               bytes)
        .chunk_rows;
  }

  /// Where the CPU backend writes linear_sparse_counts: host memory.
  struct sparse_counts {
    xent::linear_sparse_counts c{-1, -1};
    xent::linear_sparse_counts* ptr() { return &c; }
    xent::linear_sparse_counts fetch() const { return c; }
  };
  /// The rows its sparse tiles restart at: each panel sub-chunk's.
  template <class T, class G>
  static std::int64_t sparse_chunk_rows(const xent::cpu& exec, const xent::linear_shape& shape,
                                        std::size_t bytes) {
    return xent::cpu_detail::plan_low_memory<T, G>(exec, shape, bytes, true).panel.chunk_rows;
  }
  /// Its row tiles restart at each sub-chunk.
  static constexpr bool sparse_global_tiles = false;
};

}  // namespace xtl
