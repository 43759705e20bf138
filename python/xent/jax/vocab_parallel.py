"""Cross-entropy over a vocabulary sharded along a mesh axis, for code under jax.shard_map.

Each device holds a shard of the logits' class dimension (or of the LM head's weight rows); xent
computes each row's statistics over that shard, the devices exchange them, and every device
merges them into the loss of the unsharded call, bit for bit the same on every device.

The exchange: one jax.lax.all_gather of xent's records (parallel/records.hpp: per row the shard's
online-LSE state and target logit, plus the weighted logit sum with label smoothing; 12 or 16
bytes a row behind a 32-byte header), merged in mesh order by every device. One collective rather
than a pmax and two psums, every device merges the same bytes (a psum's order is XLA's), and the
headers let the merge check that the shards tile the vocabulary. jax types an all_gather's result
as varying along the axis; the merged loss is equal on every device, and a pmax of it (the
identity on equal values, one all-reduce of the loss) tells jax so, making it a replicated value
that out_specs=P() accepts.

A device's first class is axis_index x C (C classes a device), a traced value under shard_map, so
no handler takes it: each device rotates its class ids and class weights by its first class, so
that its shard is classes [0, C) of the same vocabulary, and writes its true first class into its
records' header (bytes [0, 8), int64, parallel/vocab_parallel_phases.hpp) before the exchange.
The merge reads the global class ids, the backward the rotated ones; nothing waits for the device.

Uneven vocabularies: every shard has the same static width C (shard_map's rule), and vocab_size V
<= R x C says how many classes are real; columns at or past V (the last shards' padding) are left
out of every sum and get a zero gradient. Devices whose shard holds fewer than C real classes run
the handlers on the real columns only: a lax.switch over the (at most three) widths.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _ffi
from ._core import (
    _call,
    _cotangent_as,
    _check_ignore_index,
    _check_labels,
    _check_options,
    _class_weights,
    _Config,
    _fuses,
    _keep,
    _kept,
    _type_of,
    _varying_as,
    _varying_axes,
    _linear_operands,
    _mean_normaliser,
    _results,
    _row_upstreams,
    _scaled_linear_grads,
)

_SHARD_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class _Shard(NamedTuple):
    """A call's static sharding: the mesh axis, its size R, each device's width C and V."""

    axis_name: Hashable
    devices: int
    width: int
    vocab: int

    def real_columns(self) -> tuple[int, ...]:
        """Each device's real classes (min(C, max(0, V - i C))), in mesh order."""
        return tuple(
            min(self.width, max(0, self.vocab - i * self.width)) for i in range(self.devices)
        )

    def first(self):
        """This device's first class (traced): i C, or V for a shard of padding only (a shard's
        classes [first, first + columns) lie in [0, V), which an empty one's header must say)."""
        return jnp.minimum(lax.axis_index(self.axis_name) * self.width, self.vocab)


def _make_shard(axis_name, width: int, vocab_size, what: str) -> _Shard:
    try:
        devices = lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"xent: axis_name {axis_name!r} is not a mesh axis of the enclosing shard_map (call "
            "vocab-parallel functions inside jax.shard_map, naming the axis the vocabulary is "
            "sharded over)"
        ) from None
    capacity = devices * width
    if vocab_size is None:
        vocab_size = capacity
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
        raise TypeError(f"xent: vocab_size must be an int, got {type(vocab_size).__name__}")
    if not 1 <= vocab_size <= capacity:
        raise ValueError(
            f"xent: vocab_size must be in [1, {capacity}]: the {devices} shards along "
            f"{axis_name!r} of {what} hold {width} classes each, got {vocab_size}"
        )
    return _Shard(axis_name, devices, width, int(vocab_size))


# --- the rotation ---------------------------------------------------------------------------------


def _rotated_config(cfg: _Config, vocab: int) -> _Config:
    """The options the rotated calls take: an ignore_index that no rotated class id equals (-1
    where the caller's lies in [0, V), which rotated ids reach)."""
    if 0 <= cfg.ignore_index < vocab:
        return cfg._replace(ignore_index=-1)
    return cfg


