"""nn.Module wrappers over xent.torch.cross_entropy and xent.torch.linear_cross_entropy."""

import torch

from .ops import cross_entropy, linear_cross_entropy


class _XentLoss(torch.nn.Module):
    """The options both losses share; per-class weights live in the buffer `weight_name`."""

    def __init__(
        self, weight_name, weight, ignore_index, reduction, label_smoothing, z_loss, softcap
    ):
        super().__init__()
        self.register_buffer(weight_name, weight)
        self._weight_name = weight_name
        self.options = dict(
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
        )

    def extra_repr(self):
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class CrossEntropyLoss(_XentLoss):
    """torch.nn.CrossEntropyLoss with xent's fused kernels (class dimension last), plus z_loss,
    softcap and the opt-in inplace_backward of xent.torch.cross_entropy."""

    def __init__(
        self,
        weight=None,
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        z_loss=0.0,
        softcap=None,
        inplace_backward=False,
    ):
        super().__init__(
            "weight", weight, ignore_index, reduction, label_smoothing, z_loss, softcap
        )
        self.options["inplace_backward"] = inplace_backward

    def forward(self, input, target):
        return cross_entropy(input, target, weight=self.weight, **self.options)


class LinearCrossEntropyLoss(_XentLoss):
    """Fused LM head + cross-entropy: forward(hidden, weight, target, bias=None) is
    cross_entropy(hidden @ weight.T + bias, target) without the logits
    (xent.torch.linear_cross_entropy). class_weight is torch.nn.CrossEntropyLoss's weight."""

    def __init__(
        self,
        class_weight=None,
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        z_loss=0.0,
        softcap=None,
    ):
        super().__init__(
            "class_weight", class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap
        )

    def forward(self, hidden, weight, target, bias=None):
        return linear_cross_entropy(
            hidden, weight, target, bias, class_weight=self.class_weight, **self.options
        )
