"""Vocab-parallel cross-entropy under torch.distributed: one process per device, each holding a
slice of the vocabulary (tensor parallelism, Megatron's layout).

    import torch.distributed as dist
    import xent.torch.distributed as xd
    # logits: (..., V_local), this rank's classes [rank * V_local, (rank + 1) * V_local)
    loss = xd.vocab_parallel_cross_entropy(logits, target, group)   # per token, as Megatron's

Every rank of `group` makes the same call with its own slice. Targets are global class ids (the
same on every rank) or, for class probabilities, this rank's (..., V_local) slice of them; class
weights are all V of them. Every rank gets the loss of the unsharded call, bit for bit the same on
each, and the gradient of its own slice. The ops exchange a few floats per row through the
group's own all-gather (gloo on the CPU, NCCL on CUDA), once per call.
"""

import functools
import math
import numbers
from typing import Optional

import torch
import torch.distributed as dist

from . import _library  # noqa: F401  (loads the ops)
from .ops import (
    _REDUCTIONS,
    _accumulator,
    _check_fused,
    _check_like_torch,
    _int64,
    _result,
    _smoothing,
)

_fwd = torch.ops.xent.vocab_parallel_cross_entropy_fwd.default
_bwd = torch.ops.xent.vocab_parallel_cross_entropy_bwd.default
_fwd_bwd = torch.ops.xent.vocab_parallel_cross_entropy_fwd_bwd.default
_linear_fwd = torch.ops.xent.vocab_parallel_linear_cross_entropy_fwd.default
_linear_bwd = torch.ops.xent.vocab_parallel_linear_cross_entropy_bwd.default
_linear_fwd_bwd = torch.ops.xent.vocab_parallel_linear_cross_entropy_fwd_bwd.default
_scale_grad = torch.ops.xent.scale_grad_.default
_refuse = torch.ops.xent.vocab_parallel_refuse.default


def _loss_and_lse_fake(x, reduction):
    n = x.shape[0]
    acc = _accumulator(x.dtype)
    return x.new_empty((n,) if reduction == 0 else (), dtype=acc), x.new_empty((n,), dtype=acc)


@torch.library.register_fake("xent::vocab_parallel_cross_entropy_fwd")
def _fwd_fake(input, target, weight, start, vocab, group, ignore_index, reduction, *options):
    return _loss_and_lse_fake(input, reduction)


@torch.library.register_fake("xent::vocab_parallel_cross_entropy_bwd")
def _bwd_fake(grad_output, input, *rest):
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.register_fake("xent::vocab_parallel_cross_entropy_fwd_bwd")
def _fwd_bwd_fake(input, target, weight, start, vocab, group, ignore_index, reduction, *options):
    _check_fused(reduction)
    loss, lse = _loss_and_lse_fake(input, reduction)
    return loss, lse, torch.empty(input.shape, dtype=input.dtype, device=input.device)


def _linear_grads_fake(hidden, weight, bias, output_mask):
    def grad(like, wanted):
        return torch.empty(like.shape if wanted else (0,), dtype=hidden.dtype, device=hidden.device)

    n_bias = weight.shape[0] if bias is not None and output_mask[2] else 0
    return (
        grad(hidden, output_mask[0]),
        grad(weight, output_mask[1]),
        torch.empty((n_bias,), dtype=hidden.dtype, device=hidden.device),
    )


@torch.library.register_fake("xent::vocab_parallel_linear_cross_entropy_fwd")
def _linear_fwd_fake(
    hidden,
    weight,
    bias,
    target,
    class_weight,
    start,
    vocab,
    group,
    ignore_index,
    reduction,
    *options,
):
    return _loss_and_lse_fake(hidden, reduction)


@torch.library.register_fake("xent::vocab_parallel_linear_cross_entropy_bwd")
def _linear_bwd_fake(grad_output, hidden, weight, bias, *rest):
    return _linear_grads_fake(hidden, weight, bias, rest[-1])


@torch.library.register_fake("xent::vocab_parallel_linear_cross_entropy_fwd_bwd")
def _linear_fwd_bwd_fake(
    hidden, weight, bias, target, class_weight, start, vocab, group, ignore_index, reduction, *rest
):
    _check_fused(reduction)
    return _loss_and_lse_fake(hidden, reduction) + _linear_grads_fake(
        hidden, weight, bias, rest[-1]
    )


