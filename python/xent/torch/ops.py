"""xent.torch.cross_entropy and linear_cross_entropy: torch.ops.xent.* with fake kernels.

The C++ ops (csrc/xent_ops.cpp for the CPU, csrc/xent_ops_cuda.cu for CUDA) compute on 2-D (N, C)
logits, and their autograd formulas are C++ too (csrc/xent_autograd.cpp: one dispatcher call
forward, one C++ node backward, no Python in either; a training call with a reduced loss runs the
fused *_fwd_bwd op forward and scale_grad_ backward). This module checks the arguments with
torch's error types, flattens (..., C) inputs, registers the fake (meta) kernels torch.compile
traces with, and casts the loss (float32; float64 for float64 inputs, which run on the CPU only)
to the input's dtype.
"""

import torch

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


@torch.library.register_fake("xent::cross_entropy_fwd")
def _fwd_fake(
    input,
    target,
    weight,
    ignore_index,
    reduction,
    label_smoothing,
    z_loss,
    softcap,
    inplace_backward,
):
    return _loss_and_lse_fake(input, reduction)


@torch.library.register_fake("xent::cross_entropy_bwd")
def _bwd_fake(
    grad_output,
    input,
    target,
    weight,
    lse,
    ignore_index,
    reduction,
    label_smoothing,
    z_loss,
    softcap,
):
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.register_fake("xent::cross_entropy_bwd_")
def _bwd_inplace_fake(
    grad_output,
    input,
    target,
    weight,
    lse,
    ignore_index,
    reduction,
    label_smoothing,
    z_loss,
    softcap,
):
    return None


def _check_fused(reduction):
    """The fused ops' refusal of reduction none (csrc/xent_ops.h, check_fused_reduction)."""
    if reduction == 0:
        raise ValueError(
            "xent: a fused forward+backward needs reduction mean or sum (with none, "
            "each row's upstream gradient is known only in backward)"
        )


@torch.library.register_fake("xent::cross_entropy_fwd_bwd")
def _fwd_bwd_fake(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap):
    _check_fused(reduction)
    loss, lse = _fwd_fake(
        input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, False
    )
    return loss, lse, torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.register_fake("xent::cross_entropy_fwd_bwd_")
def _fwd_bwd_inplace_fake(
    input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap
):
    _check_fused(reduction)
    return _fwd_fake(
        input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, False
    )


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
        raise ValueError(
            f"xent.torch.{fn}: {name} gets no gradient (as in torch's "
            f"cross_entropy): pass {name}.detach()"
        )
    if target.is_floating_point():
        if target.requires_grad and torch.is_grad_enabled():
            raise ValueError("xent gives soft targets no gradient: pass target.detach()")
        if ignore_index >= 0:
            raise ValueError(
                "ignore_index is not supported for floating point target (soft "
                f"targets), got {ignore_index}"
            )


def _result(loss, x):
    """The loss in x's dtype, as torch gives it; under autocast in float32 (what the op computed),
    as torch's cross_entropy, which autocast runs in float32."""
    if loss.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return loss
    return loss.to(x.dtype)