def _rotate(shard: _Shard, cfg: _Config, y, w, merged=False):
    """Class ids and class weights as this device's rotated calls see them: class k is
    (k - first) mod V, so the shard is classes [0, C). Ignored rows keep an ignore_index that no
    rotated id takes; ids out of range stay out of range (V for one that would read as ignored),
    or, for calls whose merge reads the global ids (`merged`), are ignored here: the merge then
    reports them as the caller gave them, ignore_index too."""
    v = shard.vocab
    first = (shard.first() % v).astype(y.dtype)
    sentinel = _rotated_config(cfg, v).ignore_index
    valid = (y >= 0) & (y < v)
    shifted = y - first
    shifted = jnp.where(shifted < 0, shifted + v, shifted)
    bad = jnp.full_like(y, sentinel) if merged else jnp.where(y == sentinel, v, y)
    yr = jnp.where(y == cfg.ignore_index, sentinel, jnp.where(valid, shifted, bad)).astype(y.dtype)
    wr = jnp.roll(w, -shard.first()) if w.shape[0] else w
    return yr, wr


# --- the handlers ---------------------------------------------------------------------------------


def _vp_call(target, results, *args, cfg, vocab, aliases=None, workspace=None, invariant=()):
    return _call(
        target,
        results,
        *args,
        cfg=cfg,
        attrs={"vocab": np.int64(vocab)},
        aliases=aliases,
        method="sequential",
        workspace=workspace,
        invariant=frozenset(invariant),
    )


def _block_bytes(rows: int, cfg: _Config) -> int:
    """Bytes of one device's records: a header and a record a row (wider with label smoothing),
    as the library lays them out."""
    return _ffi.records_bytes(rows, cfg.label_smoothing)


def _by_width(shard: _Shard, run, x, *args):
    """run(width, x[:, :width], *args) on this device, whose shard has `width` real columns: a
    plain call where every device's shard is full, else a lax.switch over the widths."""
    columns = shard.real_columns()
    widths = sorted(set(columns), reverse=True)
    if len(widths) == 1:
        return run(widths[0], x, *args)
    table = jnp.asarray([widths.index(c) for c in columns], jnp.int32)

    def branch(width):  # a static slice of the shard's real columns
        return lambda x, *a: run(width, x[:, :width], *a)

    return lax.switch(table[lax.axis_index(shard.axis_name)], [branch(c) for c in widths], x, *args)


def _records(shard: _Shard, cfg_r: _Config, x, yr, wr):
    """This device's block of records, its header's first class corrected (see the module)."""
    send_type = jax.ShapeDtypeStruct((_block_bytes(x.shape[0], cfg_r),), jnp.uint8)

    def run(_, xs, yr, wr):
        return _vp_call(
            "xent_vocab_parallel_records", send_type, xs, yr, wr, cfg=cfg_r, vocab=shard.vocab
        )

    send = _by_width(shard, run, x, yr, wr)
    # int64 little-endian (the hosts and GPUs xent runs on); C < 2^31 classes a device.
    low = lax.bitcast_convert_type(shard.first().astype(jnp.uint32), jnp.uint8)
    return lax.dynamic_update_slice(send, jnp.concatenate([low, jnp.zeros(4, jnp.uint8)]), (0,))


