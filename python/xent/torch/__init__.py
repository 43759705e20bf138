"""xent for PyTorch: fused cross-entropy as custom ops (C++ autograd, torch.compile-ready).

    import xent.torch
    loss = xent.torch.cross_entropy(logits, target, label_smoothing=0.1)
    loss = xent.torch.linear_cross_entropy(hidden, lm_head.weight, target)
    xent.torch.patch(hf_causal_lm)   # its training loss by fused linear cross-entropy

The ops are compiled when the package is installed (pip install ./python): CPU kernels always,
CUDA kernels when torch has CUDA and nvcc was found then (cuda_built() says which).
"""

from .huggingface import patch
from .modules import CrossEntropyLoss, LinearCrossEntropyLoss
from .ops import (
    CrossEntropyOutput,
    cross_entropy,
    cuda_built,
    cuda_target_errors,
    linear_cross_entropy,
    linear_workspace_bytes,
)

__all__ = [
    "cross_entropy",
    "linear_cross_entropy",
    "linear_workspace_bytes",
    "CrossEntropyLoss",
    "CrossEntropyOutput",
    "LinearCrossEntropyLoss",
    "cuda_built",
    "cuda_target_errors",
    "patch",
]