def cross_entropy(
    input,
    target,
    weight=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    inplace_backward=False,
):
    """Cross-entropy of logits `input` (..., C) against `target`, fused by xent.

    Matches torch.nn.functional.cross_entropy for weight, ignore_index, reduction and
    label_smoothing, with the class dimension LAST (language-model layout: (N, C), (B, T, C));
    torch's own (N, C, d1, ...) layout is not accepted. input: float32, bfloat16 or float16 on the
    CPU or a CUDA device, or float64 on the CPU (computed in float64 throughout: the reference for
    torch.autograd.gradcheck; a float64 CUDA tensor raises TypeError). target: class ids (...),
    int64 or int32; or class probabilities of input's shape (soft targets, torch's semantics:
    label smoothing mixes them with the uniform distribution, mean divides by the row count,
    ignore_index must be negative, as torch requires), held in input's dtype and given no
    gradient. Extensions:
      z_loss            adds z_loss * logsumexp(x)^2 per row not ignored (PaLM)
      softcap           logits become softcap * tanh(x / softcap) first (Gemma 2); None is off
      inplace_backward  the gradient is written over `input`'s memory instead of a new tensor
                        (saves N x C elements). DANGER: the logits are destroyed; any other use of
                        them afterwards (another loss, a saved activation, logging) sees the
                        gradient. With reduction mean or sum under grad mode the FORWARD itself
                        overwrites them (as Liger does: see below), so they are gone as soon as
                        this call returns; with reduction none, backward does. Off by default
                        (Liger #272). Inputs whose last dimension is not contiguous get an
                        out-of-place gradient.
    Training (grad mode on, input requiring grad, reduction mean or sum): the forward computes the
    gradient too, in one pass over the logits (xent::forward_backward, upstream 1), and keeps only
    that gradient for backward, not the logits; backward multiplies it by the loss's gradient on
    the device (free when that is exactly 1, as in loss.backward()), in place; a backward with
    retain_graph=True (or create_graph=True) scales a copy, so a later one still works. Reduction
    none, and calls under no_grad, compute the loss alone; backward then reads the logits again.
    The reduced loss has input's dtype; the arithmetic is float32 throughout (float64 for float64
    input). The options (label_smoothing, z_loss, softcap) and class weights are float32 values
    for every dtype, float64 included: a float64 reference should use values float32 holds
    exactly (0.25, not 0.1). On CUDA nothing
    synchronises with the host (the op can be captured in a CUDA graph); a class id out of range
    gives that row a NaN loss and is counted by cuda_target_errors() instead of raising
    IndexError as on the CPU.
    """
    # Every call pays for this function (its checks are evaluated once per trace under
    # torch.compile): the checks compare torch.Size objects, and nothing calls into torch (a
    # reshape, a .to()) that would return its argument unchanged.
    code = _REDUCTIONS.get(reduction)
    if code is None:
        raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    shape = input.shape
    if not shape:
        raise ValueError("input must have a class dimension")
    _check_devices("cross_entropy", input, "the input", (("target", target), ("weight", weight)))
    if target.is_floating_point():
        if target.shape != shape:
            raise ValueError(
                f"soft targets (class probabilities) must have input's shape "
                f"{tuple(shape)}, got {tuple(target.shape)}"
            )
        t = target if len(shape) == 2 else target.reshape(-1, shape[-1])
    else:
        if target.shape != shape[:-1]:
            raise ValueError(
                f"target shape {tuple(target.shape)} must be input shape without its "
                f"last (class) dimension, {tuple(shape[:-1])}"
            )
        t = target if len(shape) == 2 else target.reshape(-1)
    _check_like_torch("cross_entropy", weight, "weight", target, ignore_index)
    x = input if len(shape) == 2 else input.reshape(-1, shape[-1])
    loss = _cross_entropy_fwd(
        x,
        t,
        weight,
        int(ignore_index),
        code,
        float(label_smoothing),
        float(z_loss),
        0.0 if softcap is None else float(softcap),
        bool(inplace_backward),
    )[0]
    if code == 0 and len(shape) != 2:
        loss = loss.reshape(shape[:-1])
    return _result(loss, input)


# --- fused linear cross-entropy --------------------------------------------------------------------


@torch.library.register_fake("xent::linear_cross_entropy_fwd")
def _linear_fwd_fake(
    hidden,
    weight,
    bias,
    target,
    class_weight,
    ignore_index,
    reduction,
    label_smoothing,
    z_loss,
    softcap,
):
    return _loss_and_lse_fake(hidden, reduction)


@torch.library.register_fake("xent::linear_cross_entropy_bwd")
def _linear_bwd_fake(
    grad_output,
    hidden,
    weight,
    bias,
    target,
    class_weight,
    lse,
    ignore_index,
    reduction,
    label_smoothing,
    z_loss,
    softcap,
    output_mask,
):
    # A gradient not asked for (output_mask) is returned empty, (0,), as the kernels do.
    want_bias = output_mask[2] and bias is not None
    return (
        hidden.new_empty(hidden.shape if output_mask[0] else (0,)),
        weight.new_empty(weight.shape if output_mask[1] else (0,)),
        hidden.new_empty((weight.shape[0] if want_bias else 0,)),
    )


@torch.library.register_fake("xent::linear_cross_entropy_fwd_bwd")
def _linear_fwd_bwd_fake(
    hidden,
    weight,
    bias,
    target,
    class_weight,
    ignore_index,
    reduction,
    label_smoothing,
    z_loss,
    softcap,
    output_mask,
):
    _check_fused(reduction)
    args = (
        hidden,
        weight,
        bias,
        target,
        class_weight,
        ignore_index,
        reduction,
        label_smoothing,
        z_loss,
        softcap,
    )
    return (
        *_linear_fwd_fake(*args),
        *_linear_bwd_fake(
            None, hidden, weight, bias, target, class_weight, None, *args[5:], output_mask
        ),
    )


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
    """
    code = _REDUCTIONS.get(reduction)
    if code is None:
        raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
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
        int(ignore_index),
        code,
        float(label_smoothing),
        float(z_loss),
        0.0 if softcap is None else float(softcap),
    )[0]
    if code == 0 and len(shape) != 2:
        loss = loss.reshape(shape[:-1])
    return _result(loss, hidden)


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
