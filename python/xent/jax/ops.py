"""Cross-entropy over xent's FFI handlers, with a custom VJP.

The handlers (csrc/jax/ffi_ops.h) take logits as N x V rows; this module flattens the leading
dimensions, checks every argument before XLA sees it (TypeError / ValueError naming it), and
passes the options as FFI attributes. Under jax.vmap each ffi_call is batched with
vmap_method="expand_dims" (or "broadcast_all", see _call): the handler gets the batch as leading
dimensions (size 1 for an operand that is not batched, read for every batch element) and loops
over it in C++, with no Python loop.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # torch's enum order, as the handlers read it
_LOGIT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


class _Config(NamedTuple):
    """The static options of one call (hashable: a nondiff argument of the custom VJP)."""

    ignore_index: int
    reduction: int
    label_smoothing: float
    z_loss: float
    softcap: float

    def attrs(self):
        return {
            "ignore_index": np.int64(self.ignore_index),
            "reduction": np.int32(self.reduction),
            "label_smoothing": np.float32(self.label_smoothing),
            "z_loss": np.float32(self.z_loss),
            "softcap": np.float32(self.softcap),
        }


def _accumulator(dtype) -> jnp.dtype:
    """xent's accumulator for logits of `dtype`: float64 for float64, float32 otherwise."""
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def _call(target, results, *args, cfg=None, aliases=None, method=None):
    # A call writing over an input (aliases) needs that input of the result's shape under vmap:
    # broadcast_all copies an unbatched one to the batch, which is the result's memory anyway.
    if method is None:
        method = "broadcast_all" if aliases else "expand_dims"
    kwargs = cfg.attrs() if cfg is not None else {}
    return jax.ffi.ffi_call(target, results, vmap_method=method, input_output_aliases=aliases)(
        *args, **kwargs
    )


def _forward(x, y, w, cfg):
    n = x.shape[0]
    acc = _accumulator(x.dtype)
    loss_shape = (n,) if cfg.reduction == 0 else ()
    return _call(
        "xent_cross_entropy_fwd",
        (jax.ShapeDtypeStruct(loss_shape, acc), jax.ShapeDtypeStruct((n,), acc)),
        x,
        y,
        w,
        cfg=cfg,
    )


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(x, y, w, cfg):
    return _forward(x, y, w, cfg)


# What the forward saves. With mean or sum the loss's gradient is a scalar, so the forward runs
# xent's fused pass (forward_backward): it reads the logits once and writes d loss / d logits for
# an upstream gradient of 1 over the logits' own buffer (XLA copies first only where the logits
# are still needed), and backward scales it in place, doing nothing when the scale is 1 (jax.grad
# of the loss itself). Saving the LSE instead would read the logits a second time in backward and
# keep them alive until then. With reduction none each row's upstream gradient exists only in
# backward: the forward saves the LSE and backward reads the logits again.
def _cross_entropy_fwd(x, y, w, cfg):
    if cfg.reduction == 0:
        loss, lse = _forward(x, y, w, cfg)
        return (loss, lse), (x, y, w, lse)
    acc = _accumulator(x.dtype)
    loss, lse, grad = _call(
        "xent_cross_entropy_fwd_bwd",
        (
            jax.ShapeDtypeStruct((), acc),
            jax.ShapeDtypeStruct((x.shape[0],), acc),
            jax.ShapeDtypeStruct(x.shape, x.dtype),
        ),
        x,
        y,
        w,
        cfg=cfg,
        aliases={0: 2},
    )
    return (loss, lse), (grad,)


def _cross_entropy_bwd(cfg, saved, cotangents):
    g = cotangents[0]  # the LSE leaves the custom VJP through stop_gradient: its cotangent is 0
    if cfg.reduction == 0:
        x, y, w, lse = saved
        grad = _call(
            "xent_cross_entropy_bwd",
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            x,
            y,
            w,
            lse,
            g.astype(lse.dtype),
            cfg=cfg,
        )
    else:
        (grad,) = saved
        grad = _call(
            "xent_scale_grad",
            jax.ShapeDtypeStruct(grad.shape, grad.dtype),
            grad,
            g.astype(_accumulator(grad.dtype)),
            aliases={0: 0},
        )
    return grad, None, None  # labels and class weights are not differentiated


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def _check_options(ignore_index, label_smoothing, reduction, z_loss, softcap) -> _Config:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"xent: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"xent: ignore_index must be an int, got {type(ignore_index).__name__}")
    values = {}
    for name, value in (
        ("label_smoothing", label_smoothing),
        ("z_loss", z_loss),
        ("softcap", softcap),
    ):
        try:
            values[name] = float(value)
        except (TypeError, jax.errors.ConcretizationTypeError):
            raise TypeError(
                f"xent: {name} must be a Python float (a static option), got {type(value).__name__}"
            ) from None
        if math.isnan(values[name]):
            raise ValueError(f"xent: {name} is NaN")
    if not 0.0 <= values["label_smoothing"] <= 1.0:
        raise ValueError(f"xent: label_smoothing must be in [0, 1], got {label_smoothing}")
    if values["z_loss"] < 0.0:
        raise ValueError(f"xent: z_loss must be >= 0, got {z_loss}")
    if values["softcap"] < 0.0:
        raise ValueError(f"xent: softcap must be >= 0 (0 is off), got {softcap}")
    return _Config(int(ignore_index), _REDUCTIONS[reduction], **values)


