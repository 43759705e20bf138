// xent: fused cross-entropy. What a training loop includes.
//
//   xent::forward(exec, logits, targets, opts, outputs);
//   xent::backward(exec, logits, targets, opts, lse, upstream, grad);
//   xent::forward_backward(exec, logits, targets, opts, upstream, outputs, grad);
//
// exec is xent::cpu{threads} (always available) or, when compiled by nvcc, xent::cuda{stream}.
#pragma once

#include "backend.hpp"
#include "config.hpp"
#include "cpu/backend.hpp"
#include "cpu/cpu.hpp"
#include "cpu/eigen.hpp"
#include "error.hpp"
#include "loss.hpp"
#include "loss_math.hpp"
#include "online_lse.hpp"
#include "options.hpp"
#include "targets.hpp"
#include "views.hpp"

#if defined(__CUDACC__)
#include "cuda/backend.cuh"
#endif
