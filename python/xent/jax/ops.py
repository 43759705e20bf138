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


def _call(target, results, *args, cfg=None, aliases=None):
    # A call writing over an input (aliases) needs that input of the result's shape under vmap:
    # broadcast_all copies an unbatched one to the batch, which is the result's memory anyway.
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
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(
            f"xent: logits must be float32, bfloat16, float16 or float64, got {logits.dtype}"
        )
    if logits.ndim < 1:
        raise ValueError("xent: logits must have a class dimension (..., V), got a scalar")
    if labels.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"xent: labels must be int32 or int64 class ids, got {labels.dtype}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"xent: labels must have shape logits.shape[:-1] = {logits.shape[:-1]}, "
            f"got {labels.shape}"
        )
    classes = logits.shape[-1]
    if classes == 0:
        raise ValueError("xent: logits has an empty class dimension (V = 0)")
    if weight is None:
        w = jnp.zeros((0,), jnp.float32)
    else:
        w = jnp.asarray(weight)
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise TypeError(f"xent: weight must be floating point, got {w.dtype}")
        if w.shape != (classes,):
            raise ValueError(f"xent: weight must have shape (V,) = ({classes},), got {w.shape}")
        w = w.astype(jnp.float32)
    lead = labels.shape
    rows = math.prod(lead)
    loss, lse = _cross_entropy(logits.reshape(rows, classes), labels.reshape(rows), w, cfg)
    if cfg.reduction == 0:
        loss = loss.reshape(lead)
    loss = loss.astype(logits.dtype)
    if not return_lse:
        return loss
    return loss, jax.lax.stop_gradient(lse).reshape(lead)