def _check_float(name, x):
    if x.dtype not in _LOGIT_DTYPES:
        raise TypeError(
            f"xent: {name} must be float32, bfloat16, float16 or float64, got {x.dtype}"
        )


def _check_labels(labels, shape, what):
    if labels.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"xent: labels must be int32 or int64 class ids, got {labels.dtype}")
    if labels.shape != shape:
        raise ValueError(f"xent: labels must have shape {what} = {shape}, got {labels.shape}")


def _class_weights(weight, classes):
    """The class weights as the handlers take them: (V,) float32, or (0,) for none."""
    if classes == 0:
        raise ValueError("xent: the class dimension is empty (V = 0)")
    if weight is None:
        return jnp.zeros((0,), jnp.float32)
    w = jnp.asarray(weight)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"xent: weight must be floating point, got {w.dtype}")
    if w.shape != (classes,):
        raise ValueError(f"xent: weight must have shape (V,) = ({classes},), got {w.shape}")
    return w.astype(jnp.float32)


def _results(loss, lse, shape, dtype, cfg, return_lse):
    """What the public calls return: the loss in the inputs' dtype (labels' shape for none) and,
    on request, the per-row LSE outside the gradient."""
    if cfg.reduction == 0:
        loss = loss.reshape(shape)
    loss = loss.astype(dtype)
    if not return_lse:
        return loss
    return loss, jax.lax.stop_gradient(lse).reshape(shape)


def cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    weight: jax.Array | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: float = 0.0,
    return_lse: bool = False,
):
    """Softmax cross-entropy of `logits` (..., V) against integer `labels` (...), fused.

    With reduction "none" this is optax.softmax_cross_entropy_with_integer_labels (per-row losses
    of shape labels.shape), with PyTorch's options on top:

    - weight: (V,) class weights w (float32; constants, not differentiated); a row's loss is
      w[y] times its NLL, and "mean" divides by the sum of w[y] over rows not ignored.
    - ignore_index: rows with this label have loss 0, gradient 0, and are left out of the mean.
    - label_smoothing eps in [0, 1]: (1 - eps) NLL + (eps / V) sum_c w_c (-log p_c).
    - z_loss: adds z_loss * lse**2 to every row not ignored. softcap: logits become
      softcap * tanh(logits / softcap) first (0 is off).
    - reduction: "mean" (every row ignored gives NaN), "sum" or "none".

    The loss has the logits' dtype (as optax's); return_lse=True also returns the per-row
    log-sum-exp of the (soft-capped) logits (float32, float64 for float64 logits; shape
    labels.shape; 0 on ignored rows, which are never read), outside the gradient.
    bfloat16, float16, float32 and (CPU) float64 logits. Neither softmax probabilities nor any
    other (..., V) array is materialised besides the gradient; see _cross_entropy_fwd for what
    the forward keeps for backward.
    """
    logits = jnp.asarray(logits)
    labels = jnp.asarray(labels)
    cfg = _check_options(ignore_index, label_smoothing, reduction, z_loss, softcap)
    _check_float("logits", logits)
    if logits.ndim < 1:
        raise ValueError("xent: logits must have a class dimension (..., V), got a scalar")
    _check_labels(labels, logits.shape[:-1], "logits.shape[:-1]")
    classes = logits.shape[-1]
    w = _class_weights(weight, classes)
    rows = math.prod(labels.shape)
    loss, lse = _cross_entropy(logits.reshape(rows, classes), labels.reshape(rows), w, cfg)
    return _results(loss, lse, labels.shape, logits.dtype, cfg, return_lse)


# --- fused linear cross-entropy ------------------------------------------------------------------


def _linear_forward(h, wt, b, y, w, cfg):
    acc = _accumulator(h.dtype)
    loss_shape = (h.shape[0],) if cfg.reduction == 0 else ()
    return _call(
        "xent_linear_cross_entropy_fwd",
        (jax.ShapeDtypeStruct(loss_shape, acc), jax.ShapeDtypeStruct((h.shape[0],), acc)),
        h,
        wt,
        b,
        y,
        w,
        cfg=cfg,
        method="sequential",
    )