def _first_derivative_only(backward):
    """A backward whose gradients, under backward(create_graph=True), carry a node that raises
    when anything differentiates through them (torch.ops.xent.first_derivative_only, as the
    single-device ops' do): xent has no second derivative, and without the node a gradient
    penalty or a Hessian would take xent's gradient as a constant."""

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        with torch.no_grad():
            out = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return out
        defined = [g for g in out if isinstance(g, torch.Tensor)]
        if not defined:
            return out
        grad_loss = grads[0] if isinstance(grads[0], torch.Tensor) else defined[0].new_empty(0)
        marked = iter(torch.ops.xent.first_derivative_only(defined, grad_loss))
        return tuple(next(marked) if isinstance(g, torch.Tensor) else g for g in out)

    return wrapped


# Whether the running backward keeps the graph for another (retain_graph, create_graph); where
# torch lacks the query, every backward is taken to keep it.
_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)


def _scaled(grad, grad_loss):
    """A gradient a fused forward saved (upstream 1) times the loss's gradient, as the
    single-device ops scale it: in place, unless the graph is kept for another backward, which
    needs the saved gradient unscaled, so a copy is scaled."""
    g = grad.clone() if _keeps_graph() else grad
    _scale_grad(g, grad_loss)
    return g


def _fuses(reduction, dtype, wanted):
    """Whether a call takes the fused path, as the single-device ops decide (csrc/xent_autograd.cpp,
    fuses): a reduced loss, a gradient wanted, and not float16, whose gradients formed at upstream
    1 underflow where a GradScaler's factor would have kept them."""
    return reduction != 0 and dtype != torch.float16 and wanted


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Training with a reduced loss runs the fused op (one read of the slice, its gradient written
    with upstream 1) and scales that gradient by the loss's gradient in backward; otherwise the
    forward saves the LSE and backward calls the backward op."""

    @staticmethod
    def forward(ctx, logits, target, weight, args):
        reduction = args[4]
        ctx.fused = _fuses(reduction, logits.dtype, ctx.needs_input_grad[0])
        if ctx.fused:
            loss, lse, grad = _fwd_bwd(logits, target, weight, *args)
            ctx.save_for_backward(grad)
        else:
            loss, lse = _fwd(logits, target, weight, *args)
            ctx.save_for_backward(logits, target, weight, lse)
            ctx.args = args
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @_first_derivative_only
    def backward(ctx, grad_loss, grad_lse):
        if grad_loss is None:
            return None, None, None, None
        if ctx.fused:
            (grad,) = ctx.saved_tensors
            return _scaled(grad, grad_loss), None, None, None
        logits, target, weight, lse = ctx.saved_tensors
        grad = _bwd(grad_loss.contiguous(), logits, target, weight, lse, *ctx.args)
        return grad, None, None, None


def _sum_over_group(ctx, d_hidden):
    """The ranks' partial d_hidden summed, unless the caller sums it (reduce_hidden_grad)."""
    if ctx.mask[0] and ctx.reduce_hidden:
        dist.all_reduce(d_hidden, group=ctx.group)
    return d_hidden


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """As _VocabParallelCrossEntropy, over hidden and this rank's weight rows. Each rank's
    d_hidden is its partial, G_shard W_shard: it is summed over the group (an all-reduce of N x D,
    torch.distributed's) unless the caller's own backward does that (reduce_hidden_grad=False, as
    behind Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, args, group, reduce_hidden):
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        ctx.mask, ctx.group, ctx.reduce_hidden = mask, group, reduce_hidden
        ctx.fused = _fuses(args[4], hidden.dtype, any(mask))
        if ctx.fused:
            loss, lse, dh, dw, db = _linear_fwd_bwd(
                hidden, weight, bias, target, class_weight, *args, mask
            )
            ctx.save_for_backward(_sum_over_group(ctx, dh), dw, db)
        else:
            loss, lse = _linear_fwd(hidden, weight, bias, target, class_weight, *args)
            ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse)
            ctx.args = args
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @_first_derivative_only
    def backward(ctx, grad_loss, grad_lse):
        if grad_loss is None:
            return (None,) * 8
        if ctx.fused:
            grads = [
                _scaled(g, grad_loss) if wanted else None
                for g, wanted in zip(ctx.saved_tensors, ctx.mask)
            ]
        else:
            hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
            dh, dw, db = _linear_bwd(
                grad_loss.contiguous(),
                hidden,
                weight,
                bias,
                target,
                class_weight,
                lse,
                *ctx.args,
                ctx.mask,
            )
            grads = (_sum_over_group(ctx, dh), dw, db)
        out = tuple(g if wanted else None for g, wanted in zip(grads, ctx.mask))
        return out + (None,) * 5


def _as_float(name, value):
    """A float argument as the ops take it, checked here as ops._int64 checks an integer."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def _group_and_shard(group, v_local, vocab_start, vocab_size):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "xent.torch.distributed: torch.distributed is not initialised "
            "(call torch.distributed.init_process_group first)"
        )
    if group is None:
        group = dist.group.WORLD
    if (vocab_start is None) != (vocab_size is None):
        raise ValueError(
            "xent.torch.distributed: give both vocab_start and vocab_size (an uneven split), "
            "or neither (Megatron's even split)"
        )
    if vocab_start is None:
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        vocab_start, vocab_size = rank * v_local, ranks * v_local
    return (
        group.group_name,
        _int64("vocab_start", vocab_start),
        _int64("vocab_size", vocab_size),
    )


