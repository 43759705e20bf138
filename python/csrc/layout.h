// Which 2-D tensors xent can read, and write, row by row where they lie: the class dimension
// (the last) contiguous, and each row starting at least a row's length after the previous one, so
// the row stride can be xent's leading dimension. Shared by the op bodies (xent_ops.h: others are
// copied first) and the autograd formula (xent_autograd.cpp: an in-place backward only over such
// logits).
#pragma once

#include <ATen/core/Tensor.h>

namespace xent_torch {

inline bool rows_readable_in_place(const at::Tensor& t) {
  return t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1) &&
         (t.size(0) <= 1 || t.stride(0) >= t.size(1));
}

}  // namespace xent_torch
