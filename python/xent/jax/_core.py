"""What every xent.jax call shares: the static options, the argument checks and the FFI calls
of one device (ops.py differentiates them, _sharding.py partitions them over a mesh under jit,
vocab_parallel.py runs them on one shard inside shard_map).

The handlers (csrc/jax/ffi_ops.h) take logits as N x V rows; the public calls flatten the leading
dimensions, check every argument here before XLA sees it (TypeError / ValueError naming it), and
pass the options as FFI attributes. Under jax.vmap each ffi_call is batched with
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
from jax import lax

from .._choices import ACCUMULATIONS, ORDERS, choice_code, sparse_threshold
from . import _ffi

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # torch's enum order, as the handlers read it
_LOGIT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


class _Config(NamedTuple):
    """The static options of one call (hashable: a nondiff argument of the custom VJP)."""

    ignore_index: int
    reduction: int
    label_smoothing: float
    z_loss: float
    softcap: float
    inplace_backward: bool = True  # the fused pass's gradient over the logits' buffer (ops.py)
    order: int = 0  # the fused linear calls' training choices (_training_choices)
    accumulate: int = 0
    sparse_threshold: float = 0.0

    def training_attrs(self):
        """The fused linear calls' attributes beyond attrs()."""
        return {
            "order": np.int32(self.order),
            "accumulate": np.int32(self.accumulate),
            "sparse_threshold": np.float32(self.sparse_threshold),
        }

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


def _call(
    target,
    results,
    *args,
    cfg=None,
    attrs=None,
    aliases=None,
    method=None,
    workspace=None,
    invariant=frozenset(),
):
    """ffi_call of `target` with the options of `cfg` (and `attrs`) as attributes. workspace: the
    bytes of device workspace its CUDA handler takes as one more result (_ffi.workspace_bytes),
    allocated by XLA with the call's other buffers and dropped here; None for none. invariant:
    mesh axes along which the results are the same on every device whatever the operands (the
    vocab-parallel merge's)."""
    # A call writing over an input (aliases) needs that input of the result's shape under vmap:
    # broadcast_all copies an unbatched one to the batch, which is the result's memory anyway.
    if method is None:
        method = "broadcast_all" if aliases else "expand_dims"
    static = {
        "target": target,
        "results": results,
        "attrs": tuple({**(cfg.attrs() if cfg is not None else {}), **(attrs or {})}.items()),
        "aliases": tuple((aliases or {}).items()),
        "method": method,
        "workspace": workspace,
    }
    # Empty operands are made inside only under shard_map (whose manual axes are in the abstract
    # mesh, eager or jitted), and only where another operand is left: elsewhere an operand's
    # device decides where an eager call runs.
    made = [a.size == 0 for a in args]
    if all(made) or not getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
        made = [False] * len(args)
    static["empty"] = tuple((i, a.shape, a.dtype) for i, a in enumerate(args) if made[i])
    out = _staged(*(a for a, m in zip(args, made) if not m), **static)
    return _varying_as(out, _varying_axes(*args) - invariant)


# --- types under shard_map ------------------------------------------------------------------------
# Inside jax.shard_map jax types each value with the mesh axes along which it differs between
# devices; an ffi_call's results come out typed as the same on every device whatever its operands.
# So each result is typed as varying along every axis an operand varies along, and a custom VJP's
# backward returns each cotangent typed as its primal (_cotangent_as). Outside shard_map no value
# varies and these change nothing.


def _varying_axes(*xs) -> frozenset:
    """The mesh axes along which jax types any of xs as varying (jax.typeof(x).mat.varying, or
    .vma where the type has no .mat)."""
    axes = frozenset()
    for x in xs:
        t = jax.typeof(x)
        mat = getattr(t, "mat", None)
        axes |= frozenset(getattr(mat, "varying", None) or getattr(t, "vma", None) or ())
    return axes