def _merged(shard: _Shard, cfg: _Config, x, y, w):
    """Records, the all-gather and the merge: the loss and every row's LSE (float32), equal on
    every device, and the rotated class ids and weights for the gradient."""
    yr, wr = _rotate(shard, cfg, y, w, merged=True)
    recv = lax.all_gather(
        _records(shard, _rotated_config(cfg, shard.vocab), x, yr, wr), shard.axis_name, tiled=True
    )
    rows = y.shape[0]
    loss, lse = _vp_call(
        "xent_vocab_parallel_merge",
        (
            jax.ShapeDtypeStruct((rows,) if cfg.reduction == 0 else (), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
        ),
        recv,
        y,
        w,
        cfg=cfg,
        vocab=shard.vocab,
        workspace=_ffi.workspace_bytes("vocab_parallel_merge", x.dtype, rows),
        # Every device merges the same records: equal along the vocabulary's axes.
        invariant=shard.axis_name if isinstance(shard.axis_name, tuple) else (shard.axis_name,),
    )
    return loss, lse, yr, wr


def _replicated(shard: _Shard, x):
    """x, equal on every device along the axis, typed as replicated (see the module)."""
    if shard.axis_name in _varying_axes(x):
        return lax.pmax(x, shard.axis_name)
    return x


def _varying(shard: _Shard, x):
    """x typed as varying along the axis, as a shard's gradient is: jax types an ffi_call's
    results as replicated whatever its operands. Under shard_map only: where the axis is not a
    manual one (a custom_partitioning's per-device function, _sharding.py) jax types no value as
    varying."""
    if shard.axis_name in _varying_axes(x):
        return x
    if shard.axis_name not in getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
        return x
    return lax.pcast(x, shard.axis_name, to="varying")


def _local_grad(shard: _Shard, cfg: _Config, x, yr, wr, lse, g, in_place=False):
    """This device's shard of d loss / d logits times g (() for mean and sum, (N,) for none), from
    the merged LSE; zero on padding columns. in_place: written over x's buffer."""
    cfg_r = _rotated_config(cfg, shard.vocab)

    def run(width, xs, yr, wr, lse, g):
        grad = _vp_call(
            "xent_vocab_parallel_backward",
            jax.ShapeDtypeStruct(xs.shape, xs.dtype),
            xs,
            yr,
            wr,
            lse,
            g,
            cfg=cfg_r,
            vocab=shard.vocab,
            aliases={0: 0} if in_place and width == shard.width else None,
        )
        return jnp.pad(grad, ((0, 0), (0, shard.width - width))) if width < shard.width else grad

    return _by_width(shard, run, x, yr, wr, lse, g)


# --- cross-entropy --------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _vp_cross_entropy(x, y, w, cfg, shard):
    loss, lse, _, _ = _merged(shard, cfg, x, y, w)
    return _replicated(shard, loss), lse


# As the unsharded _cross_entropy_fwd: with mean or sum the forward writes the gradient for an
# upstream gradient of 1 (over the logits' buffer unless inplace_backward is False) and backward
# scales it; with none (and float16, _fuses) the forward keeps the logits and the merged LSE, and
# backward reads the logits again. Either way the gradient needs no collective: the merged LSE is
# all a shard's gradient needs from the others.
def _vp_cross_entropy_fwd(x, y, w, cfg, shard):
    loss, lse, yr, wr = _merged(shard, cfg, x, y, w)
    out = (_replicated(shard, loss), lse)
    if not _fuses(cfg, x.dtype):
        return out, (_type_of(x), x, yr, _keep(wr), lse)
    one = jnp.ones((), jnp.float32)
    grad = _local_grad(shard, cfg, x, yr, wr, lse, one, in_place=cfg.inplace_backward)
    return out, (_type_of(x), grad)


def _vp_cross_entropy_bwd(cfg, shard, saved, cotangents):
    g = cotangents[0].astype(jnp.float32)
    x_type, *saved = saved
    if not _fuses(cfg, saved[0].dtype):
        x, yr, wr, lse = saved
        wr = _kept(wr, jnp.float32)
        # The rotated ids and weights give the caller's W: rows ignored or out of range carry the
        # rotated ignore_index.
        g = _row_upstreams(_rotated_config(cfg, shard.vocab), yr, wr, g, shard.vocab)
        grad = _local_grad(shard, cfg._replace(reduction=0), x, yr, wr, lse, g)
    else:
        (grad,) = saved
        grad = _call(
            "xent_scale_grad", jax.ShapeDtypeStruct(grad.shape, grad.dtype), grad, g, aliases={0: 0}
        )
    return _cotangent_as(_varying(shard, grad), x_type), None, None


_vp_cross_entropy.defvjp(_vp_cross_entropy_fwd, _vp_cross_entropy_bwd)


def _check_shard_dtype(name, x):
    if x.dtype not in _SHARD_DTYPES:
        raise TypeError(
            f"xent: {name} must be float32, bfloat16 or float16 for a vocab-parallel call, got "
            f"{x.dtype}"
        )


def _public_results(shard, loss, lse, shape, dtype, cfg, return_lse):
    out = _results(loss, lse, shape, dtype, cfg, return_lse)
    if not return_lse:
        return out
    return out[0], _replicated(shard, out[1])


def vocab_parallel_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    axis_name: Hashable,
    vocab_size: int | None = None,
    weight: jax.Array | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: float = 0.0,
    return_lse: bool = False,
    inplace_backward: bool = True,
):
    """cross_entropy over logits whose class dimension is sharded along the mesh axis
    `axis_name`; call it inside jax.shard_map.

    logits (..., C): this device's shard, classes [i C, (i + 1) C) of the vocabulary for the
    device at index i along the axis (in_specs P(..., axis_name)); labels (...): global class ids,
    the same on every device of the axis. vocab_size: the vocabulary V, R x C by default (R
    devices along the axis); smaller when the last shards are padded (V not a multiple of R),
    whose columns at or past V are no classes: left out of the loss, zero gradient. weight: all V
    class weights, on every device. The other options and the results are cross_entropy's: the
    loss (and LSE) of the unsharded call, the same on every device and typed as replicated along
    the axis (out_specs P() takes it); the gradient is this device's shard (over the shard's
    buffer unless inplace_backward is False, as in cross_entropy). float32, bfloat16 and float16
    logits.

    No device holds more than its shard: per row each device sends 12 bytes (16 with label
    smoothing) through one all_gather (see the module for why an all_gather), plus a pmax of the
    loss; the gradient needs no collective.
    """
    logits = jnp.asarray(logits)
    labels = jnp.asarray(labels)
    cfg = _check_options(
        ignore_index, label_smoothing, reduction, z_loss, softcap, inplace_backward
    )
    _check_shard_dtype("logits", logits)
    if logits.ndim < 1:
        raise ValueError("xent: logits must have a class dimension (..., C), got a scalar")
    _check_labels(labels, logits.shape[:-1], "logits.shape[:-1]")
    _check_ignore_index(cfg, labels)
    shard = _make_shard(axis_name, logits.shape[-1], vocab_size, "logits")
    w = _class_weights(weight, shard.vocab)
    rows = math.prod(labels.shape)
    loss, lse = _vp_cross_entropy(
        logits.reshape(rows, shard.width), labels.reshape(rows), w, cfg, shard
    )
    return _public_results(shard, loss, lse, labels.shape, logits.dtype, cfg, return_lse)


