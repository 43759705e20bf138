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

import math
from typing import Optional

import torch
import torch.distributed as dist

from . import _library  # noqa: F401  (loads the ops)
from .ops import _REDUCTIONS, _accumulator, _check_fused, _check_like_torch, _result

_fwd = torch.ops.xent.vocab_parallel_cross_entropy_fwd.default
_bwd = torch.ops.xent.vocab_parallel_cross_entropy_bwd.default
_fwd_bwd = torch.ops.xent.vocab_parallel_cross_entropy_fwd_bwd.default
_scale_grad = torch.ops.xent.scale_grad_.default


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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Training with a reduced loss runs the fused op (one read of the slice, its gradient written
    with upstream 1) and scales that gradient by the loss's gradient in backward; otherwise the
    forward saves the LSE and backward calls the backward op."""

    @staticmethod
    def forward(ctx, logits, target, weight, args):
        reduction = args[4]
        ctx.fused = reduction != 0 and ctx.needs_input_grad[0]
        if ctx.fused:
            loss, lse, grad = _fwd_bwd(logits, target, weight, *args)
            ctx.save_for_backward(grad)
            ctx.scaled = False
        else:
            loss, lse = _fwd(logits, target, weight, *args)
            ctx.save_for_backward(logits, target, weight, lse)
            ctx.args = args
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        if grad_loss is None:
            return None, None, None, None
        if ctx.fused:
            # The saved gradient is scaled where it lies, so it can serve one backward only.
            if ctx.scaled:
                raise RuntimeError(
                    "xent.torch.distributed: a training call with a reduced loss keeps only the "
                    "gradient, which one backward consumes; for a second backward through it, "
                    "use reduction='none' and reduce the loss yourself"
                )
            ctx.scaled = True
            (grad,) = ctx.saved_tensors
            _scale_grad(grad, grad_loss)
            return grad, None, None, None
        logits, target, weight, lse = ctx.saved_tensors
        grad = _bwd(grad_loss.contiguous(), logits, target, weight, lse, *ctx.args)
        return grad, None, None, None


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
    return group.group_name, int(vocab_start), int(vocab_size)


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
    softcap: float = 0.0,
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
                 or 'sum'; the other options are xent.torch.cross_entropy's
    vocab_start, vocab_size
                 this rank's first class and the vocabulary size, for an uneven split; by default
                 the split is even, Megatron's: rank r holds [r * V_local, (r + 1) * V_local)

    Returns the loss in logits' dtype. Ranks that disagree on the number of rows, the vocabulary
    size or the options get a ValueError on every rank (on CUDA this check would synchronise,
    and is the caller's to keep, as for torch's own collectives).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    _check_like_torch("vocab_parallel_cross_entropy", weight, "weight", target, ignore_index)
    if logits.dim() < 1:
        raise ValueError("xent.torch.distributed: logits must have a class dimension (the last)")
    v_local = logits.shape[-1]
    n = math.prod(logits.shape[:-1])  # not reshape(-1, ...): a slice may hold no class
    soft = target.is_floating_point()
    if soft:
        if target.shape != logits.shape:
            raise ValueError(
                f"xent.torch.distributed: class probabilities must have the shape of logits "
                f"{tuple(logits.shape)}, got {tuple(target.shape)}"
            )
        rows_shape = logits.shape[:-1]
        t = target.reshape(n, v_local)
    else:
        if target.shape != logits.shape[:-1]:
            raise ValueError(
                f"xent.torch.distributed: target must have the shape of logits without its "
                f"last dimension, {tuple(logits.shape[:-1])}, got {tuple(target.shape)}"
            )
        rows_shape = target.shape
        t = target.reshape(-1)
    name, start, vocab = _group_and_shard(group, v_local, vocab_start, vocab_size)
    code = _REDUCTIONS[reduction]
    args = (start, vocab, name, ignore_index, code, label_smoothing, z_loss, softcap)
    x = logits.reshape(n, v_local)
    loss, _ = _VocabParallelCrossEntropy.apply(x, t, weight, args)
    if code == 0:
        loss = loss.reshape(rows_shape)
    return _result(loss, logits)
