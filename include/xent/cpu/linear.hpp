// linear_traits<cpu>: fused linear cross-entropy on the CPU, in the order the front end resolved
// (linear/options.hpp's linear_order): rows outer (linear_rows.hpp, the fast order; forward calls
// always) or the vocabulary outer (linear_panels.hpp, the low-memory order). Both are made of
// linear_steps.hpp's GEMMs and the cross-entropy core of backend.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../backend.hpp"
#include "../linear/options.hpp"
#include "../linear/plan.hpp"
#include "../options.hpp"
#include "../views.hpp"
#include "cpu.hpp"
#include "linear_panels.hpp"
#include "linear_plan.hpp"
#include "linear_rows.hpp"

namespace xent {

template <>
struct linear_traits<cpu> {
  /// `sparse`: for calls with a sparse threshold (the low-memory order's extra buffers).
  template <class T, class G>
  static linear_workspace_sizes workspace_size(const cpu& exec, const linear_shape& shape,
                                               linear_pass pass, dw_accumulation accumulate,
                                               linear_order order, std::size_t budget,
                                               bool sparse) {
    if (pass == linear_pass::training && order == linear_order::low_memory) {
      const auto least = cpu_detail::make_low_memory_plan<T, G>(exec, shape, 1, 1, sparse);
      const auto fixed = cpu_detail::make_low_memory_plan<T, G>(exec, shape, 0, 1, sparse);
      const auto plan = cpu_detail::plan_low_memory<T, G>(
          exec, shape, detail::chunk_budget(fixed.bytes, budget), sparse);
      return {least.bytes, plan.bytes, std::min(plan.panel.chunk_rows, shape.rows)};
    }
    const auto least = cpu_detail::make_linear_plan<T, G>(exec, shape, pass, accumulate, 1);
    const auto fixed = cpu_detail::make_linear_plan<T, G>(exec, shape, pass, accumulate, 0);
    const auto plan = cpu_detail::plan_linear<T, G>(exec, shape, pass, accumulate,
                                                    detail::chunk_budget(fixed.bytes, budget));
    return {least.bytes, plan.bytes, std::min(plan.chunk_rows, shape.rows)};
  }

  template <class T, class Tgt, class A>
  static void forward(const cpu& exec, matrix_view<const T> hidden, matrix_view<const T> weight,
                      vector_view<const T> bias, const Tgt& targets, const linear_options& opts,
                      const basic_forward_outputs<A>& out, const linear_workspace& ws) {
    cpu_detail::run_linear<cpu_detail::linear_mode::forward>(
        "xent::linear_forward", exec, hidden, weight, bias, targets, opts,
        static_cast<const basic_upstream<A>*>(nullptr), vector_view<const A>{}, out,
        linear_grads<A>{}, ws);
  }

  template <class T, class Tgt, class A, class G>
  static void forward_backward(const cpu& exec, matrix_view<const T> hidden,
                               matrix_view<const T> weight, vector_view<const T> bias,
                               const Tgt& targets, const linear_options& opts,
                               const basic_upstream<A>& up, const basic_forward_outputs<A>& out,
                               const linear_grads<G>& grads, const linear_workspace& ws) {
    constexpr const char* fn = "xent::linear_forward_backward";
    if (opts.order == linear_order::low_memory)
      cpu_detail::run_low_memory(fn, exec, hidden, weight, bias, targets, opts, up,
                                 static_cast<const vector_view<const A>*>(nullptr), out, grads, ws);
    else
      cpu_detail::run_linear<cpu_detail::linear_mode::fused>(
          fn, exec, hidden, weight, bias, targets, opts, &up, vector_view<const A>{}, out, grads,
          ws);
  }

  template <class T, class Tgt, class A, class G>
  static void backward(const cpu& exec, matrix_view<const T> hidden, matrix_view<const T> weight,
                       vector_view<const T> bias, const Tgt& targets, const linear_options& opts,
                       vector_view<const A> lse, const basic_upstream<A>& up,
                       const linear_grads<G>& grads, const linear_workspace& ws) {
    constexpr const char* fn = "xent::linear_backward";
    if (opts.order == linear_order::low_memory)
      cpu_detail::run_low_memory(fn, exec, hidden, weight, bias, targets, opts, up, &lse,
                                 basic_forward_outputs<A>{}, grads, ws);
    else
      cpu_detail::run_linear<cpu_detail::linear_mode::backward>(
          fn, exec, hidden, weight, bias, targets, opts, &up, lse, basic_forward_outputs<A>{},
          grads, ws);
  }
};

}  // namespace xent
