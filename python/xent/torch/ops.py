"""xent.torch.cross_entropy and linear_cross_entropy: torch.ops.xent.* with fake kernels.

The C++ ops (csrc/xent_ops.cpp for the CPU, csrc/xent_ops_cuda.cu for CUDA) compute on 2-D (N, C)
logits, and their autograd formulas are C++ too (csrc/xent_autograd.cpp: one dispatcher call
forward, one C++ node backward, no Python in either; a training call with a reduced loss runs the
fused *_fwd_bwd op forward and scale_grad_ backward). This module checks the arguments as
torch does (its error types and messages), brings torch's layouts ((C), (N, C, d1, ...)) to rows,
registers the fake (meta) kernels torch.compile traces with, and casts the loss (float32; float64
for float64 inputs, which run on the CPU only) to the input's dtype.
"""

import operator
from typing import NamedTuple, Optional

import torch
from torch.nn import _reduction as _Reduction

from .._choices import ACCUMULATIONS as _ACCUMULATIONS
from .._choices import ORDERS as _ORDERS
from .._choices import choice_code
from .._choices import sparse_threshold as _sparse_threshold
from . import _library

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
# The overloads themselves: a call skips the packet's overload lookup.
_cross_entropy_fwd = torch.ops.xent.cross_entropy_fwd.default
_linear_cross_entropy_fwd = torch.ops.xent.linear_cross_entropy_fwd.default


def _accumulator(dtype):
    """The dtype of the ops' loss and LSE: xent accumulates float64 in float64, the rest in
    float32 (xent::accumulator_t)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _loss_and_lse_fake(x, reduction):
    n = x.shape[0]
    acc = _accumulator(x.dtype)
    return x.new_empty((n,) if reduction == 0 else (), dtype=acc), x.new_empty((n,), dtype=acc)


def _stats_fake(x, return_argmax, return_num_correct):
    """The cross-entropy forwards' int64 side outputs: N argmax entries, then num_correct."""
    size = (x.shape[0] if return_argmax else 0) + (1 if return_num_correct else 0)
    return x.new_empty((size,), dtype=torch.int64)


# The fake kernels take the schemas' arguments positionally and name only those they read.


@torch.library.register_fake("xent::cross_entropy_fwd")
def _fwd_fake(input, target, weight, ignore_index, reduction, *options):
    return (*_loss_and_lse_fake(input, reduction), _stats_fake(input, *options[-2:]))


@torch.library.register_fake("xent::cross_entropy_bwd")
def _bwd_fake(grad_output, input, *rest):
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.register_fake("xent::cross_entropy_bwd_")
def _bwd_inplace_fake(*args):
    return None


def _check_fused(reduction):
    """The fused ops' refusal of reduction none (csrc/xent_ops.h, check_fused_reduction)."""
    if reduction == 0:
        raise ValueError(
            "xent: a fused forward+backward needs reduction mean or sum (with none, "
            "each row's upstream gradient is known only in backward)"
        )


@torch.library.register_fake("xent::cross_entropy_fwd_bwd")
def _fwd_bwd_fake(input, target, weight, ignore_index, reduction, *options):
    _check_fused(reduction)
    loss, lse = _loss_and_lse_fake(input, reduction)
    stats = _stats_fake(input, *options[-2:])
    return loss, lse, stats, torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.register_fake("xent::cross_entropy_fwd_bwd_")
def _fwd_bwd_inplace_fake(input, target, weight, ignore_index, reduction, *options):
    _check_fused(reduction)
    return (*_loss_and_lse_fake(input, reduction), _stats_fake(input, *options[-2:]))


@torch.library.register_fake("xent::scale_grad_")
def _scale_grad_fake(grad, grad_output):
    return None


def _check_devices(fn, x, x_name, tensors):
    """Every (name, tensor) of `tensors` on x's device: the fake kernels, which torch also runs
    for the meta device, would otherwise return empty tensors for a meta target or weight."""
    for name, t in tensors:
        if t is not None and t.device != x.device:
            raise RuntimeError(
                f"xent.torch.{fn}: {name} is on {t.device}, {x_name} on "
                f"{x.device}: every tensor must be on one device"
            )


