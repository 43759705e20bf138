"""nn.Module wrappers over xent_torch.cross_entropy."""

import torch

from .ops import cross_entropy


class CrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss with xent's fused kernels (class dimension last), plus z_loss,
    softcap and the opt-in inplace_backward of xent_torch.cross_entropy."""

    def __init__(self, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 z_loss=0.0, softcap=None, inplace_backward=False):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.inplace_backward = inplace_backward

    def forward(self, input, target):
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                             self.label_smoothing, self.z_loss, self.softcap,
                             self.inplace_backward)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"softcap={self.softcap}, inplace_backward={self.inplace_backward}")
