// A fused linear training call's choices as the Python bindings pass them, ints as they pass the
// reduction: order 0 automatic, 1 fast, 2 low_memory (xent::linear_order); accumulate 0 fp32,
// 1 output (xent::dw_accumulation); the sparse backward's threshold (0: exact; xent checks it).
// Shared by xent.torch (xent_ops.h) and xent.jax (jax/ffi_linear.h), each raising its own error.
#pragma once

#include <cstdint>
#include <string>

#include <xent/xent.hpp>

namespace xent_bindings {

/// A code out of range: the argument and what it must be (an empty argument: none).
struct choice_error {
  std::string argument, what;
};

inline choice_error check_linear_choices(std::int64_t order, std::int64_t accumulate) {
  if (order < 0 || order > 2)
    return {"order",
            "must be 0 (automatic), 1 (fast) or 2 (low_memory), got " + std::to_string(order)};
  if (accumulate != 0 && accumulate != 1)
    return {"accumulate", "must be 0 (fp32) or 1 (output), got " + std::to_string(accumulate)};
  return {};
}

/// opts with the choices, whose codes check_linear_choices has passed.
inline void set_linear_choices(xent::linear_options& opts, std::int64_t order,
                               std::int64_t accumulate, double sparse_threshold) {
  opts.order = order == 0   ? xent::linear_order::automatic
               : order == 1 ? xent::linear_order::fast
                            : xent::linear_order::low_memory;
  opts.accumulate = accumulate == 0 ? xent::dw_accumulation::fp32 : xent::dw_accumulation::output;
  opts.sparse_threshold = static_cast<float>(sparse_threshold);
}

}  // namespace xent_bindings