def _linear_grads(h, wt, b):
    return (
        jax.ShapeDtypeStruct(h.shape, h.dtype),
        jax.ShapeDtypeStruct(wt.shape, h.dtype),
        jax.ShapeDtypeStruct(b.shape, h.dtype),
    )


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear_cross_entropy(h, wt, b, y, w, cfg):
    return _linear_forward(h, wt, b, y, w, cfg)


# As for _cross_entropy: with mean or sum the forward computes the three gradients in the same
# pass (each chunk's logits once; linear_backward would compute every chunk's logits again), and
# backward scales them; with none the forward saves the LSE and backward recomputes the logits.
def _linear_cross_entropy_fwd(h, wt, b, y, w, cfg):
    if cfg.reduction == 0:
        loss, lse = _linear_forward(h, wt, b, y, w, cfg)
        return (loss, lse), (h, wt, b, y, w, lse)
    acc = _accumulator(h.dtype)
    loss, lse, dh, dw, db = _call(
        "xent_linear_cross_entropy_fwd_bwd",
        (jax.ShapeDtypeStruct((), acc), jax.ShapeDtypeStruct((h.shape[0],), acc))
        + _linear_grads(h, wt, b),
        h,
        wt,
        b,
        y,
        w,
        cfg=cfg,
        method="sequential",
    )
    return (loss, lse), (dh, dw, db)


def _linear_cross_entropy_bwd(cfg, saved, cotangents):
    g = cotangents[0]
    if cfg.reduction == 0:
        h, wt, b, y, w, lse = saved
        dh, dw, db = _call(
            "xent_linear_cross_entropy_bwd",
            _linear_grads(h, wt, b),
            h,
            wt,
            b,
            y,
            w,
            lse,
            g.astype(lse.dtype),
            cfg=cfg,
            method="sequential",
        )
    else:
        # A pass over d_hidden (N x D) and d_weight (V x D), small beside the call's GEMMs.
        dh, dw, db = ((d.astype(g.dtype) * g).astype(d.dtype) if d.size else d for d in saved)
    return dh, dw, db, None, None


_linear_cross_entropy.defvjp(_linear_cross_entropy_fwd, _linear_cross_entropy_bwd)


def _linear_operands(hidden, weight, bias, labels, check_dtype, rows_name):
    """The fused linear calls' operands, checked: hidden (..., D) of a dtype check_dtype takes,
    weight (`rows_name`, D) and bias (`rows_name`,) or None (then (0,)) of hidden's dtype, labels
    hidden.shape[:-1]. Returns them as arrays."""
    hidden = jnp.asarray(hidden)
    weight = jnp.asarray(weight)
    labels = jnp.asarray(labels)
    check_dtype("hidden", hidden)
    if hidden.ndim < 1:
        raise ValueError("xent: hidden must be (..., D), got a scalar")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"xent: weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"xent: weight must be ({rows_name}, D) with D = {hidden.shape[-1]}, got {weight.shape}"
        )
    _check_labels(labels, hidden.shape[:-1], "hidden.shape[:-1]")
    if bias is None:
        return hidden, weight, jnp.zeros((0,), hidden.dtype), labels
    b = jnp.asarray(bias)
    if b.dtype != hidden.dtype:
        raise TypeError(f"xent: bias must have hidden's dtype {hidden.dtype}, got {b.dtype}")
    if b.shape != (weight.shape[0],):
        raise ValueError(
            f"xent: bias must have shape ({rows_name},) = ({weight.shape[0]},), got {b.shape}"
        )
    return hidden, weight, b, labels


def linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    bias: jax.Array | None = None,
    *,
    class_weight: jax.Array | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: float = 0.0,
    return_lse: bool = False,
):
    """cross_entropy(hidden @ weight.T + bias, labels, ...) without the (..., V) logits.

    hidden (..., D), weight (V, D) (an LM head's, as torch.nn.Linear holds it), bias (V,) or
    None, labels hidden.shape[:-1]; hidden, weight and bias of one dtype. The options are
    cross_entropy's (class_weight is its `weight`). Differentiable in hidden, weight and bias;
    the logits are computed a chunk of rows at a time in a workspace and never kept. Under
    jax.vmap the call runs once per batch element.
    """
    cfg = _check_options(ignore_index, label_smoothing, reduction, z_loss, softcap)
    hidden, weight, b, labels = _linear_operands(hidden, weight, bias, labels, _check_float, "V")
    w = _class_weights(class_weight, weight.shape[0])
    rows = math.prod(labels.shape)
    loss, lse = _linear_cross_entropy(
        hidden.reshape(rows, hidden.shape[-1]), weight, b, labels.reshape(rows), w, cfg
    )
    return _results(loss, lse, labels.shape, hidden.dtype, cfg, return_lse)
