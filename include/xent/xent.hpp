// xent: fused cross-entropy. What a training loop includes.
//
//   xent::forward(exec, logits, targets, opts, outputs);
//   xent::backward(exec, logits, targets, opts, lse, upstream, grad);
//   xent::forward_backward(exec, logits, targets, opts, upstream, outputs, grad);
//
// and fused linear cross-entropy, whose logits hidden · weightᵀ (+ bias) are never materialised:
//   xent::linear_forward(exec, hidden, weight, bias, targets, opts, outputs, workspace);
//   xent::linear_backward(exec, hidden, weight, bias, targets, opts, lse, upstream, grads,
//   workspace); xent::linear_forward_backward(exec, hidden, weight, bias, targets, opts, upstream,
//   outputs,
//                                 grads, workspace);
//
// and vocab-parallel cross-entropy over a vocabulary split across ranks (parallel/):
//   xent::vocab_parallel_forward(exec, group, logits_shard, shard, targets, opts, outputs);
//   xent::vocab_parallel_backward(exec, group, logits_shard, shard, targets, opts, lse, upstream,
//                                 grad_shard);
//   xent::vocab_parallel_forward_backward(exec, group, logits_shard, shard, targets, opts,
//                                         upstream, outputs, grad_shard);
// or in two phases around a collective of the caller's (parallel/vocab_parallel_phases.hpp):
//   xent::vocab_parallel_records(exec, logits_shard, shard, targets, opts, argmax, send);
//   xent::vocab_parallel_finish(exec, ranks, logits_shard, shard, targets, opts, recv, outputs);
//
// and vocab-parallel fused linear cross-entropy over an LM head split by vocabulary (each rank
// gets its d_weight / d_bias rows and its partial d_hidden, which the caller sums over the group):
//   xent::vocab_parallel_linear_forward(exec, group, hidden, weight_shard, bias_shard, shard,
//                                       targets, opts, outputs, workspace);
//   xent::vocab_parallel_linear_backward(exec, group, hidden, weight_shard, bias_shard, shard,
//                                        targets, opts, lse, upstream, grads, workspace);
//   xent::vocab_parallel_linear_forward_backward(exec, group, hidden, weight_shard, bias_shard,
//                                                shard, targets, opts, upstream, outputs, grads,
//                                                workspace);
//
// exec is xent::cpu{threads} (always available) or, when compiled by nvcc, xent::cuda{stream}
// (with a cuBLAS handle, xent::cuda::cublas, for the linear calls).
// Vocab-parallel calls take a communicator: xent::inprocess_group's on the CPU, xent::nccl_group
// (parallel/nccl_group.cuh, included here when XENT_HAS_NCCL is defined) on CUDA.
#pragma once

#include "accumulator.hpp"
#include "backend.hpp"
#include "config.hpp"
#include "cpu/backend.hpp"
#include "cpu/cpu.hpp"
#include "cpu/eigen.hpp"
#include "cpu/linear.hpp"
#include "cpu/vocab_parallel.hpp"
#include "cpu/vocab_parallel_linear.hpp"
#include "error.hpp"
#include "linear.hpp"
#include "loss.hpp"
#include "loss_math.hpp"
#include "online_lse.hpp"
#include "options.hpp"
#include "parallel/communicator.hpp"
#include "parallel/inprocess_group.hpp"
#include "parallel/shard.hpp"
#include "parallel/vocab_parallel.hpp"
#include "parallel/vocab_parallel_linear.hpp"
#include "parallel/vocab_parallel_phases.hpp"
#include "targets.hpp"
#include "views.hpp"

#if defined(__CUDACC__)
#include "cuda/backend.cuh"
// Fused linear cross-entropy on CUDA needs cuBLAS's header (and, when called, its library).
#if __has_include(<cublas_v2.h>)
#include "cuda/linear.cuh"
#include "cuda/vocab_parallel_linear.cuh"
#endif
#include "cuda/vocab_parallel.cuh"
#if defined(XENT_HAS_NCCL)
#include "parallel/nccl_group.cuh"  // needs nccl.h; link with -lnccl
#endif
#endif
