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
// exec is xent::cpu{threads} (always available) or, when compiled by nvcc, xent::cuda{stream}.
#pragma once

#include "backend.hpp"
#include "config.hpp"
#include "cpu/backend.hpp"
#include "cpu/cpu.hpp"
#include "cpu/eigen.hpp"
#include "cpu/linear.hpp"
#include "error.hpp"
#include "linear.hpp"
#include "loss.hpp"
#include "loss_math.hpp"
#include "online_lse.hpp"
#include "options.hpp"
#include "targets.hpp"
#include "views.hpp"

#if defined(__CUDACC__)
#include "cuda/backend.cuh"
#endif
