"""xent's FFI calls under jax.jit on operands sharded over a mesh, partitioned by XLA without
gathering the logits (or the LM head's weight) first.

XLA takes a custom call it knows nothing of as one that needs every operand whole, so a jitted
cross_entropy of logits with a NamedSharding on the vocabulary would all-gather them first. Here
each FFI call that ops.py's forward and backward make is a jax.experimental.custom_partitioning
whose partition runs, on every device, the call of its shard:

- rows (the logits' or hidden's leading dimension) split over mesh axes: each device runs its
  rows; a reduced loss is summed over those axes (psum), and so is the mean's normaliser, so a
  mean is over every device's rows (its gradient is the local sum's, scaled by the global
  normaliser); the weight's and bias's gradients are summed over them too.
- the vocabulary (the logits' last dimension, the weight's and bias's rows) split over mesh axes:
  each device runs vocab_parallel.py's phases on its shard (records, one all_gather of a few
  floats per row, merge), as a caller's shard_map would; a shard past the vocabulary's end (V not
  a multiple of the devices: XLA pads the last shards) has columns that are no classes.

Either may come alone, and the rows only where they divide evenly (XLA's padding rows would hold
labels); any other sharding (hidden's D) is gathered by XLA first. float64 calls are not
partitioned: the vocab-parallel handlers do not take float64, and XLA runs the partition
callbacks on its own threads, where a jax.enable_x64 context of the caller's is not set.
Propagation: the calls' Shardy sharding rules (jax's default partitioner), or
infer_sharding_from_operands under GSPMD.

custom_partitioning has no batching rule: under jax.vmap a custom_vmap runs the unpartitioned
call, batched by its handler as ops.py describes, on operands XLA gathers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._core import (
    _backward,
    _Config,
    _forward,
    _fused,
    _linear_backward,
    _linear_forward,
    _linear_fused,
    _mean_normaliser,
    _scale,
)
from .vocab_parallel import (
    _CHUNK_BYTES,
    _Linear,
    _linear_pass,
    _local_grad,
    _merged,
    _rotate,
    _Shard,
)

# A call's operands and results as strings of dimension letters: n the rows, v the vocabulary,
# any other letter a dimension that stays whole (d: hidden's width, the weight's too; c: class
# weights, whose V the merge reads whole on every device; b: an absent bias, (0,)). "" is a
# scalar.
_SPLIT = "nv"
_SHARED = "nvd"


class _Layout(NamedTuple):
    """How a call is split: the mesh axes its rows and its vocabulary are split over."""

    mesh: jax.sharding.Mesh
    rows: tuple = ()
    vocab: tuple = ()

    def _entry(self, letter):
        axes = {"n": self.rows, "v": self.vocab}.get(letter, ())
        return None if not axes else axes[0] if len(axes) == 1 else axes

    def sharding(self, dims: str) -> NamedSharding:
        return NamedSharding(self.mesh, P(*(self._entry(d) for d in dims)))

    def devices(self, axes) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def shard(self, width: int, vocab: int) -> _Shard:
        """The vocab-parallel shard of a device holding `width` of the `vocab` classes."""
        name = self.vocab[0] if len(self.vocab) == 1 else self.vocab
        return _Shard(name, self.devices(self.vocab), width, vocab)

    def psum_rows(self, x):
        return lax.psum(x, self.rows) if self.rows else x


def _axes(spec, dim: int) -> tuple:
    entry = tuple(spec)[dim] if dim < len(spec) else None
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _layout(mesh, arg_shapes, rows_at, vocab_at) -> _Layout:
    """The layout of a call whose rows are dimension rows_at = (operand, dim) and vocabulary
    vocab_at, from the shardings XLA proposes for those operands."""
    rows_arg, vocab_arg = arg_shapes[rows_at[0]], arg_shapes[vocab_at[0]]
    if not isinstance(rows_arg.sharding, NamedSharding) or mesh.empty:
        return _Layout(mesh)
    vocab = _axes(vocab_arg.sharding.spec, vocab_at[1])
    rows = tuple(a for a in _axes(rows_arg.sharding.spec, rows_at[1]) if a not in vocab)
    layout = _Layout(mesh, rows, vocab)
    if rows and rows_arg.shape[rows_at[1]] % layout.devices(rows):
        layout = layout._replace(rows=())
    return layout


def _partitioned(
    plain: Callable,
    local: Callable,
    arg_dims: Sequence[str],
    result_dims: Sequence[str],
    rows_at=(0, 0),
    vocab_at=(0, 1),
    float64: bool = False,
):
    """plain(*args) -> tuple of results, as XLA partitions it: local(layout, *shards) on every
    device, the operands and results split as arg_dims and result_dims say for the layout that
    the sharding of rows_at's and vocab_at's operands gives. plain itself for float64."""
    if float64:
        return plain

    def partition(mesh, arg_shapes, result_shape):
        layout = _layout(mesh, arg_shapes, rows_at, vocab_at)
        results = tuple(layout.sharding(d) for d in result_dims)
        args = tuple(layout.sharding(d) for d in arg_dims)
        if not layout.rows and not layout.vocab:
            return mesh, plain, results, args
        return mesh, lambda *a: local(layout, *a), results, args

    def infer(mesh, arg_shapes, result_shape):
        layout = _layout(mesh, arg_shapes, rows_at, vocab_at)
        return tuple(layout.sharding(d) for d in result_dims)

    # Shardy's rule: n, v and d are factors the operands share; every other letter is a factor
    # of its own operand (class weights and an absent bias differ in size from anything else).
    fresh = (f"k{i}" for i in itertools.count())
    names = [" ".join(c if c in _SHARED else next(fresh) for c in d) for d in arg_dims]
    outs = [" ".join(c if c in _SHARED else next(fresh) for c in d) for d in result_dims]
    rule = ", ".join(names) + " -> " + ", ".join(outs)
    reduced = tuple(
        f for f in _SPLIT if any(f in d for d in arg_dims) and not any(f in d for d in result_dims)
    )

    op = custom_partitioning(plain)
    op.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
        reduction_factors=reduced,
    )

    batched = custom_vmap(op)

    @batched.def_vmap
    def _(axis_size, in_batched, *args):
        out = jax.vmap(plain, in_axes=tuple(0 if b else None for b in in_batched))(*args)
        return out, tuple(True for _ in out)

    return batched


def _failing_together(layout: _Layout, cfg: _Config, y, vocab: int):
    """The labels of a call whose rows are split over devices, on the CPU: where any device holds
    a class id outside [0, V) that is not ignore_index, every device's first label becomes one, so
    that every handler raises. Otherwise only the handlers meeting one raise, and the others wait
    for them in a row sum until XLA ends the process. CUDA handlers raise nothing (such a row's
    loss is NaN), so their labels pass unchanged."""
    if not layout.rows or not y.shape[0] or layout.mesh.devices.flat[0].platform != "cpu":
        return y
    bad = (y != cfg.ignore_index) & ((y < 0) | (y >= vocab))
    anywhere = layout.psum_rows(bad.sum(dtype=jnp.int32))
    poison = jnp.asarray(vocab if cfg.ignore_index != vocab else vocab + 1, y.dtype)
    return y.at[0].set(jnp.where(anywhere > 0, poison, y[0]))


def _loss_dims(cfg: _Config) -> str:
    return "n" if cfg.reduction == 0 else ""


def _local_config(layout: _Layout, cfg: _Config) -> _Config:
    """The options a device's call takes: a mean over rows split across devices is each device's
    sum, divided by the global normaliser afterwards."""
    return cfg._replace(reduction=2) if layout.rows and cfg.reduction == 1 else cfg


def _normaliser(layout: _Layout, cfg: _Config, y, w, classes: int):
    """The mean's normaliser over every device's rows."""
    return layout.psum_rows(_mean_normaliser(cfg, y, w, classes))


def _total(layout: _Layout, cfg: _Config, local_loss, y, w, classes: int):
    """The reduced loss from each device's (local_config) loss: summed over the row axes, and for
    a mean whose rows are split, divided by the global normaliser."""
    if cfg.reduction == 0 or not layout.rows:
        return local_loss
    total = layout.psum_rows(local_loss)
    return total / _normaliser(layout, cfg, y, w, classes) if cfg.reduction == 1 else total


# --- cross-entropy -------------------------------------------------------------------------------


def forward(x, y, w, cfg: _Config):
    """_core._forward partitioned: loss and LSE."""

    def local(layout, x, y, w):
        y = _failing_together(layout, cfg, y, vocab)
        lc = _local_config(layout, cfg)
        if layout.vocab:
            loss, lse, _, _ = _merged(layout.shard(x.shape[1], vocab), lc, x, y, w)
        else:
            loss, lse = _forward(x, y, w, lc)
        return _total(layout, cfg, loss, y, w, vocab), lse

    vocab = x.shape[1]
    return _partitioned(
        lambda x, y, w: tuple(_forward(x, y, w, cfg)),
        local,
        ("nv", "n", "c"),
        (_loss_dims(cfg), "n"),
        float64=x.dtype == jnp.float64,
    )(x, y, w)


def fused(x, y, w, cfg: _Config):
    """_core._fused partitioned: loss, LSE and the gradient for an upstream gradient of 1."""

    def local(layout, x, y, w):
        y = _failing_together(layout, cfg, y, vocab)
        lc = _local_config(layout, cfg)
        scale = (
            1.0 / _normaliser(layout, cfg, y, w, vocab) if lc.reduction != cfg.reduction else None
        )
        if layout.vocab:
            shard = layout.shard(x.shape[1], vocab)
            loss, lse, yr, wr = _merged(shard, lc, x, y, w)
            g = jnp.ones((), jnp.float32) if scale is None else scale
            grad = _local_grad(shard, lc, x, yr, wr, lse, g, in_place=cfg.inplace_backward)
        else:
            loss, lse, grad = _fused(x, y, w, lc)
            grad = grad if scale is None else _scale(grad, scale)
        loss = layout.psum_rows(loss)
        return (loss if scale is None else loss * scale.astype(loss.dtype)), lse, grad

    vocab = x.shape[1]
    return _partitioned(
        lambda x, y, w: tuple(_fused(x, y, w, cfg)),
        local,
        ("nv", "n", "c"),
        ("", "n", "nv"),
        float64=x.dtype == jnp.float64,
    )(x, y, w)


def backward(x, y, w, lse, g, cfg: _Config):
    """_core._backward partitioned (reduction none: g per row): no collective."""

    def local(layout, x, y, w, lse, g):
        if not layout.vocab:
            return (_backward(x, y, w, lse, g, cfg),)
        shard = layout.shard(x.shape[1], vocab)
        yr, wr = _rotate(shard, cfg, y, w)
        return (_local_grad(shard, cfg, x, yr, wr, lse, g.astype(jnp.float32)),)

    vocab = x.shape[1]
    (grad,) = _partitioned(
        lambda *a: (_backward(*a, cfg),),
        local,
        ("nv", "n", "c", "n", "n"),
        ("nv",),
        float64=x.dtype == jnp.float64,
    )(x, y, w, lse, g)
    return grad


def scale(grad, g):
    """_core._scale partitioned: elementwise, any split of either dimension."""
    (out,) = _partitioned(
        lambda grad, g: (_scale(grad, g),),
        lambda layout, grad, g: (_scale(grad, g),),
        ("nv", ""),
        ("nv",),
        float64=grad.dtype == jnp.float64,
    )(grad, g)
    return out


# --- fused linear cross-entropy ------------------------------------------------------------------
#
# hidden (N, D) split by rows, weight (V, D) and bias (V,) by vocabulary; D stays whole.


_BIAS = "bias"  # a result of the bias's dims: "v", or "b" for an absent bias


def _linear_partitioned(plain, local, results, *operands):
    """_partitioned for a fused linear call of operands (h, wt, b, y, w, ...): those five split as
    the section says, any after them per row; results: the results' dims (_BIAS: the bias's)."""
    h, _, b = operands[:3]
    bias = "v" if b.shape[0] else "b"
    args = ("nd", "vd", bias, "n", "c") + ("n",) * (len(operands) - 5)
    return _partitioned(
        lambda *a: tuple(plain(*a)),
        local,
        args,
        tuple(bias if d == _BIAS else d for d in results),
        rows_at=(0, 0),
        vocab_at=(1, 0),
        float64=h.dtype == jnp.float64,
    )(*operands)


def _linear_shard(layout: _Layout, wt, vocab: int, rows: int) -> _Linear:
    shard = layout.shard(wt.shape[0], vocab)
    chunk = max(1, _CHUNK_BYTES // (4 * max(1, shard.width)))
    return _Linear(shard, int(min(chunk, max(rows, 1))))


def _sum_rows(layout: _Layout, d):
    """A gradient summed over the row axes (in float32, rounded once)."""
    if not layout.rows or not d.size:
        return d
    return layout.psum_rows(d.astype(jnp.float32)).astype(d.dtype)


def linear_forward(h, wt, b, y, w, cfg: _Config):
    """_core._linear_forward partitioned: loss and LSE."""

    def local(layout, h, wt, b, y, w):
        y = _failing_together(layout, cfg, y, vocab)
        if layout.vocab:
            lin = _linear_shard(layout, wt, vocab, h.shape[0])
            row_loss, lse, _ = _linear_pass(lin, cfg, h, wt, b, y, w)
            if cfg.reduction == 0:
                return row_loss, lse
            total = layout.psum_rows(row_loss.sum())
            return (
                total / _normaliser(layout, cfg, y, w, vocab) if cfg.reduction == 1 else total
            ), lse
        loss, lse = _linear_forward(h, wt, b, y, w, _local_config(layout, cfg))
        return _total(layout, cfg, loss, y, w, vocab), lse

    vocab = wt.shape[0]
    results = (_loss_dims(cfg), "n")
    return _linear_partitioned(partial(_linear_forward, cfg=cfg), local, results, h, wt, b, y, w)


def linear_fused(h, wt, b, y, w, cfg: _Config):
    """_core._linear_fused partitioned: loss, LSE and the three gradients for an upstream
    gradient of 1."""

    def local(layout, h, wt, b, y, w):
        y = _failing_together(layout, cfg, y, vocab)
        scale = None
        if cfg.reduction == 1 and (layout.rows or layout.vocab):
            scale = 1.0 / _normaliser(layout, cfg, y, w, vocab)
        if layout.vocab:
            lin = _linear_shard(layout, wt, vocab, h.shape[0])
            up = jnp.ones((), jnp.float32) if scale is None else scale
            row_loss, lse, (dh, dw, db) = _linear_pass(lin, cfg, h, wt, b, y, w, upstream=up)
            loss = layout.psum_rows(row_loss.sum())
        else:
            loss, lse, dh, dw, db = _linear_fused(h, wt, b, y, w, _local_config(layout, cfg))
            loss = layout.psum_rows(loss)
            if scale is not None:
                # The product in float, rounded once (1 / W in bf16 or fp16 would round it too).
                dh, dw, db = ((d.astype(jnp.float32) * scale).astype(d.dtype) for d in (dh, dw, db))
        loss = loss if scale is None else loss * scale.astype(loss.dtype)
        return loss, lse, dh, _sum_rows(layout, dw), _sum_rows(layout, db)

    vocab = wt.shape[0]
    results = ("", "n", "nd", "vd", _BIAS)
    return _linear_partitioned(partial(_linear_fused, cfg=cfg), local, results, h, wt, b, y, w)


def linear_backward(h, wt, b, y, w, lse, g, cfg: _Config):
    """_core._linear_backward partitioned (reduction none): the three gradients."""

    def local(layout, h, wt, b, y, w, lse, g):
        y = _failing_together(layout, cfg, y, vocab)
        if layout.vocab:
            lin = _linear_shard(layout, wt, vocab, h.shape[0])
            _, _, (dh, dw, db) = _linear_pass(lin, cfg, h, wt, b, y, w, upstream=g, lse=lse)
        else:
            dh, dw, db = _linear_backward(h, wt, b, y, w, lse, g, cfg)
        return dh, _sum_rows(layout, dw), _sum_rows(layout, db)

    vocab = wt.shape[0]
    results = ("nd", "vd", _BIAS)
    operands = (h, wt, b, y, w, lse, g)
    return _linear_partitioned(partial(_linear_backward, cfg=cfg), local, results, *operands)
