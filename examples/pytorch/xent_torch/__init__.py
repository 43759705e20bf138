"""xent for PyTorch: fused cross-entropy as custom ops (autograd, torch.compile-ready).

    import xent_torch
    loss = xent_torch.cross_entropy(logits, target, label_smoothing=0.1)
    loss = xent_torch.linear_cross_entropy(hidden, lm_head.weight, target)

Importing builds the C++ extension on first use (see _build.py): CPU kernels always, CUDA kernels
when torch has CUDA and nvcc is found. linear_cross_entropy is CPU-only for now.
"""

from .modules import CrossEntropyLoss, LinearCrossEntropyLoss
from .ops import cross_entropy, cuda_built, cuda_target_errors, linear_cross_entropy

__all__ = ["cross_entropy", "linear_cross_entropy", "CrossEntropyLoss", "LinearCrossEntropyLoss",
           "cuda_built", "cuda_target_errors"]