def _check_like_torch(fn, class_weight, name, target, ignore_index):
    """What torch's cross_entropy refuses: class weights requiring grad, and soft targets with an
    ignore_index (no class id to ignore among probabilities); xent gives soft targets no
    gradient either."""
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"xent.torch.{fn} is not differentiable with respect to argument '{name}'. This "
            f"input cannot have requires_grad True (pass {name}.detach())."
        )
    if target.is_floating_point():
        if target.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                "xent.torch gives soft targets no gradient: the target cannot have "
                "requires_grad True (pass target.detach())"
            )
        if ignore_index >= 0:
            raise RuntimeError("ignore_index is not supported for floating point target")


def _result(loss, x, dtype=None):
    """The loss in x's dtype (or `dtype`), as torch gives it; under autocast in float32 (what the
    op computed), as torch's cross_entropy, which autocast runs in float32."""
    dtype = x.dtype if dtype is None else dtype
    if loss.dtype == dtype or torch.is_autocast_enabled(x.device.type):
        return loss
    return loss.to(dtype)


class CrossEntropyOutput(NamedTuple):
    """cross_entropy's result when a side output is asked for; what was not asked for is None.

    loss    the loss, as cross_entropy returns it alone (on CUDA, with token_accuracy or
            predicted_tokens, to float32 rounding: they take another kernel, docs/numerics.md)
    lse     per-row log-sum-exp of the (soft-capped) logits, float32 (float64 for float64
            input), of target's shape for class ids (the rows' shape for class probabilities);
            0 on ignored rows; no gradient (a statistic, as the kernel saves it)
    z_loss  the z-loss term alone, reduced as the loss is (under mean, divided by the same sum
            of class weights of the rows not ignored), for logging; no gradient
    token_accuracy  the fraction of rows not ignored whose largest (soft-capped) logit is the
            target, float32 (Liger's definition): 0-d for reduction mean or sum (NaN when every
            row is ignored), per row (1.0 or 0.0; 0.0 on ignored rows) of target's shape for none
    predicted_tokens  each row's argmax (of the soft-capped logits; the first on ties, NaN
            counting as largest, as torch.argmax), int64 of target's shape (the rows' shape for
            class probabilities); -1 on ignored rows
    """

    loss: torch.Tensor
    lse: Optional[torch.Tensor] = None
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


# c10's names of the dtypes, as torch's messages print them.
_DTYPE_NAMES = {
    torch.float64: "Double",
    torch.float32: "Float",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
}


def _dtype_name(dtype):
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _raise_torchs_target_error(input, target):
    """Raises what torch's cross_entropy raises for a target of this dtype, whose wording differs
    between torch versions ("expected scalar type Long but found Bool", "expected target dtype to
    be Long or Byte, but got Bool"): torch's own call on one row of the same kind (class ids, or
    probabilities of the input's shape), on the input's device and dtype, so only the error path
    pays for it. Where that call does not raise (fake tensors under torch.compile, whose meta
    checks do not look at the dtype), xent's own message."""
    probabilities = target.shape == input.shape
    x = torch.zeros((1, 2), dtype=input.dtype, device=input.device)
    t = torch.zeros((1, 2) if probabilities else (1,), dtype=target.dtype, device=input.device)
    torch.nn.functional.cross_entropy(x, t)
    kind = "class probabilities of a floating point" if probabilities else "class ids of an integer"
    raise RuntimeError(
        f"xent.torch.cross_entropy: target must hold {kind} type, got {_dtype_name(target.dtype)}"
    )


