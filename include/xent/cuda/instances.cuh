// The row dispatch's instances that the xent::cuda_kernels library compiles once, and, where a
// translation unit links that library (XENT_CUDA_PRECOMPILED, which the target sets), their
// explicit instantiation declarations: such a unit compiles none of those kernels itself.
//
// The row dispatch (dispatch/rows.cuh's dispatch_rows) is where every kernel of a cross-entropy
// pass is chosen and launched: the entry points, the fused linear calls' chunks and the
// vocab-parallel shards all run their rows through it, over device types (__nv_bfloat16 for
// either bfloat16), so one instance serves each of them and both spellings of a dtype. The
// definitions stay visible: a call outside this list still compiles its kernels where it is made,
// as on the header-only route (no XENT_CUDA_PRECOMPILED), which compiles everything itself.
//
// The list: logits of float, bfloat16 and half; class ids of int32 (JAX) and int64 (PyTorch) and
// soft targets of float or of the logits' dtype; gradients of the logits' dtype or float (a float
// gradient of bf16 logits, as the vocab-parallel and mixed-precision calls take). A
// translation unit that changes the kernels' build (XENT_CUDA_TUNING_OVERRIDE,
// XENT_CUDA_TUNED_MAJOR) must see the library built with the same definitions (CMake's
// xent_target_options gives both).
#pragma once

#include <cstdint>

#include "dispatch/rows.cuh"

// XENT_CUDA_ROWS(X, DTYPE, PASS): X(PASS, T, G, Tgt) for each instance of one pass (forward, fused,
// backward) over logits of one dtype (f32, bf16, f16): the library compiles one of these per
// object file, so that the build spreads them over its cores.
#define XENT_CUDA_ROWS(X, D, P) XENT_CUDA_ROWS_OF(X, D, P)
#define XENT_CUDA_ROWS_OF(X, D, P) XENT_CUDA_ROWS_##D(X, P)
#define XENT_CUDA_ROWS_f32(X, P) XENT_CUDA_ROWS_TARGETS(X, P, float, float)
#define XENT_CUDA_ROWS_bf16(X, P) XENT_CUDA_ROWS_16(X, P, __nv_bfloat16)
#define XENT_CUDA_ROWS_f16(X, P) XENT_CUDA_ROWS_16(X, P, __half)
// 16-bit logits: soft targets of their own dtype too; a float gradient, and in the passes that
// write one, a gradient of the logits' dtype (forward's gradient type is float, unused).
#define XENT_CUDA_ROWS_16(X, P, T) \
  XENT_CUDA_ROWS_TARGETS_16(X, P, T, float) XENT_CUDA_ROWS_GRADIENT_##P(X, P, T)
#define XENT_CUDA_ROWS_GRADIENT_forward(X, P, T)
#define XENT_CUDA_ROWS_GRADIENT_fused(X, P, T) XENT_CUDA_ROWS_TARGETS_16(X, P, T, T)
#define XENT_CUDA_ROWS_GRADIENT_backward(X, P, T) XENT_CUDA_ROWS_TARGETS_16(X, P, T, T)
#define XENT_CUDA_ROWS_TARGETS(X, P, T, G)                 \
  X(P, T, G, ::xent::cuda_detail::class_ids<std::int32_t>) \
  X(P, T, G, ::xent::cuda_detail::class_ids<std::int64_t>) \
  X(P, T, G, ::xent::cuda_detail::soft_probs<float>)
#define XENT_CUDA_ROWS_TARGETS_16(X, P, T, G) \
  XENT_CUDA_ROWS_TARGETS(X, P, T, G) X(P, T, G, ::xent::cuda_detail::soft_probs<T>)

// One instance: its explicit instantiation definition (the library's) and declaration.
#define XENT_CUDA_ROWS_INSTANCE(P, T, G, Tgt)                                                  \
  template void ::xent::cuda_detail::dispatch_rows<::xent::cuda_detail::pass::P, T, G, Tgt>(   \
      const char*, const ::xent::cuda&, const ::xent::cuda_detail::row_args<T, G, Tgt>&, bool, \
      bool);
#define XENT_CUDA_ROWS_EXTERN(P, T, G, Tgt) extern XENT_CUDA_ROWS_INSTANCE(P, T, G, Tgt)

#if defined(XENT_CUDA_PRECOMPILED)
XENT_CUDA_ROWS(XENT_CUDA_ROWS_EXTERN, f32, forward)
XENT_CUDA_ROWS(XENT_CUDA_ROWS_EXTERN, f32, fused)
XENT_CUDA_ROWS(XENT_CUDA_ROWS_EXTERN, f32, backward)
XENT_CUDA_ROWS(XENT_CUDA_ROWS_EXTERN, bf16, forward)
XENT_CUDA_ROWS(XENT_CUDA_ROWS_EXTERN, bf16, fused)
XENT_CUDA_ROWS(XENT_CUDA_ROWS_EXTERN, bf16, backward)
XENT_CUDA_ROWS(XENT_CUDA_ROWS_EXTERN, f16, forward)
XENT_CUDA_ROWS(XENT_CUDA_ROWS_EXTERN, f16, fused)
XENT_CUDA_ROWS(XENT_CUDA_ROWS_EXTERN, f16, backward)
#endif
