"""Cross-entropy over xent's FFI handlers, with a custom VJP.

The FFI calls and the argument checks are _core.py's; each call that the forward and backward
below make goes through _sharding.py, which under jax.jit partitions it over the mesh of sharded
operands (rows, vocabulary) instead of letting XLA gather them.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from . import _sharding
from ._core import (
    _check_float,
    _check_ignore_index,
    _check_labels,
    _check_options,
    _class_weights,
    _cotangent_as,
    _fuses,
    _keep,
    _kept,
    _type_of,
    _linear_operands,
    _results,
    _row_upstreams,
    _scaled_linear_grads,
    _training_choices,
)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(x, y, w, cfg):
    return _sharding.forward(x, y, w, cfg)


# What the forward saves. With mean or sum the loss's gradient is a scalar, so the forward runs
# xent's fused pass (forward_backward): it reads the logits once and writes d loss / d logits for
# an upstream gradient of 1, over the logits' own buffer unless inplace_backward is False (XLA
# copies first only where the logits are still needed), and backward scales it in place, doing
# nothing when the scale is 1 (jax.grad of the loss itself). Saving the LSE instead would read the
# logits a second time in backward and keep them alive until then. With reduction none each row's
# upstream gradient exists only in backward: the forward saves the LSE and backward reads the
# logits again; so does float16 (_fuses), each row's upstream taken from the loss's gradient.
def _cross_entropy_fwd(x, y, w, cfg):
    if not _fuses(cfg, x.dtype):
        loss, lse = _sharding.forward(x, y, w, cfg)
        return (loss, lse), (_type_of(x), x, y, _keep(w), lse)
    loss, lse, grad = _sharding.fused(x, y, w, cfg)
    return (loss, lse), (_type_of(x), grad)


def _cross_entropy_bwd(cfg, saved, cotangents):
    g = cotangents[0]  # the LSE leaves the custom VJP through stop_gradient: its cotangent is 0
    x_type, *saved = saved
    if not _fuses(cfg, saved[0].dtype):
        x, y, w, lse = saved
        w = _kept(w, jnp.float32)
        g = _row_upstreams(cfg, y, w, g, x.shape[1])
        grad = _sharding.backward(x, y, w, lse, g, cfg._replace(reduction=0))
    else:
        (grad,) = saved
        grad = _sharding.scale(grad, g)
    # Labels and class weights are not differentiated.
    return _cotangent_as(grad, x_type), None, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


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
    inplace_backward: bool = True,
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

    inplace_backward (mean and sum, differentiated): True writes the gradient over the logits'
    buffer, so a step whose logits die in the call needs no second (..., V) buffer; where they
    are still needed after it, XLA copies them first (one more pass over them). False gives the
    gradient a buffer of its own: no copy for logits that stay alive, one more (..., V) buffer
    for logits that die. Values are the same either way.
    """
    logits = jnp.asarray(logits)
    labels = jnp.asarray(labels)
    cfg = _check_options(
        ignore_index, label_smoothing, reduction, z_loss, softcap, inplace_backward
    )
    _check_float("logits", logits)
    if logits.ndim < 1:
        raise ValueError("xent: logits must have a class dimension (..., V), got a scalar")
    _check_labels(labels, logits.shape[:-1], "logits.shape[:-1]")
    _check_ignore_index(cfg, labels)
    classes = logits.shape[-1]
    w = _class_weights(weight, classes)
    rows = math.prod(labels.shape)
    loss, lse = _cross_entropy(logits.reshape(rows, classes), labels.reshape(rows), w, cfg)
    return _results(loss, lse, labels.shape, logits.dtype, cfg, return_lse)


# --- fused linear cross-entropy ------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear_cross_entropy(h, wt, b, y, w, cfg):
    return _sharding.linear_forward(h, wt, b, y, w, cfg)


