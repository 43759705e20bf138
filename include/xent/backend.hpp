// The one list of backend traits. Execution objects select a backend through these templates, as
// std::execution policies or thrust::device select an algorithm's implementation; each backend
// (cpu/, cuda/) specialises the ones it implements, and the entry points detect them with has_*.
#pragma once

#include <type_traits>

namespace xent {

/// Cross-entropy over logits. Specialised by each backend (cpu/backend.hpp, cuda/backend.cuh) with
///   template <class T> static constexpr bool supports_dtype;   // logits / gradient element types
///   template <class T, class G> static constexpr bool supports_gradient;  // G for T's logits
///   static void forward(exec, logits, targets, opts, outputs);
///   static void backward(exec, logits, targets, opts, lse, upstream, grad);
///   static void forward_backward(exec, logits, targets, opts, upstream, outputs, grad);
/// The public entry points (loss.hpp) validate every argument before calling these.
template <class Exec>
struct backend_traits;

/// Vocab-parallel cross-entropy. Specialised by each backend that runs it (cpu/vocab_parallel.hpp,
/// cuda/vocab_parallel.cuh) with
///   static void forward(exec, group, logits, shard, targets, opts, outputs);
///   static void backward(exec, group, logits, shard, targets, opts, lse, upstream, grad);
///   static void forward_backward(exec, group, logits, shard, targets, opts, upstream, outputs,
///                                grad);
/// called by parallel/vocab_parallel.hpp after its argument checks, and the split phases
///   static void records(exec, logits, shard, targets, opts, record_layout, send);
///   static void finish(exec, ranks, logits, shard, targets, opts, record_layout, recv, outputs,
///                      row_mass, upstream or null, grad);
///   static void backward_from_mass(exec, logits, shard, targets, opts, lse, row_mass, upstream,
///                                  grad);
/// called by parallel/vocab_parallel_phases.hpp after its own.
template <class Exec>
struct vocab_parallel_traits;

/// Fused linear cross-entropy. Specialised by each backend (cpu/linear.hpp, cuda/linear.cuh) with
///   template <class T, class G> static linear_workspace_sizes
///       workspace_size(exec, linear_shape, linear_pass, dw_accumulation, budget);
///   static void forward(exec, hidden, weight, bias, targets, opts, outputs, workspace);
///   static void forward_backward(exec, hidden, weight, bias, targets, opts, upstream, outputs,
///                                grads, workspace);
///   static void backward(exec, hidden, weight, bias, targets, opts, lse, upstream, grads,
///                        workspace);
/// The entry points (linear.hpp) check every argument, the workspace's size included, first.
/// GEMM libraries are the caller's: the CUDA specialisation reads the stream and the cuBLAS handle
/// from its execution object and never creates one.
template <class Exec>
struct linear_traits;

/// Vocab-parallel fused linear cross-entropy. Specialised by each backend that runs it
/// (cpu/vocab_parallel_linear.hpp, cuda/vocab_parallel_linear.cuh) with
///   template <class T, class G> static std::size_t
///       workspace_bytes(exec, linear_shape, ranks, linear_pass, dw_accumulation, linear_order,
///                       chunk_rows);
///   template <class T, class G, class Tgt> using call = ...;
/// where `call` holds one call's state and runs the steps of a chunk that the shared chunk loop
/// (parallel/linear_chunks.hpp, which lists them) asks for; the loop makes the collective.
template <class Exec>
struct vocab_parallel_linear_traits;

namespace detail {
// has_X<Exec>: whether a backend specialised X for Exec (a complete type has a size), so an entry
// point can reject an execution object without the backend with a readable static_assert.
template <template <class> class Traits, class Exec, class = void>
struct is_specialised : std::false_type {};
template <template <class> class Traits, class Exec>
struct is_specialised<Traits, Exec, std::void_t<decltype(sizeof(Traits<Exec>))>> : std::true_type {
};

template <class Exec>
using has_backend = is_specialised<backend_traits, Exec>;
template <class Exec>
using has_vocab_parallel = is_specialised<vocab_parallel_traits, Exec>;
template <class Exec>
using has_linear_backend = is_specialised<linear_traits, Exec>;
template <class Exec>
using has_vocab_parallel_linear = is_specialised<vocab_parallel_linear_traits, Exec>;
}  // namespace detail

}  // namespace xent