def _varying_as(out, axes):
    """out (an array or a tuple of them) typed as varying along `axes` too."""
    if not axes:
        return out

    def cast(r):
        missing = tuple(sorted(axes - _varying_axes(r)))
        return lax.pcast(r, missing, to="varying") if missing else r

    return tuple(map(cast, out)) if isinstance(out, (tuple, list)) else cast(out)


def _type_of(x):
    """A custom_vjp residual carrying the axes x varies along: a scalar typed so, None where x
    varies along none."""
    axes = _varying_axes(x)
    return _varying_as(jnp.zeros((), jnp.int8), axes) if axes else None


def _cotangent_as(ct, primal_type):
    """ct typed as the primal whose _type_of is primal_type: summed over the axes along which ct
    varies and the primal does not (the devices along them share the primal and each used it),
    cast to varying along those the primal varies along and ct does not."""
    want = _varying_axes(primal_type) if primal_type is not None else frozenset()
    extra = tuple(sorted(_varying_axes(ct) - want))
    if extra:
        ct = lax.psum(ct, extra)
    return _varying_as(ct, want)


def _ffi_call(*operands, target, results, attrs, aliases, method, workspace=None):
    """The ffi_call itself, its dict arguments as the hashable pairs _call makes of them; with a
    workspace, one more uint8 result of that many bytes, dropped."""
    shapes = results
    if workspace is not None:
        shapes = (*_tuple(results), jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    out = jax.ffi.ffi_call(
        target, shapes, vmap_method=method, input_output_aliases=dict(aliases) or None
    )(*operands, **dict(attrs))
    if workspace is None:
        return out
    return tuple(out[:-1]) if isinstance(results, (tuple, list)) else out[0]


# Every call is staged in a jit of its own, which a caller's jit inlines, for two reasons:
# - The workspace result exists on CUDA only: lax.platform_dependent makes the choice when
#   lowering, for the platform lowered for. Called outside any trace (an eager call, or the eager
#   vmap that _sharding's batching rule runs) it would choose at once, for the default backend
#   whatever device holds the operands, and hand a CPU handler on a GPU machine one result too
#   many: staged, it is lowered for the operands' device.
# - Under shard_map, absent operands (no class weights, no bias: empty arrays) are made inside
#   (`empty`: their positions, shapes and dtypes): an eager jax.shard_map wraps each call in a
#   manual computation of its operands, and jaxlib 0.11.2's Shardy canonicaliser crashed the
#   process on an empty one.
@partial(
    jax.jit,
    static_argnames=("target", "results", "attrs", "aliases", "method", "workspace", "empty"),
)
def _staged(*operands, target, results, attrs, aliases, method, workspace, empty):
    operands = list(operands)
    for i, shape, dtype in empty:
        operands.insert(i, jnp.zeros(shape, dtype))
    call = partial(
        _ffi_call, target=target, results=results, attrs=attrs, aliases=aliases, method=method
    )
    if workspace is None:
        return call(*operands)
    return lax.platform_dependent(*operands, cuda=partial(call, workspace=workspace), default=call)


def _tuple(results):
    return tuple(results) if isinstance(results, (tuple, list)) else (results,)


# --- the FFI calls of one device ------------------------------------------------------------------


def _forward(x, y, w, cfg):
    """Loss (() for mean and sum, (N,) for none) and the per-row LSE."""
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
        workspace=_ffi.workspace_bytes("cross_entropy", x.dtype, n, reduced=cfg.reduction != 0),
    )


def _fused(x, y, w, cfg):
    """Loss, LSE and d loss / d logits for an upstream gradient of 1 (mean and sum), in one pass;
    with cfg.inplace_backward the gradient is written over the logits' buffer (XLA copies first
    only where they are still needed), otherwise into a buffer of its own."""
    acc = _accumulator(x.dtype)
    return _call(
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
        aliases={0: 2} if cfg.inplace_backward else None,
        workspace=_ffi.workspace_bytes("cross_entropy", x.dtype, x.shape[0]),
    )


