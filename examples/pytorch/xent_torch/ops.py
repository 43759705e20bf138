"""xent_torch.cross_entropy: torch.ops.xent.* with autograd and fake kernels.

The C++ ops (csrc/xent_ops.cpp) compute on 2-D (N, C) logits; this module flattens (..., C)
inputs, registers the fake (meta) kernels torch.compile traces with and the autograd formula,
and casts the float32 loss to the input's dtype.
"""

import torch

from . import _build

_build.load()

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


@torch.library.register_fake("xent::cross_entropy_fwd")
def _fwd_fake(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
              inplace_backward):
    n = input.shape[0]
    loss = input.new_empty((n,) if reduction == 0 else (), dtype=torch.float32)
    return loss, input.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("xent::cross_entropy_bwd")
def _bwd_fake(grad_output, input, target, weight, lse, ignore_index, reduction, label_smoothing,
              z_loss, softcap):
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.register_fake("xent::cross_entropy_bwd_")
def _bwd_inplace_fake(grad_output, input, target, weight, lse, ignore_index, reduction,
                      label_smoothing, z_loss, softcap):
    return None


def _setup_context(ctx, inputs, output):
    input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, inplace = inputs
    ctx.save_for_backward(input, target, weight, output[1])
    ctx.options = (ignore_index, reduction, label_smoothing, z_loss, softcap)
    ctx.inplace = inplace


def _backward(ctx, grad_loss, grad_lse):
    # grad_lse is ignored: lse is a saved statistic, not a differentiable result.
    input, target, weight, lse = ctx.saved_tensors
    args = (grad_loss, input, target, weight, lse, *ctx.options)
    # In place needs rows with a contiguous last dimension; other layouts get a fresh gradient
    # (the result is the same, only the memory saving is lost).
    if ctx.inplace and input.stride(-1) == 1:
        torch.ops.xent.cross_entropy_bwd_(*args)
        # The kernel wrote through a pointer, which autograd cannot see: bump the version counter so
        # that a backward which saved these logits (e.g. tanh's output) fails loudly instead of
        # reading the gradient as if it were the logits.
        if not torch.compiler.is_compiling():
            torch.autograd.graph.increment_version(input)
        grad = input
    else:
        grad = torch.ops.xent.cross_entropy_bwd(*args)
    return grad, None, None, None, None, None, None, None, None


torch.library.register_autograd("xent::cross_entropy_fwd", _backward, setup_context=_setup_context)


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, z_loss=0.0, softcap=None, inplace_backward=False):
    """Cross-entropy of logits `input` (..., C) against class ids `target` (...), fused by xent.

    Matches torch.nn.functional.cross_entropy for weight, ignore_index, reduction and
    label_smoothing, with the class dimension LAST (language-model layout: (N, C), (B, T, C));
    torch's own (N, C, d1, ...) layout is not accepted. target: int64 or int32. input: float32,
    bfloat16 or float16 (no float64: xent accumulates in float32). Extensions:
      z_loss            adds z_loss * logsumexp(x)^2 per row not ignored (PaLM)
      softcap           logits become softcap * tanh(x / softcap) first (Gemma 2); None is off
      inplace_backward  backward writes the gradient over `input`'s memory instead of a new
                        tensor (saves N x C elements). DANGER: the logits are destroyed; any other
                        use of them afterwards (another loss, a saved activation, logging) sees the
                        gradient. Off by default (Liger #272). Inputs whose last dimension is not
                        contiguous get an out-of-place gradient.
    The reduced loss has input's dtype; the arithmetic is float32 throughout.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if input.dim() < 1:
        raise ValueError("input must have a class dimension")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must be input shape without its "
                         f"last (class) dimension, {tuple(input.shape[:-1])}")
    classes = input.shape[-1]
    x = input if input.dim() == 2 else input.reshape(-1, classes)
    t = target.reshape(-1)
    loss, _ = torch.ops.xent.cross_entropy_fwd(
        x, t, weight, int(ignore_index), _REDUCTIONS[reduction], float(label_smoothing),
        float(z_loss), 0.0 if softcap is None else float(softcap), bool(inplace_backward))
    if reduction == "none":
        loss = loss.reshape(input.shape[:-1])
    return loss.to(input.dtype)


# --- fused linear cross-entropy --------------------------------------------------------------------


@torch.library.register_fake("xent::linear_cross_entropy_fwd")
def _linear_fwd_fake(hidden, weight, bias, target, class_weight, ignore_index, reduction,
                     label_smoothing, z_loss, softcap):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == 0 else (), dtype=torch.float32)
    return loss, hidden.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("xent::linear_cross_entropy_bwd")
def _linear_bwd_fake(grad_output, hidden, weight, bias, target, class_weight, lse, ignore_index,
                     reduction, label_smoothing, z_loss, softcap):
    d_bias = hidden.new_empty((weight.shape[0] if bias is not None else 0,))
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), d_bias


def _linear_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, class_weight, *options = inputs
    ctx.save_for_backward(hidden, weight, bias, target, class_weight, output[1])
    ctx.options = tuple(options)


def _linear_backward(ctx, grad_loss, grad_lse):
    hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
    d_hidden, d_weight, d_bias = torch.ops.xent.linear_cross_entropy_bwd(
        grad_loss, hidden, weight, bias, target, class_weight, lse, *ctx.options)
    return (d_hidden, d_weight, d_bias if bias is not None else None, None, None, None, None,
            None, None, None)


torch.library.register_autograd("xent::linear_cross_entropy_fwd", _linear_backward,
                                setup_context=_linear_setup_context)


def linear_cross_entropy(hidden, weight, target, bias=None, class_weight=None, ignore_index=-100,
                         reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None):
    """cross_entropy(hidden @ weight.T + bias, target, ...) without materialising the logits.

    hidden (..., D), weight (V, D) (an LM head), bias (V,) or None, all of one dtype (float32,
    bfloat16 or float16); target (...) class ids, int64 or int32. class_weight is
    cross_entropy's `weight` (per-class weights); every other option is cross_entropy's.
    The logits are computed a chunk of rows at a time (xent::linear_forward) and recomputed in
    backward (xent::linear_backward) from the saved per-row log-sum-exp.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must be hidden shape without its "
                         f"last dimension, {tuple(hidden.shape[:-1])}")
    h = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
    loss, _ = torch.ops.xent.linear_cross_entropy_fwd(
        h, weight, bias, target.reshape(-1), class_weight, int(ignore_index),
        _REDUCTIONS[reduction], float(label_smoothing), float(z_loss),
        0.0 if softcap is None else float(softcap))
    if reduction == "none":
        loss = loss.reshape(hidden.shape[:-1])
    return loss.to(hidden.dtype)