def _rows(input, target):
    """(N, C) logits and (N,) class ids or (N, C) probabilities from torch's layouts (C), (N, C)
    and (N, C, d1, ...), and the rows' shape. As torch decides: a target of input's shape holds
    class probabilities, any other holds class ids; its checks, error types and messages."""
    shape = input.shape
    if target.shape == shape:
        if not target.is_floating_point():
            _raise_torchs_target_error(input, target)
        if len(shape) == 2:  # the common case first: nothing to move
            return input, target, shape[:1]
        if len(shape) == 1:
            return input.unsqueeze(0), target.unsqueeze(0), ()
        if not shape:
            raise IndexError(
                "Dimension out of range (expected to be in range of [-1, 0], but got 1)"
            )
        rows = shape[:1] + shape[2:]
        return (
            input.movedim(1, -1).reshape(-1, shape[1]),
            target.movedim(1, -1).reshape(-1, shape[1]),
            rows,
        )
    if target.dtype not in (torch.int64, torch.int32, torch.uint8):
        _raise_torchs_target_error(input, target)
    if len(shape) == 2:  # torch compares the batch sizes first (a 0-d target's is 0)
        batch = target.shape[0] if target.dim() else 0
        if batch != shape[0]:
            raise ValueError(
                f"Expected input batch_size ({shape[0]}) to match target batch_size ({batch})."
            )
        if target.dim() != 1:
            raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
        return input, target, shape[:1]
    if len(shape) == 1:  # unbatched: (C) against a 0-d class id
        if target.dim() != 0:
            raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
        return input.unsqueeze(0), target.unsqueeze(0), ()
    if not shape:
        raise IndexError("Dimension out of range (expected to be in range of [-1, 0], but got 1)")
    # (N, C, d1, ...): the class dimension moves last, so each (n, d1, ...) is a row.
    rows = shape[:1] + shape[2:]
    if target.shape != rows:
        if target.dim() >= 1 and target.shape[0] != shape[0]:
            raise ValueError(
                f"Expected input batch_size ({shape[0]}) to match target batch_size "
                f"({target.shape[0]})."
            )
        raise RuntimeError(f"Expected target size {list(rows)}, got {list(target.shape)}")
    return input.movedim(1, -1).reshape(-1, shape[1]), target.reshape(-1), rows


def _smoothing(label_smoothing):
    """torch's label_smoothing: above 1 raises RuntimeError; only a value > 0 smooths (a negative
    value, or NaN, is no smoothing)."""
    if label_smoothing > 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    return float(label_smoothing) if label_smoothing > 0.0 else 0.0


def _int64(name, value):
    """An integer argument as the ops' int64 takes it: an integer of any kind (a NumPy or 0-d
    tensor integer too) but a bool, else TypeError as torch raises (1.5 is not row 1); ValueError
    outside 64 bits."""
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if not -(2**63) <= v < 2**63:
        raise ValueError(f"{name} must fit in 64 bits, got {v}")
    return v


def _z_loss_term(lse, target, weight, ignore_index, code, z_loss, rows_shape):
    """z_loss * lse^2 per row (0 on ignored rows, whose lse is 0), reduced as the loss is."""
    term = lse.square().mul_(z_loss)
    if code == 0:
        return term.reshape(rows_shape)
    total = term.sum()
    if code == 2:
        return total
    if target.is_floating_point():
        return total / lse.shape[0]
    kept = target != ignore_index
    if weight is None:
        return total / kept.sum()
    return total / torch.where(kept, weight[target.clamp(0, weight.shape[0] - 1)], 0).sum()