def _options(ignore_index, reduction, label_smoothing, z_loss, softcap):
    """The options as xent.torch.cross_entropy takes them (ignore_index an integer, torch's
    label_smoothing), softcap None or 0 off; the ops' values."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if softcap is None:
        softcap = 0.0
    elif not softcap >= 0:
        raise ValueError(f"softcap must be > 0, 0 or None (off), got {softcap}")
    return (
        _int64("ignore_index", ignore_index),
        reduction,
        _smoothing(label_smoothing),
        _as_float("z_loss", z_loss),
        _as_float("softcap", softcap),
    )


def _checked_call(fn, tensors, shape, target, weight, weight_name, group, shard, option_values):
    """A call's arguments checked on this rank: the options, class weights as torch takes them,
    `shape()` (the rows' shape and V_local, once the tensors are checked), the targets as rows ((N,)
    class ids or (N, V_local) probabilities) and the shard. Returns the options, the target rows and
    the ops' trailing arguments (the shard, the group's name and the options).

    An argument error here is this rank's alone: before raising it, this rank takes its part in
    the agreement exchange that every call of the other ranks makes (where calls make one: on the
    CPU, and on CUDA under XENT_CHECK_RANKS=1), so that they raise too instead of waiting in it;
    the device is the first of `tensors` that is a tensor."""
    try:
        options = _options(*option_values)
        ignore_index, reduction, label_smoothing, z_loss, softcap = options
        _check_like_torch(fn, weight, weight_name, target, ignore_index)
        rows_shape, v_local = shape()
        n = math.prod(rows_shape)  # not reshape(-1, ...): a slice may hold no class
        soft = target.is_floating_point()
        want = tuple(rows_shape) + ((v_local,) if soft else ())
        if tuple(target.shape) != want:
            raise ValueError(
                f"xent.torch.distributed.{fn}: target must be {want} (class ids of every row, or "
                f"class probabilities of this rank's classes), got {tuple(target.shape)}"
            )
        t = target.reshape(n, v_local) if soft else target.reshape(n)
        name, start, vocab = _group_and_shard(group, v_local, *shard)
    except Exception:
        g = dist.group.WORLD if group is None and dist.is_initialized() else group
        device = next((x.device for x in tensors if isinstance(x, torch.Tensor)), None)
        if isinstance(g, dist.ProcessGroup) and device is not None:
            _refuse(g.group_name, device)
        raise
    code = _REDUCTIONS[reduction]
    return options, t, (start, vocab, name, ignore_index, code, label_smoothing, z_loss, softcap)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    weight: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "none",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Cross-entropy over logits whose class dimension (the last) is split across the ranks of
    `group` (default: the world).

    logits       (..., V_local): this rank's classes [vocab_start, vocab_start + V_local);
                 float32, bfloat16 or float16, on the CPU (gloo group) or CUDA (NCCL group)
    target       (...) global class ids, int64 or int32, the same on every rank; or (..., V_local)
                 class probabilities of this rank's classes
    weight       (V,) class weights of the whole vocabulary, the same on every rank
    reduction    'none' (the default, Megatron's: one loss per token, of target's shape), 'mean'
                 or 'sum'; the other options are xent.torch.cross_entropy's (softcap None or 0
                 is off)
    vocab_start, vocab_size
                 this rank's first class and the vocabulary size, for an uneven split; by default
                 the split is even, Megatron's: rank r holds [r * V_local, (r + 1) * V_local)

    Returns the loss in logits' dtype. Ranks that disagree on the number of rows, the vocabulary
    size or the options get a ValueError on every rank (on CUDA the check synchronises, so it runs
    only under the environment variable XENT_CHECK_RANKS=1; otherwise agreement is the caller's
    contract, as for torch's own collectives).
    """

    def shape():
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits must be a tensor, got {type(logits).__name__}")
        if logits.dim() < 1:
            raise ValueError(
                "xent.torch.distributed: logits must have a class dimension (the last)"
            )
        return logits.shape[:-1], logits.shape[-1]

    options, t, args = _checked_call(
        "vocab_parallel_cross_entropy",
        (logits, target),
        shape,
        target,
        weight,
        "weight",
        group,
        (vocab_start, vocab_size),
        (ignore_index, reduction, label_smoothing, z_loss, softcap),
    )
    v_local, rows_shape = logits.shape[-1], logits.shape[:-1]
    x = logits.reshape(t.shape[0], v_local)
    loss, _ = _VocabParallelCrossEntropy.apply(x, t, weight, args)
    if options[1] == "none":
        loss = loss.reshape(rows_shape)
    return _result(loss, logits)


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    target: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    bias_shard: Optional[torch.Tensor] = None,
    *,
    class_weight: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "none",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    reduce_hidden_grad: bool = True,
) -> torch.Tensor:
    """Cross-entropy of the logits hidden @ weight.T (+ bias) over an LM head whose rows (the
    vocabulary) are split across the ranks of `group`, never forming any logits beyond a chunk.

    hidden        (..., D), the same on every rank
    weight_shard  (V_local, D): this rank's rows of the head, classes [vocab_start,
                  vocab_start + V_local) (by default Megatron's even split, as
                  vocab_parallel_cross_entropy's)
    target        (...) global class ids, or (..., V_local) class probabilities of this rank's
                  classes
    bias_shard    (V_local,) or None
    class_weight  (V,) class weights of the whole vocabulary
    reduce_hidden_grad
                  hidden's gradient sums every rank's share: True all-reduces it over `group`
                  in backward; False leaves each rank its partial, for a caller whose backward
                  sums it already (Megatron's copy_to_tensor_model_parallel_region)

    The other options and the result are vocab_parallel_cross_entropy's.
    """

    def shape():
        if not isinstance(hidden, torch.Tensor) or not isinstance(weight_shard, torch.Tensor):
            raise TypeError("hidden and weight_shard must be tensors")
        if hidden.dim() < 1 or weight_shard.dim() != 2:
            raise ValueError(
                "xent.torch.distributed: hidden must be (..., D) and weight_shard (V_local, D), "
                f"got {tuple(hidden.shape)} and {tuple(weight_shard.shape)}"
            )
        return hidden.shape[:-1], weight_shard.shape[0]

    options, t, args = _checked_call(
        "vocab_parallel_linear_cross_entropy",
        (hidden, weight_shard, target),
        shape,
        target,
        class_weight,
        "class_weight",
        group,
        (vocab_start, vocab_size),
        (ignore_index, reduction, label_smoothing, z_loss, softcap),
    )
    rows_shape = hidden.shape[:-1]
    n = t.shape[0]
    x = hidden.reshape(n, hidden.shape[-1])
    loss, _ = _VocabParallelLinearCrossEntropy.apply(
        x,
        weight_shard,
        bias_shard,
        t,
        class_weight,
        args,
        dist.group.WORLD if group is None else group,
        reduce_hidden_grad,
    )
    if options[1] == "none":
        loss = loss.reshape(rows_shape)
    return _result(loss, hidden)
