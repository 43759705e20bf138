"""xent for PyTorch: fused cross-entropy as custom ops (autograd, torch.compile-ready).

    import xent_torch
    loss = xent_torch.cross_entropy(logits, target, label_smoothing=0.1)

Importing builds the C++ extension on first use (see _build.py). CPU tensors for now.
"""

from .modules import CrossEntropyLoss
from .ops import cross_entropy

__all__ = ["cross_entropy", "CrossEntropyLoss"]