def _token_accuracy(stats, argmax, target, ignore_index, code, rows_shape):
    """Liger's token accuracy from the kernel's side outputs: per row from the argmax (reduction
    none), else the count of rows predicted right (stats' last entry) over the rows not ignored."""
    kept = target != ignore_index
    if code == 0:
        return ((argmax == target) & kept).to(torch.float32).reshape(rows_shape)
    return stats[-1] / kept.sum()


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    size_average: Optional[bool] = None,
    ignore_index: int = -100,
    reduce: Optional[bool] = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    inplace_backward: bool = False,
    return_lse: bool = False,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
):
    """torch.nn.functional.cross_entropy, fused by xent: the same signature, positional order,
    layouts, targets and errors, plus keyword-only extensions.

    input: (C), (N, C) or (N, C, d1, ...) logits, float32, bfloat16 or float16 on the CPU or a
    CUDA device, or float64 on the CPU (float64 throughout: the reference for gradcheck; a
    float64 CUDA tensor raises TypeError). target: class ids of shape (), (N) or (N, d1, ...),
    int64, uint8 or int32; or class probabilities of input's shape (torch's semantics: label
    smoothing mixes them with the uniform distribution, mean divides by the row count,
    ignore_index must be negative), given no gradient. size_average and reduce are torch's
    deprecated arguments, mapped to `reduction` as torch maps them. (N, C) is read where it lies;
    (N, C, d1, ...) is read with the class dimension last (xent reads rows of classes), through a
    copy unless it is laid out so already.
    Extensions (keyword-only):
      z_loss            adds z_loss * logsumexp(x)^2 per row not ignored (PaLM)
      softcap           logits become softcap * tanh(x / softcap) first (Gemma 2); None is off
      inplace_backward  the gradient is written over `input`'s memory instead of a new tensor
                        (saves N x C elements). DANGER: the logits are destroyed; any other use of
                        them afterwards (another loss, a saved activation, logging) sees the
                        gradient. With reduction mean or sum under grad mode the FORWARD itself
                        overwrites them (as Liger does: see below), so they are gone as soon as
                        this call returns; with reduction none, backward does. Off by default
                        (Liger #272). Logits xent reads where they lie are overwritten: (C)
                        and (N, C) with contiguous classes, and (N, C, d1, ...) laid out as rows
                        of contiguous classes (input.movedim(1, -1).reshape(-1, C) is a view);
                        other layouts are copied, and the copy takes the gradient. A leaf that
                        requires grad raises RuntimeError (its values and .grad would share
                        memory).
      return_lse, return_z_loss  return a CrossEntropyOutput (loss, lse, z_loss) instead of the
                        loss alone: the per-row log-sum-exp, and the z-loss term reduced on its
                        own for logging (a few small ops over the per-row results, not the
                        logits); neither carries a gradient.
      return_token_accuracy, return_predicted_tokens  also return (in CrossEntropyOutput) the
                        token accuracy and each row's argmax, found by the kernel in the same pass
                        over the logits (no second read); class ids only for the accuracy.
    Training (grad mode on, input requiring grad, reduction mean or sum): the forward computes the
    gradient too, in one pass over the logits (xent::forward_backward, upstream 1), and keeps only
    that gradient for backward, never the logits or their softmax; backward multiplies it by the
    loss's gradient on the device (free when that is exactly 1, as in loss.backward()), in place;
    a backward with retain_graph=True (or create_graph=True) scales a copy, so a later one still
    works. Reduction none, and calls under no_grad, compute the loss alone; backward then reads
    the logits again. The loss has input's dtype; the arithmetic is float32 throughout (float64
    for float64 input). The options (label_smoothing, z_loss, softcap) and class weights are
    float32 values for every dtype, float64 included: a float64 reference should use values
    float32 holds exactly (0.25, not 0.1). On CUDA nothing synchronises with the host (the op can
    be captured in a CUDA graph); a class id out of range gives that row a NaN loss and is counted
    by cuda_target_errors() instead of raising IndexError as on the CPU.
    """
    # Every call pays for this function (its checks are evaluated once per trace under
    # torch.compile): the common (N, C) call compares torch.Size objects and Python numbers, and
    # calls nothing in torch that would return its argument unchanged.
    if size_average is not None or reduce is not None:
        reduction = _Reduction.legacy_get_string(size_average, reduce)
    code = _REDUCTIONS.get(reduction)
    if code is None:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    ignore_index = _int64("ignore_index", ignore_index)
    smoothing = _smoothing(label_smoothing)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    _check_devices("cross_entropy", input, "the input", (("target", target), ("weight", weight)))
    x, t, rows_shape = _rows(input, target)
    dtype = None
    if t.is_floating_point():
        if t.dtype != x.dtype:  # torch takes probabilities of any float dtype, and promotes
            dtype = torch.promote_types(x.dtype, t.dtype)
            t = t.to(x.dtype)
    elif t.dtype == torch.uint8:  # torch's other class-id dtype; xent reads int64 and int32
        t = t.long()
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[1]):
        raise RuntimeError(
            f"weight tensor should be defined either for all {x.shape[1]} classes or no classes "
            f"but got weight tensor of shape: {list(weight.shape)}"
        )
    _check_like_torch("cross_entropy", weight, "weight", target, ignore_index)
    if return_token_accuracy and t.is_floating_point():
        raise ValueError(
            "xent.torch.cross_entropy: return_token_accuracy needs class ids as target "
            "(class probabilities have no correct class)"
        )
    # torch's in-place rule: a leaf that requires grad, or a view of one, is not written over.
    base = input if input._base is None else input._base
    if inplace_backward and base.is_leaf and base.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "xent.torch.cross_entropy: inplace_backward=True would write the gradient over "
            f"input, {'a view of ' if base is not input else ''}a leaf tensor that requires grad "
            "(a parameter, say), so that its values and its .grad share memory; pass logits "
            "computed from it, or inplace_backward=False"
        )
    # The kernel's side outputs: each row's argmax (predicted tokens; per-row accuracy under
    # reduction none) and the count of rows predicted right (accuracy under mean or sum).
    want_argmax = return_predicted_tokens or (return_token_accuracy and code == 0)
    want_correct = return_token_accuracy and code != 0
    loss, lse, stats = _cross_entropy_fwd(
        x,
        t,
        weight,
        ignore_index,
        code,
        smoothing,
        float(z_loss),
        0.0 if softcap is None else float(softcap),
        bool(inplace_backward),
        bool(want_argmax),
        bool(want_correct),
    )
    if code == 0 and input.dim() != 2:
        loss = loss.reshape(rows_shape)
    loss = _result(loss, input, dtype)
    if not (return_lse or return_z_loss or want_argmax or want_correct):
        return loss
    lse = lse.detach()
    argmax = stats[: x.shape[0]] if want_argmax else None
    return CrossEntropyOutput(
        loss,
        lse.reshape(rows_shape) if return_lse else None,
        _z_loss_term(lse, t, weight, ignore_index, code, float(z_loss), rows_shape)
        if return_z_loss
        else None,
        _token_accuracy(stats, argmax, t, ignore_index, code, rows_shape)
        if return_token_accuracy
        else None,
        argmax.reshape(rows_shape) if return_predicted_tokens else None,
    )