# As for _cross_entropy: with mean or sum the forward computes the three gradients in the same
# pass (each chunk's logits once; linear_backward would compute every chunk's logits again), and
# backward scales them; with none (and float16) the forward saves the LSE and backward recomputes
# the logits.
def _linear_cross_entropy_fwd(h, wt, b, y, w, cfg):
    types = (_type_of(h), _type_of(wt), _type_of(b))
    if not _fuses(cfg, h.dtype):
        loss, lse = _sharding.linear_forward(h, wt, b, y, w, cfg)
        return (loss, lse), (types, (h, wt, _keep(b), y, _keep(w), lse))
    loss, lse, dh, dw, db = _sharding.linear_fused(h, wt, b, y, w, cfg)
    return (loss, lse), (types, (dh, dw, _keep(db)))


def _linear_cross_entropy_bwd(cfg, saved, cotangents):
    g = cotangents[0]
    types, saved = saved
    if not _fuses(cfg, saved[0].dtype):
        h, wt, b, y, w, lse = saved
        b, w = _kept(b, h.dtype), _kept(w, jnp.float32)
        g = _row_upstreams(cfg, y, w, g, wt.shape[0])
        dh, dw, db = _sharding.linear_backward(h, wt, b, y, w, lse, g, cfg._replace(reduction=0))
    else:
        dh, dw, db = _scaled_linear_grads(saved, g)
    return (*(_cotangent_as(d, t) for d, t in zip((dh, dw, db), types)), None, None)


_linear_cross_entropy.defvjp(_linear_cross_entropy_fwd, _linear_cross_entropy_bwd)


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
    order: str = "automatic",
    accumulate: str = "fp32",
    sparse_threshold: float = 0.0,
):
    """cross_entropy(hidden @ weight.T + bias, labels, ...) without the (..., V) logits.

    hidden (..., D), weight (V, D) (an LM head's, as torch.nn.Linear holds it), bias (V,) or
    None, labels hidden.shape[:-1]; hidden, weight and bias of one dtype. The options are
    cross_entropy's (class_weight is its `weight`). Differentiable in hidden, weight and bias;
    the logits are computed a chunk of rows at a time in a workspace and never kept. Under
    jax.vmap the call runs once per batch element.

    The gradients' memory (the training call's workspace, which XLA allocates with the call):
      order="automatic"  (default) the fast order: rows outer, three GEMMs; with 16-bit weights
                         and accumulate="fp32" a V x D float sum of d_weight (4 V D bytes).
      order="low_memory" the vocabulary outer, in panels: four GEMMs with reduction mean or sum
                         (three with none), exact as the fast order, no V x D buffer; at most
                         256 MiB of logit tiles, a panel's buffers and, for 16-bit d_hidden, its
                         N x D float sum.
      order="fast"       the fast order by name.
      accumulate="output"  the fast order adds each chunk's float sum into d_weight and rounds
                         it, once per chunk: no V x D float buffer, at up to half an ulp of
                         d_weight's dtype per chunk. "fp32" (default) sums in float and rounds once.
    sparse_threshold (default 0.0: exact) is the low-memory order's sparse backward (Cut
    Cross-Entropy's gradient filtering): the gradient GEMMs skip each tile of rows x classes whose
    probabilities are all below it and that holds no label. The loss is unchanged; each gradient
    moves by at most the skipped probabilities' terms (docs/numerics.md); 2**-12 is a threshold
    to start from for bfloat16. A threshold runs the low-memory order (order="fast" raises); on
    a GPU it takes bfloat16 / float16, no label_smoothing or softcap and D a multiple of 8 (the
    handler's error names sparse_threshold otherwise). A weight split over devices along
    the vocabulary (under jit) runs the vocab-parallel scan, which takes none of these three.
    A value outside these raises ValueError naming the argument.
    """
    cfg = _check_options(ignore_index, label_smoothing, reduction, z_loss, softcap)
    cfg = _training_choices(cfg, order, accumulate, sparse_threshold)
    hidden, weight, b, labels = _linear_operands(hidden, weight, bias, labels, _check_float, "V")
    _check_ignore_index(cfg, labels)
    w = _class_weights(class_weight, weight.shape[0])
    rows = math.prod(labels.shape)
    loss, lse = _linear_cross_entropy(
        hidden.reshape(rows, hidden.shape[-1]), weight, b, labels.reshape(rows), w, cfg
    )
    return _results(loss, lse, labels.shape, hidden.dtype, cfg, return_lse)
