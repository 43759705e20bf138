"""nn.Module wrappers over xent.torch.cross_entropy and xent.torch.linear_cross_entropy."""

from typing import Optional

import torch

from .ops import (
    _ACCUMULATIONS,
    _ORDERS,
    _linear_choice,
    _sparse_threshold,
    cross_entropy,
    linear_cross_entropy,
)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss with xent's fused kernels: a subclass with the same arguments,
    attributes and state (the `weight` buffer), so it replaces torch's anywhere; the
    keyword-only extensions are xent.torch.cross_entropy's."""

    def __init__(
        self,
        weight: Optional[torch.Tensor] = None,
        size_average=None,
        ignore_index: int = -100,
        reduce=None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        inplace_backward: bool = False,
        return_lse: bool = False,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
    ) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.z_loss = z_loss
        self.softcap = softcap
        self.inplace_backward = inplace_backward
        self.return_lse = return_lse
        self.return_z_loss = return_z_loss
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return cross_entropy(
            input,
            target,
            self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
            inplace_backward=self.inplace_backward,
            return_lse=self.return_lse,
            return_z_loss=self.return_z_loss,
            return_token_accuracy=self.return_token_accuracy,
            return_predicted_tokens=self.return_predicted_tokens,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
            f"softcap={self.softcap}, inplace_backward={self.inplace_backward}"
        )


class LinearCrossEntropyLoss(torch.nn.Module):
    """Fused LM head + cross-entropy: forward(hidden, weight, target, bias=None) is
    cross_entropy(hidden @ weight.T + bias, target) without the logits
    (xent.torch.linear_cross_entropy). class_weight is torch.nn.CrossEntropyLoss's weight;
    order, accumulate and sparse_threshold are linear_cross_entropy's training choices (checked
    here)."""

    def __init__(
        self,
        class_weight: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        *,
        order: str = "automatic",
        accumulate: str = "fp32",
        sparse_threshold: float = 0.0,
    ) -> None:
        super().__init__()
        _linear_choice("order", order, _ORDERS)
        _linear_choice("accumulate", accumulate, _ACCUMULATIONS)
        _sparse_threshold(sparse_threshold)
        self.register_buffer("class_weight", class_weight)
        self.options = dict(
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
            order=order,
            accumulate=accumulate,
            sparse_threshold=sparse_threshold,
        )

    def forward(self, hidden, weight, target, bias=None):
        return linear_cross_entropy(
            hidden, weight, target, bias, class_weight=self.class_weight, **self.options
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