# --- fused linear cross-entropy -------------------------------------------------------------------


def _check_linear_choices(choices):
    """The linear ops' refusal of order and accumulate codes outside _ORDERS and _ACCUMULATIONS
    (csrc/xent_ops.h) and of a sparse threshold outside [0, 1]; `choices` are the ops' trailing
    arguments, which default to 0."""
    order, accumulate, sparse_threshold = (*choices, 0, 0, 0.0)[:3]
    if order not in (0, 1, 2):
        raise ValueError(
            f"xent: order must be 0 (automatic), 1 (fast) or 2 (low_memory), got {order}"
        )
    if accumulate not in (0, 1):
        raise ValueError(f"xent: accumulate must be 0 (fp32) or 1 (output), got {accumulate}")
    _sparse_threshold(sparse_threshold)


# The linear ops' arguments after reduction: the loss options (label_smoothing, z_loss, softcap),
# then (linear_cross_entropy_bwd and _fwd_bwd) output_mask, then the training choices.
_LOSS_OPTIONS = 3


@torch.library.register_fake("xent::linear_cross_entropy_fwd")
def _linear_fwd_fake(hidden, weight, bias, target, class_weight, ignore_index, reduction, *rest):
    _check_linear_choices(rest[_LOSS_OPTIONS:])
    return _loss_and_lse_fake(hidden, reduction)


def _linear_grads_fake(hidden, weight, bias, rest):
    """The gradients of linear_cross_entropy_bwd and _fwd_bwd, whose arguments after reduction
    are `rest`: the loss options, output_mask, the training choices. A gradient not asked for
    (output_mask) is returned empty, (0,), as the kernels do."""
    _check_linear_choices(rest[_LOSS_OPTIONS + 1 :])
    output_mask = rest[_LOSS_OPTIONS]
    want_bias = output_mask[2] and bias is not None
    return (
        hidden.new_empty(hidden.shape if output_mask[0] else (0,)),
        weight.new_empty(weight.shape if output_mask[1] else (0,)),
        hidden.new_empty((weight.shape[0] if want_bias else 0,)),
    )


@torch.library.register_fake("xent::linear_cross_entropy_bwd")
def _linear_bwd_fake(grad_output, hidden, weight, bias, target, class_weight, lse, *rest):
    return _linear_grads_fake(hidden, weight, bias, rest[2:])  # after ignore_index, reduction


@torch.library.register_fake("xent::linear_cross_entropy_fwd_bwd")
def _linear_fwd_bwd_fake(
    hidden, weight, bias, target, class_weight, ignore_index, reduction, *rest
):
    _check_fused(reduction)
    grads = _linear_grads_fake(hidden, weight, bias, rest)
    return (*_loss_and_lse_fake(hidden, reduction), *grads)


def _linear_choice(name, value, codes):
    """The code of a training choice (order, accumulate), or ValueError naming the argument."""
    return choice_code(name, value, codes, "xent.torch")