def _backward(x, y, w, lse, g, cfg):
    """d loss / d logits times the upstream gradient g, from the LSE a forward saved."""
    return _call(
        "xent_cross_entropy_bwd",
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        x,
        y,
        w,
        lse,
        g.astype(lse.dtype),
        cfg=cfg,
    )


def _scale(grad, g):
    """grad times the scalar g, in place."""
    return _call(
        "xent_scale_grad",
        jax.ShapeDtypeStruct(grad.shape, grad.dtype),
        grad,
        g.astype(_accumulator(grad.dtype)),
        aliases={0: 0},
    )


def _keep(x):
    """x as a custom_vjp residual: None for an empty vector (absent class weights or bias), which
    would cross a shard_map from forward to backward as an empty operand, and XLA's SPMD
    partitioner crashed on one (jaxlib 0.11.2); _kept rebuilds it."""
    return None if x.shape == (0,) else x


def _kept(x, dtype):
    return jnp.zeros((0,), dtype) if x is None else x


def _fuses(cfg: _Config, dtype) -> bool:
    """Whether a call forms its gradients in its forward, for an upstream gradient of 1 (mean
    and sum), and scales them in backward. Not float16: a gradient formed at upstream 1 and
    rounded to it loses its small entries (p / N is below float16's normal range), which a loss
    scale applied afterwards cannot bring back. Such a call saves the LSE and forms the gradient
    in backward from each row's upstream (_row_upstreams), as reduction none does, at the cost of
    one more pass over the logits; torch's float16 path does the same."""
    return cfg.reduction != 0 and dtype != jnp.float16


def _mean_normaliser(cfg: _Config, y, w, classes: int):
    """The mean's normaliser W = sum of w[y] over rows not ignored (1 a row without class
    weights), float32; a class id outside [0, classes) counts 0, as in the handlers."""
    keep = (y != cfg.ignore_index) & (y >= 0) & (y < classes)
    row = w[jnp.clip(y, 0, classes - 1)] if w.shape[0] else jnp.ones(y.shape, jnp.float32)
    return jnp.where(keep, row, 0.0).sum()


def _row_upstreams(cfg: _Config, y, w, g, classes: int):
    """The upstream gradient of every row of a mean or sum whose loss has gradient g (float32,
    (N,)): g, over the mean's W. W = 0 gives NaN, as the handlers' mean does (its rows that are
    ignored still get gradient 0)."""
    g = g.astype(jnp.float32)
    if cfg.reduction == 1:
        total = _mean_normaliser(cfg, y, w, classes)
        g = jnp.where(total == 0, jnp.nan, g / total)
    return jnp.broadcast_to(g, y.shape)


def _scaled_linear_grads(saved, g):
    """A fused linear call's saved (d_hidden, d_weight, d_bias or None) times the loss's gradient
    g: a pass over d_hidden (N x D) and d_weight (V x D), small beside the call's GEMMs; each
    product in g's dtype, rounded once to its gradient's."""
    dh, dw, db = saved
    grads = (dh, dw, _kept(db, dh.dtype))
    return tuple((d.astype(g.dtype) * g).astype(d.dtype) if d.size else d for d in grads)


# --- argument checks ------------------------------------------------------------------------------


