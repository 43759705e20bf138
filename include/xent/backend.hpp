// Execution objects select a backend through backend_traits, as std::execution policies or
// thrust::device select an algorithm's implementation.
#pragma once

#include <type_traits>

namespace xent {

/// Specialised by each backend (cpu/backend.hpp, cuda/backend.cuh) with
///   template <class T> static constexpr bool supports_dtype;   // logits / gradient element types
///   static void forward(exec, logits, targets, opts, outputs);
///   static void backward(exec, logits, targets, opts, lse, upstream, grad);
///   static void forward_backward(exec, logits, targets, opts, upstream, outputs, grad);
/// The public entry points (loss.hpp) validate every argument before calling these.
template <class Exec>
struct backend_traits;

/// Specialised by each backend that runs vocab-parallel calls (cpu/vocab_parallel.hpp) with
///   static void forward(exec, group, logits, shard, targets, opts, outputs);
///   static void backward(exec, group, logits, shard, targets, opts, lse, upstream, grad);
///   static void forward_backward(exec, group, logits, shard, targets, opts, upstream, outputs,
///                                grad);
/// called by parallel/vocab_parallel.hpp after its argument checks.
template <class Exec>
struct vocab_parallel_traits;

namespace detail {
template <class Exec, class = void>
struct has_backend : std::false_type {};
template <class Exec>
struct has_backend<Exec, std::void_t<decltype(sizeof(backend_traits<Exec>))>> : std::true_type {};
template <class Exec, class = void>
struct has_vocab_parallel : std::false_type {};
template <class Exec>
struct has_vocab_parallel<Exec, std::void_t<decltype(sizeof(vocab_parallel_traits<Exec>))>>
    : std::true_type {};
}  // namespace detail

}  // namespace xent