def linear_cross_entropy(
    hidden,
    weight,
    target,
    bias=None,
    class_weight=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    *,
    order="automatic",
    accumulate="fp32",
    sparse_threshold=0.0,
):
    """cross_entropy(hidden @ weight.T + bias, target, ...) without materialising the logits.

    hidden (..., D), weight (V, D) (an LM head), bias (V,) or None, all of one dtype (float32,
    bfloat16 or float16; or float64 on the CPU, logits, GEMMs and gradient sums all in float64);
    target (...) class ids, int64 or int32, or (..., V) class
    probabilities as cross_entropy takes them. CPU or CUDA tensors (on CUDA: cuBLAS GEMMs with
    torch's handle, float accumulation; bf16 / fp16 logits are rounded to that dtype, as torch's
    F.linear does). class_weight is
    cross_entropy's `weight` (per-class weights); every other option is cross_entropy's.
    The logits are computed a chunk of rows at a time. Training (grad mode on, a tensor among
    hidden, weight and bias requiring grad, reduction mean or sum): the forward computes the loss
    and d_hidden, d_weight and d_bias in one call (xent::linear_forward_backward, each chunk's
    logits once) and keeps only those gradients for backward, which multiplies them by the loss's
    gradient on the device. Reduction none: the forward computes the loss
    (xent::linear_forward) and backward recomputes each chunk's logits from the saved per-row
    log-sum-exp (xent::linear_backward).

    The training call's memory (keyword-only; both apply to either training path, and a call
    that computes no gradient has one order). The call allocates, beyond its inputs, outputs and
    gradients, one workspace, whose size linear_workspace_bytes gives:
      order="automatic"  (default) the fast order: the workspace is sized for it
                         (xent::linear_order::automatic given the fast order's bytes).
      order="fast"       rows outer: each chunk's logits over the whole vocabulary, three GEMMs
                         (logits, G W, G^T X). Workspace: at most 256 MiB of row chunks, O(V),
                         and with accumulate="fp32" and 16-bit d_weight the V x D float sum of
                         d_weight (4 V D bytes).
      order="low_memory" the vocabulary outer, in panels: a forward pass for each row's LSE
                         (reduction none's backward has it), then per panel its logits for every
                         row and d_weight[panel] summed over all rows in float, written once.
                         Four GEMMs with reduction mean or sum, three with none. Exact, as fast
                         is; no V x D buffer. Workspace: at most 256 MiB of logit tiles, O(N),
                         a panel's buffers (up to P x D floats for P weight rows: 8192 on CUDA,
                         256 per CPU thread and at least 1024 on the CPU) and with 16-bit
                         d_hidden its N x D float sum (4 N D bytes).
      accumulate="fp32"  (default) the fast order sums d_weight across its row chunks in float
                         and rounds once.
      accumulate="output"  each chunk's float sum is added into d_weight and rounded, once per
                         chunk: no V x D float buffer, at up to half an ulp of d_weight's dtype
                         per chunk (how much that costs a training run is not measured yet).
                         The same as fp32 for float32 weights and in the low-memory order.
    A value outside these raises ValueError naming the argument.

    sparse_threshold (keyword-only, default 0.0: exact) is the low-memory order's sparse
    backward (xent::linear_options::sparse_threshold; Cut Cross-Entropy's gradient filtering):
    the gradient GEMMs skip each tile of rows x classes whose softmax probabilities are all below
    it and that holds no target. The loss is unchanged; each gradient moves by at most the
    skipped probabilities' terms (docs/numerics.md), and 2**-12 is a threshold to start from
    for bfloat16. A training call with a threshold runs the low-memory order (order="fast"
    raises). CUDA takes it with bfloat16 / float16 inputs, class-id targets, no label_smoothing
    or softcap and D a multiple of 8; the CPU with every option but softcap with label_smoothing.
    Elsewhere ValueError names sparse_threshold. A forward without gradients ignores it, but
    order="fast" with a threshold raises in every call.
    """
    loss = _linear_loss(
        hidden,
        weight,
        target,
        bias,
        class_weight,
        ignore_index,
        reduction,
        label_smoothing,
        z_loss,
        softcap,
        order=order,
        accumulate=accumulate,
        sparse_threshold=sparse_threshold,
    )
    return _result(loss, hidden)