# --- fused linear cross-entropy -------------------------------------------------------------------
#
# Rows are taken `chunk` at a time (lax.scan): a chunk's logits, hidden_c · W_shardᵀ + b_shard
# (chunk x C, float32), are the one buffer of the vocabulary's width that exists, and per chunk
# the devices exchange that chunk's records (one all_gather), as xent's C++ vocab-parallel linear
# calls do (parallel/vocab_parallel_linear.hpp). The chunk's merge gives its rows' losses and
# LSEs; the reduction over rows is taken here, the mean's normaliser (the sum of w[y] over rows
# not ignored) from the labels. hidden's gradient is a sum over the vocabulary: each device's
# partial, G_shard · W_shard, is summed over the axis (a psum, Megatron's all-reduce).

# The logits a chunk may hold: xent's default linear workspace budget (linear/options.hpp).
_CHUNK_BYTES = 256 << 20


class _Linear(NamedTuple):
    shard: _Shard
    chunk: int  # rows a chunk


def _chunks(lin: _Linear, cfg: _Config, h, y):
    """hidden and labels as (chunks, chunk, ...): the last chunk filled with ignored rows."""
    rows = h.shape[0]
    count = max(1, -(-rows // lin.chunk))
    pad = count * lin.chunk - rows
    h = jnp.pad(h, ((0, pad), (0, 0)))
    y = jnp.pad(y, (0, pad), constant_values=cfg.ignore_index)
    return h.reshape(count, lin.chunk, h.shape[1]), y.reshape(count, lin.chunk)


def _chunk_logits(h, wt, b):
    z = jnp.dot(h, wt.T, preferred_element_type=jnp.float32)
    return z + b.astype(jnp.float32) if b.shape[0] else z


def _chunk_grads(h, wt, gz):
    """A chunk's partial d_hidden, and its d_weight and d_bias terms, from its logits' gradient."""
    g = gz.astype(h.dtype)
    dh = jnp.dot(g, wt, preferred_element_type=jnp.float32)
    return dh, jnp.dot(g.T, h, preferred_element_type=jnp.float32), gz.sum(axis=0)


def _linear_pass(lin: _Linear, cfg: _Config, h, wt, b, y, w, upstream=None, lse=None):
    """One scan over the row chunks. Forward (lse None): each chunk's row losses and LSEs, and
    with `upstream` (the rows' upstream gradient, or a scalar for every row) the gradients too.
    Backward (lse given): the gradients from the saved LSE, no collective."""
    shard = lin.shard
    rows = h.shape[0]
    none = cfg._replace(reduction=0)
    hc, yc = _chunks(lin, cfg, h, y)
    count = hc.shape[0]
    per_row = jnp.broadcast_to(
        jnp.zeros((), jnp.float32) if upstream is None else upstream, (rows,)
    ).astype(jnp.float32)
    up = jnp.pad(per_row, (0, count * lin.chunk - rows)).reshape(count, lin.chunk)
    saved = None if lse is None else jnp.pad(lse, (0, count * lin.chunk - rows))
    saved = None if saved is None else saved.reshape(count, lin.chunk)
    grads = upstream is not None

    def step(acc, chunk):
        h_c, y_c, up_c, lse_c = chunk
        z = _chunk_logits(h_c, wt, b)
        if lse_c is None:
            loss_c, lse_c, yr, wr = _merged(shard, none, z, y_c, w)
        else:
            loss_c = jnp.zeros((lin.chunk,), jnp.float32)
            yr, wr = _rotate(shard, none, y_c, w)
        if not grads:
            return acc, (loss_c, lse_c, None)
        gz = _local_grad(shard, none, z, yr, wr, lse_c, up_c)
        dh, dw, db = _chunk_grads(h_c, wt, gz)
        return (acc[0] + dw, acc[1] + db), (loss_c, lse_c, dh)

    acc0 = (jnp.zeros(wt.shape, jnp.float32), jnp.zeros((wt.shape[0],), jnp.float32))
    # The sums typed as the steps' terms: varying along the vocabulary's axis and every axis an
    # operand varies along.
    axes = _varying_axes(h, wt, b, y, w, per_row)
    acc0 = tuple(_varying_as(_varying(shard, a), axes) for a in acc0) if grads else ()
    (acc, (loss, lse_out, dh)) = lax.scan(step, acc0, (hc, yc, up, saved))
    loss, lse_out = loss.reshape(-1)[:rows], lse_out.reshape(-1)[:rows]
    if not grads:
        return loss, lse_out, None
    dh = lax.psum(dh.reshape(-1, h.shape[1])[:rows], shard.axis_name)
    db = acc[1].astype(b.dtype) if b.shape[0] else b
    return loss, lse_out, (dh.astype(h.dtype), acc[0].astype(wt.dtype), db)


def _reduce(cfg: _Config, row_loss, y, w, classes: int):
    if cfg.reduction == 0:
        return row_loss
    total = row_loss.sum()
    return total / _mean_normaliser(cfg, y, w, classes) if cfg.reduction == 1 else total


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _vp_linear(h, wt, b, y, w, cfg, lin):
    row_loss, lse, _ = _linear_pass(lin, cfg, h, wt, b, y, w)
    return _replicated(lin.shard, _reduce(cfg, row_loss, y, w, lin.shard.vocab)), lse


# As the unsharded linear path: with mean or sum the forward also computes the gradients (each
# chunk's logits once) for an upstream gradient of 1, and backward scales them; with none (and
# float16, _fuses) the forward keeps the LSE and backward computes every chunk's logits again.
def _vp_linear_fwd(h, wt, b, y, w, cfg, lin):
    types = (_type_of(h), _type_of(wt), _type_of(b))
    classes = lin.shard.vocab
    fused = _fuses(cfg, h.dtype)
    scale = None
    if fused:
        scale = jnp.ones((), jnp.float32)
        if cfg.reduction == 1:
            scale = 1.0 / _mean_normaliser(cfg, y, w, classes)
    row_loss, lse, grads = _linear_pass(lin, cfg, h, wt, b, y, w, upstream=scale)
    out = (_replicated(lin.shard, _reduce(cfg, row_loss, y, w, classes)), lse)
    if not fused:
        return out, (types, (h, wt, _keep(b), y, _keep(w), lse))
    dh, dw, db = grads
    return out, (types, (dh, dw, _keep(db)))


def _vp_linear_bwd(cfg, lin, saved, cotangents):
    g = cotangents[0].astype(jnp.float32)
    types, saved = saved
    if not _fuses(cfg, saved[0].dtype):
        h, wt, b, y, w, lse = saved
        b, w = _kept(b, h.dtype), _kept(w, jnp.float32)
        g = _row_upstreams(cfg, y, w, g, lin.shard.vocab)
        _, _, (dh, dw, db) = _linear_pass(lin, cfg, h, wt, b, y, w, upstream=g, lse=lse)
    else:
        dh, dw, db = _scaled_linear_grads(saved, g)
    return (*(_cotangent_as(d, t) for d, t in zip((dh, dw, db), types)), None, None)


_vp_linear.defvjp(_vp_linear_fwd, _vp_linear_bwd)


def vocab_parallel_linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis_name: Hashable,
    vocab_size: int | None = None,
    class_weight: jax.Array | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: float = 0.0,
    return_lse: bool = False,
    chunk_rows: int | None = None,
):
    """linear_cross_entropy with the LM head's weight sharded by vocabulary along `axis_name`;
    call it inside jax.shard_map.

    hidden (..., D) and labels (...): the same on every device of the axis; weight (C, D) and
    bias (C,) or None: this device's rows, classes [i C, (i + 1) C) for the device at index i
    (in_specs P(axis_name, None)); vocab_size, class_weight and the options as
    vocab_parallel_cross_entropy's (rows of weight at or past vocab_size are padding: no
    classes, zero gradient). The loss (and LSE) are the unsharded call's, replicated along the
    axis; hidden's gradient is complete on every device (the devices' partials summed with a
    psum), weight's and bias's are this device's rows.

    No (..., V) logits: a chunk of chunk_rows rows (by default as many as keep its chunk x C
    float32 logits within xent's default linear workspace budget, 256 MiB) at a time, with one
    all_gather of its rows' records.
    """
    cfg = _check_options(ignore_index, label_smoothing, reduction, z_loss, softcap)
    hidden, weight, b, labels = _linear_operands(
        hidden, weight, bias, labels, _check_shard_dtype, "C"
    )
    _check_ignore_index(cfg, labels)
    shard = _make_shard(axis_name, weight.shape[0], vocab_size, "weight")
    w = _class_weights(class_weight, shard.vocab)
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_BYTES // (4 * max(1, shard.width)))
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)):
        raise TypeError(f"xent: chunk_rows must be an int, got {type(chunk_rows).__name__}")
    if chunk_rows < 1:
        raise ValueError(f"xent: chunk_rows must be >= 1, got {chunk_rows}")
    rows = math.prod(labels.shape)
    lin = _Linear(shard, int(min(chunk_rows, max(rows, 1))))
    loss, lse = _vp_linear(
        hidden.reshape(rows, hidden.shape[-1]), weight, b, labels.reshape(rows), w, cfg, lin
    )
    return _public_results(shard, loss, lse, labels.shape, hidden.dtype, cfg, return_lse)
