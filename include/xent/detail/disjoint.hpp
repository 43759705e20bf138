// The memory a call writes must miss the memory it reads, and everything else it writes. Every
// backend reads targets, class weights, a saved LSE and upstream gradients again after it has
// started writing (row by row, chunk by chunk, rank by rank), so an overlap feeds a later row what
// the call wrote for an earlier one: a class id read back from a gradient row indexes anywhere.
// Checked on the host from the views' addresses alone (device memory is never dereferenced).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "../options.hpp"
#include "../targets.hpp"
#include "../views.hpp"
#include "validate.hpp"

namespace xent {
namespace detail {

/// The bytes a view spans ([begin, end), both null when it is empty), for overlap checks.
struct span_of {
  const char* name = "";
  const char* begin = nullptr;
  const char* end = nullptr;

  span_of() = default;
  template <class T>
  span_of(const char* name_, const matrix_view<T>& m) : name(name_) {
    if (m.empty() || m.data == nullptr) return;
    begin = reinterpret_cast<const char*>(m.data);
    end = reinterpret_cast<const char*>(m.row(m.rows - 1) + m.cols);
  }
  template <class T>
  span_of(const char* name_, const vector_view<T>& v) : name(name_) {
    if (v.empty() || v.data == nullptr) return;
    begin = reinterpret_cast<const char*>(v.data);
    end = reinterpret_cast<const char*>(v.data + v.size);
  }
  /// One element, or nothing for a null pointer (a scalar output or input).
  template <class T>
  span_of(const char* name_, T* one) : span_of(name_, vector_view<T>(one, one ? 1 : 0)) {}
  span_of(const char* name_, const void* data, std::size_t bytes) : name(name_) {
    if (data == nullptr || bytes == 0) return;
    begin = static_cast<const char*>(data);
    end = begin + bytes;
  }

  bool overlaps(const span_of& o) const {
    return begin && o.begin && begin < o.end && o.begin < end;
  }
};

/// What one call reads and writes, gathered argument by argument, then checked at once: each
/// written span must miss every read span and every other written span. A bad pair throws
/// xent::error naming the written argument and the one it overlaps.
class call_memory {
 public:
  explicit call_memory(const char* fn) : fn_(fn) {}

  template <class View>
  call_memory& reads(const char* name, const View& v) {
    return add(read_, reads_, span_of(name, v));
  }
  template <class View>
  call_memory& writes(const char* name, const View& v) {
    return add(written_, writes_, span_of(name, v));
  }
  call_memory& writes_bytes(const char* name, const void* data, std::size_t bytes) {
    return add(written_, writes_, span_of(name, data, bytes));
  }

  /// The logits, unless the gradient is written over them (in place: check_gradient allows that
  /// only as the very same array, which `grad` then stands for among the written spans).
  template <class L, class G>
  call_memory& reads_logits(const matrix_view<L>& logits, const matrix_view<G>& grad) {
    const bool in_place = grad.data != nullptr && static_cast<const void*>(grad.data) ==
                                                      static_cast<const void*>(logits.data);
    return in_place ? *this : reads("logits", logits);
  }

  /// Class ids or soft-target probabilities (any targets type target_traits accepts), and the
  /// class weights of `opts`.
  template <class I>
  call_memory& reads_targets(const vector_view<I>& ids, const options& opts) {
    return reads("targets", ids).reads("options.class_weights", opts.class_weights);
  }
  template <class S>
  call_memory& reads_targets(const soft_targets<S>& t, const options& opts) {
    return reads("targets", t.probs).reads("options.class_weights", opts.class_weights);
  }

  template <class A>
  call_memory& reads_upstream(const basic_upstream<A>& up) {
    return reads("upstream.rows", up.rows).reads("upstream.scale_ptr", up.scale_ptr);
  }

  template <class B>
  call_memory& writes_outputs(const basic_forward_outputs<B>& out) {
    return writes("outputs.loss", out.loss)
        .writes("outputs.row_loss", out.row_loss)
        .writes("outputs.lse", out.lse)
        .writes("outputs.argmax", out.argmax)
        .writes("outputs.num_correct", out.num_correct);
  }

  void check() const {
    for (int w = 0; w < writes_; ++w) {
      for (int r = 0; r < reads_; ++r)
        require(!written_[w].overlaps(read_[r]), fn_, written_[w].name,
                [&] { return std::string("overlaps ") + read_[r].name; });
      for (int o = w + 1; o < writes_; ++o)
        require(!written_[w].overlaps(written_[o]), fn_, written_[w].name,
                [&] { return std::string("overlaps ") + written_[o].name; });
    }
  }

 private:
  // The most spans any entry point has: hidden, weight, bias, targets, class weights, LSE and
  // two upstream pieces read; three gradients, a workspace and five outputs written (a gradient,
  // five outputs, a CUDA execution object's workspace and error count in the core's calls).
  static constexpr int capacity = 10;

  call_memory& add(span_of (&list)[capacity], int& count, const span_of& s) {
    if (s.begin == nullptr) return *this;
    require(count < capacity, fn_, s.name, "xent internal: too many spans to check");
    list[count++] = s;
    return *this;
  }

  const char* fn_;
  span_of read_[capacity];
  span_of written_[capacity];
  int reads_ = 0;
  int writes_ = 0;
};

/// Memory an execution object names that the cross-entropy calls write beside their arguments:
/// none by default. A backend that has some (xent::cuda: its workspace and error count) overloads
/// `exec_writes(detail::call_memory&, const Exec&)` in namespace xent, which argument-dependent
/// lookup prefers to this template.
template <class Exec>
void exec_writes(call_memory&, const Exec&) {}

/// A forward call's memory: the logits, targets and class weights read, the outputs (and the
/// execution object's memory) written.
template <class Exec, class L, class Targets, class B>
void check_forward_memory(const char* fn, const Exec& exec, const matrix_view<L>& logits,
                          const Targets& targets, const options& opts,
                          const basic_forward_outputs<B>& out) {
  call_memory mem(fn);
  mem.reads("logits", logits).reads_targets(targets, opts).writes_outputs(out);
  exec_writes(mem, exec);
  mem.check();
}

/// A call that writes a gradient: the logits (unless in place), targets, class weights, a saved
/// LSE (backward; empty for forward_backward) and the upstream gradient read, the gradient, the
/// outputs (forward_backward; empty for backward) and the execution object's memory written.
template <class Exec, class L, class Targets, class A, class B, class G>
void check_gradient_memory(const char* fn, const Exec& exec, const matrix_view<L>& logits,
                           const Targets& targets, const options& opts,
                           const vector_view<const A>& lse, const basic_upstream<A>& up,
                           const basic_forward_outputs<B>& out, const matrix_view<G>& grad) {
  call_memory mem(fn);
  mem.reads_logits(logits, grad)
      .reads_targets(targets, opts)
      .reads("lse", lse)
      .reads_upstream(up)
      .writes("grad", grad)
      .writes_outputs(out);
  exec_writes(mem, exec);
  mem.check();
}

}  // namespace detail
}  // namespace xent