def linear_workspace_bytes(
    hidden,
    weight,
    *,
    training=True,
    d_weight=True,
    order="automatic",
    accumulate="fp32",
    sparse_threshold=0.0,
):
    """The bytes of the workspace linear_cross_entropy allocates for its call on hidden (..., D)
    and weight (V, D) (their shapes, dtype and device; no values are read): a training call
    (training=True: the fused forward+backward, or reduction none's backward) computing d_weight
    or not (a frozen LM head needs no float sum of it), or a forward alone (training=False),
    with the given order, accumulate and sparse_threshold (linear_cross_entropy's). The workspace
    is all the call allocates beyond its inputs, outputs and gradients."""
    h = hidden.reshape(-1, hidden.shape[-1]) if hidden.dim() != 2 else hidden
    return torch.ops.xent.linear_workspace_bytes(
        h,
        weight,
        bool(training),
        bool(d_weight),
        _linear_choice("order", order, _ORDERS),
        _linear_choice("accumulate", accumulate, _ACCUMULATIONS),
        _sparse_threshold(sparse_threshold),
    )


def _linear_loss(
    hidden,
    weight,
    target,
    bias,
    class_weight,
    ignore_index,
    reduction,
    label_smoothing,
    z_loss,
    softcap,
    *,
    order="automatic",
    accumulate="fp32",
    sparse_threshold=0.0,
):
    """linear_cross_entropy's loss as the op computes it: float32 (float64 for float64 hidden)."""
    code = _REDUCTIONS.get(reduction)
    if code is None:
        raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
    ignore_index = _int64("ignore_index", ignore_index)
    smoothing = _smoothing(label_smoothing)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    order_code = _linear_choice("order", order, _ORDERS)
    accumulate_code = _linear_choice("accumulate", accumulate, _ACCUMULATIONS)
    threshold = _sparse_threshold(sparse_threshold)
    if hidden.dim() == 0:
        raise ValueError("hidden must be (..., D), got a 0-d tensor")
    shape = hidden.shape
    _check_devices(
        "linear_cross_entropy",
        hidden,
        "hidden",
        (("weight", weight), ("bias", bias), ("target", target), ("class_weight", class_weight)),
    )
    soft = target.is_floating_point()
    want = shape[:-1] + (weight.shape[:1] if soft else ())
    if target.shape != want:
        raise ValueError(
            f"target shape {tuple(target.shape)} must be {tuple(want)} (hidden's "
            f"shape without its last dimension{', then V' if soft else ''})"
        )
    _check_like_torch("linear_cross_entropy", class_weight, "class_weight", target, ignore_index)
    if len(shape) == 2:
        h, t = hidden, target
    else:
        h = hidden.reshape(-1, shape[-1])
        t = target.reshape(-1, weight.shape[0]) if soft else target.reshape(-1)
    loss = _linear_cross_entropy_fwd(
        h,
        weight,
        bias,
        t,
        class_weight,
        ignore_index,
        code,
        smoothing,
        float(z_loss),
        0.0 if softcap is None else float(softcap),
        order_code,
        accumulate_code,
        threshold,
    )[0]
    if code == 0 and len(shape) != 2:
        loss = loss.reshape(shape[:-1])
    return loss


# --- CUDA -----------------------------------------------------------------------------------------


def cuda_built():
    """Whether the package was built with its CUDA kernels (python/CMakeLists.txt)."""
    return _library.with_cuda


def cuda_target_errors(device=None):
    """The int32 0-d tensor on `device` (default: the current CUDA device) that every xent call on
    that device adds its count of out-of-range class ids to (rows whose target is neither
    ignore_index nor in [0, C); their loss is NaN). Reading it does not synchronise until you
    ask for its value; zero it with .zero_(). Call it once before capturing a CUDA graph so the
    counter exists when the capture starts (captured calls find it then)."""
    if not _library.with_cuda:
        raise RuntimeError("xent.torch was built without CUDA kernels")
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device is None
        else torch.device(device)
    )
    if device.type != "cuda":
        raise ValueError(f"cuda_target_errors needs a CUDA device, got {device}")
    return torch.ops.xent.cuda_target_errors(
        device.index if device.index is not None else torch.cuda.current_device()
    )
