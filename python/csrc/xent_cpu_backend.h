// The CPU backend of the op bodies in xent_ops.h (and xent_vocab_parallel.h): torch's intra-op
// thread count, no workspace.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>

#include "xent_ops.h"

namespace xent_torch {

struct cpu_backend {
  struct guard {
    explicit guard(const c10::Device&) {}
  };
  struct call {
    xent::cpu exec;
  };
  static call exec(const at::Tensor&, bool, bool = false) {
    return {xent::cpu{std::max(1, at::get_num_threads())}};
  }
};

}  // namespace xent_torch
