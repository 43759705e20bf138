// linear_traits<Exec>: the per-backend implementation of fused linear cross-entropy, selected by
// the execution object as backend_traits selects the cross-entropy core.
#pragma once

#include <type_traits>

namespace xent {

/// Specialised by each backend (cpu/linear.hpp; a CUDA one later) with
///   template <class T, class G> static linear_workspace_sizes
///       workspace_size(exec, linear_shape, linear_pass, dw_accumulation, budget);
///   static void forward(exec, hidden, weight, bias, targets, opts, outputs, workspace);
///   static void forward_backward(exec, hidden, weight, bias, targets, opts, upstream, outputs,
///                                grads, workspace);
///   static void backward(exec, hidden, weight, bias, targets, opts, lse, upstream, grads,
///                        workspace);
/// The entry points (linear.hpp) check every argument, the workspace's size included, first.
///
/// GEMM libraries are the caller's: a CUDA specialisation reads the stream and the cuBLAS handle
/// from its execution object (xent::cuda gains a handle member for it) and never creates one.
template <class Exec>
struct linear_traits;

/// Specialised by each backend that runs vocab-parallel fused linear calls
/// (cpu/vocab_parallel_linear.hpp, cuda/vocab_parallel_linear.cuh) with
///   template <class T, class G> static std::size_t
///       workspace_bytes(exec, linear_shape, ranks, linear_pass, dw_accumulation, chunk_rows);
///   template <class T, class G, class Tgt> using call = ...;
/// where `call` holds one call's state and runs the steps of a chunk that the shared chunk loop
/// (parallel/linear_chunks.hpp, which lists them) asks for; the loop makes the collective.
template <class Exec>
struct vocab_parallel_linear_traits;

namespace detail {
template <class Exec, class = void>
struct has_linear_backend : std::false_type {};
template <class Exec>
struct has_linear_backend<Exec, std::void_t<decltype(sizeof(linear_traits<Exec>))>>
    : std::true_type {};
template <class Exec, class = void>
struct has_vocab_parallel_linear : std::false_type {};
template <class Exec>
struct has_vocab_parallel_linear<Exec,
                                 std::void_t<decltype(sizeof(vocab_parallel_linear_traits<Exec>))>>
    : std::true_type {};
}  // namespace detail

}  // namespace xent