def _check_options(
    ignore_index, label_smoothing, reduction, z_loss, softcap, inplace_backward=True
) -> _Config:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"xent: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(inplace_backward, bool):
        raise TypeError(
            f"xent: inplace_backward must be a bool, got {type(inplace_backward).__name__}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"xent: ignore_index must be an int, got {type(ignore_index).__name__}")
    if not _INT64.min <= ignore_index <= _INT64.max:
        raise ValueError(f"xent: ignore_index must fit in int64, got {ignore_index}")
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
        with np.errstate(over="ignore"):  # the handlers take float32 values
            if not math.isfinite(np.float32(values[name])):
                raise ValueError(f"xent: {name} must be finite as a float32, got {value}")
    if not 0.0 <= values["label_smoothing"] <= 1.0:
        raise ValueError(f"xent: label_smoothing must be in [0, 1], got {label_smoothing}")
    if values["z_loss"] < 0.0:
        raise ValueError(f"xent: z_loss must be >= 0, got {z_loss}")
    if values["softcap"] < 0.0:
        raise ValueError(f"xent: softcap must be >= 0 (0 is off), got {softcap}")
    # A cap that float32 holds as 0 would turn softcap off without a word; the kernels divide by it.
    with np.errstate(divide="ignore", over="ignore"):
        if values["softcap"] > 0.0 and not np.isfinite(
            np.float32(1.0) / np.float32(values["softcap"])
        ):
            raise ValueError(
                f"xent: softcap must be 0 (off) or at least 2.9e-39 (1 / softcap finite as a "
                f"float32), got {softcap}"
            )
    return _Config(
        int(ignore_index), _REDUCTIONS[reduction], **values, inplace_backward=inplace_backward
    )


def _check_float(name, x):
    if x.dtype not in _LOGIT_DTYPES:
        raise TypeError(
            f"xent: {name} must be float32, bfloat16, float16 or float64, got {x.dtype}"
        )


_INT64 = np.iinfo(np.int64)


def _check_ignore_index(cfg, labels):
    """An ignore_index that the labels' dtype holds: no label could equal another, and the
    sharded and vocab-parallel calls compare and pad labels with it in the labels' dtype."""
    info = np.iinfo(labels.dtype)
    if not info.min <= cfg.ignore_index <= info.max:
        raise ValueError(
            f"xent: ignore_index {cfg.ignore_index} is outside the range of the labels' dtype "
            f"{labels.dtype}, so no label can equal it: pass one within it (e.g. -100)"
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
        attrs=cfg.training_attrs(),
        method="sequential",
        workspace=_linear_workspace("linear_forward", h, wt, cfg),
    )


def _linear_workspace(kind, h, wt, cfg):
    choices = (cfg.order, cfg.accumulate, cfg.sparse_threshold)
    return _ffi.workspace_bytes(kind, h.dtype, *h.shape, wt.shape[0], choices=choices)


def _training_choices(cfg: _Config, order, accumulate, threshold) -> _Config:
    """cfg with a fused linear call's training choices, or ValueError naming the argument."""
    codes = {
        "order": choice_code("order", order, ORDERS),
        "accumulate": choice_code("accumulate", accumulate, ACCUMULATIONS),
    }
    tau = sparse_threshold(threshold)
    if tau > 0.0 and order == "fast":
        raise ValueError(
            "xent: sparse_threshold runs in the low-memory order, which order='fast' excludes"
        )
    return cfg._replace(sparse_threshold=tau, **codes)


def _linear_grads(h, wt, b):
    return (
        jax.ShapeDtypeStruct(h.shape, h.dtype),
        jax.ShapeDtypeStruct(wt.shape, h.dtype),
        jax.ShapeDtypeStruct(b.shape, h.dtype),
    )


def _linear_fused(h, wt, b, y, w, cfg):
    """Loss, LSE and the gradients of hidden, weight and bias for an upstream gradient of 1 (mean
    and sum), each chunk's logits computed once."""
    acc = _accumulator(h.dtype)
    return _call(
        "xent_linear_cross_entropy_fwd_bwd",
        (jax.ShapeDtypeStruct((), acc), jax.ShapeDtypeStruct((h.shape[0],), acc))
        + _linear_grads(h, wt, b),
        h,
        wt,
        b,
        y,
        w,
        cfg=cfg,
        attrs=cfg.training_attrs(),
        method="sequential",
        workspace=_linear_workspace("linear_training", h, wt, cfg),
    )


def _linear_backward(h, wt, b, y, w, lse, g, cfg):
    """The gradients of hidden, weight and bias times g, from the LSE; each chunk's logits are
    computed again."""
    return _call(
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
        attrs=cfg.training_attrs(),
        method="sequential",
        workspace=_linear_workspace("linear_training", h, wt, cfg),
    )


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
