"""xent_torch.cross_entropy: torch.ops.xent.* with autograd and fake kernels.

The C++ ops (csrc/xent_ops.cpp for the CPU, csrc/xent_ops_cuda.cu for CUDA) compute on 2-D (N, C)
logits; this module flattens (..., C) inputs, registers the fake (meta) kernels torch.compile
traces with and the autograd formula, and casts the float32 loss to the input's dtype.
"""

import torch

from . import _build

_build.load()

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


@torch.library.register_fake("xent::cross_entropy_fwd")
def _fwd_fake(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
              inplace_backward):
    n = input.shape[0]
    loss = input.new_empty((n,) if reduction == 0 else (), dtype=torch.float32)
    return loss, input.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("xent::cross_entropy_bwd")
def _bwd_fake(grad_output, input, target, weight, lse, ignore_index, reduction, label_smoothing,
              z_loss, softcap):
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.register_fake("xent::cross_entropy_bwd_")
def _bwd_inplace_fake(grad_output, input, target, weight, lse, ignore_index, reduction,
                      label_smoothing, z_loss, softcap):
    return None


def _rows_writable(x):
    """Whether the C++ op can write a gradient over x row by row (its rows_view(x) is x)."""
    n, c = x.shape
    return (c <= 1 or x.stride(1) == 1) and (n <= 1 or x.stride(0) >= c)


def _setup_context(ctx, inputs, output):
    input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, inplace = inputs
    ctx.save_for_backward(input, target, weight, output[1])
    ctx.options = (ignore_index, reduction, label_smoothing, z_loss, softcap)
    ctx.inplace = inplace


def _backward(ctx, grad_loss, grad_lse):
    # grad_lse is ignored: lse is a saved statistic, not a differentiable result.
    input, target, weight, lse = ctx.saved_tensors
    args = (grad_loss, input, target, weight, lse, *ctx.options)
    # In place needs rows with a contiguous last dimension (and rows that do not overlap); other
    # layouts get a fresh gradient (the result is the same, only the memory saving is lost).
    if ctx.inplace and _rows_writable(input):
        torch.ops.xent.cross_entropy_bwd_(*args)
        # The kernel wrote through a pointer, which autograd cannot see: bump the version counter so
        # that a backward which saved these logits (e.g. tanh's output) fails loudly instead of
        # reading the gradient as if it were the logits.
        if not torch.compiler.is_compiling():
            torch.autograd.graph.increment_version(input)
        grad = input
    else:
        grad = torch.ops.xent.cross_entropy_bwd(*args)
    return grad, None, None, None, None, None, None, None, None


torch.library.register_autograd("xent::cross_entropy_fwd", _backward, setup_context=_setup_context)


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, z_loss=0.0, softcap=None, inplace_backward=False):
    """Cross-entropy of logits `input` (..., C) against `target`, fused by xent.

    Matches torch.nn.functional.cross_entropy for weight, ignore_index, reduction and
    label_smoothing, with the class dimension LAST (language-model layout: (N, C), (B, T, C));
    torch's own (N, C, d1, ...) layout is not accepted. input: float32, bfloat16 or float16 (no
    float64: xent accumulates in float32), on the CPU or a CUDA device. target: class ids (...),
    int64 or int32; or class probabilities of input's shape (soft targets, torch's semantics:
    label smoothing mixes them with the uniform distribution, mean divides by the row count,
    ignore_index does not apply), held in input's dtype and given no gradient. Extensions:
      z_loss            adds z_loss * logsumexp(x)^2 per row not ignored (PaLM)
      softcap           logits become softcap * tanh(x / softcap) first (Gemma 2); None is off
      inplace_backward  backward writes the gradient over `input`'s memory instead of a new
                        tensor (saves N x C elements). DANGER: the logits are destroyed; any other
                        use of them afterwards (another loss, a saved activation, logging) sees the
                        gradient. Off by default (Liger #272). Inputs whose last dimension is not
                        contiguous get an out-of-place gradient.
    The reduced loss has input's dtype; the arithmetic is float32 throughout. On CUDA nothing
    synchronises with the host (the op can be captured in a CUDA graph); a class id out of range
    gives that row a NaN loss and is counted by cuda_target_errors() instead of raising
    IndexError as on the CPU.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if input.dim() < 1:
        raise ValueError("input must have a class dimension")
    soft = target.is_floating_point()
    if soft:
        if tuple(target.shape) != tuple(input.shape):
            raise ValueError(f"soft targets (class probabilities) must have input's shape "
                             f"{tuple(input.shape)}, got {tuple(target.shape)}")
        if target.requires_grad and torch.is_grad_enabled():
            raise ValueError("xent gives soft targets no gradient: pass target.detach()")
    elif tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must be input shape without its "
                         f"last (class) dimension, {tuple(input.shape[:-1])}")
    classes = input.shape[-1]
    x = input if input.dim() == 2 else input.reshape(-1, classes)
    t = target.reshape(-1, classes) if soft else target.reshape(-1)
    loss, _ = torch.ops.xent.cross_entropy_fwd(
        x, t, weight, int(ignore_index), _REDUCTIONS[reduction], float(label_smoothing),
        float(z_loss), 0.0 if softcap is None else float(softcap), bool(inplace_backward))
    if reduction == "none":
        loss = loss.reshape(input.shape[:-1])
    return loss.to(input.dtype)


# --- fused linear cross-entropy --------------------------------------------------------------------


@torch.library.register_fake("xent::linear_cross_entropy_fwd")
def _linear_fwd_fake(hidden, weight, bias, target, class_weight, ignore_index, reduction,
                     label_smoothing, z_loss, softcap):
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction == 0 else (), dtype=torch.float32)
    return loss, hidden.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("xent::linear_cross_entropy_bwd")
def _linear_bwd_fake(grad_output, hidden, weight, bias, target, class_weight, lse, ignore_index,
                     reduction, label_smoothing, z_loss, softcap):
    d_bias = hidden.new_empty((weight.shape[0] if bias is not None else 0,))
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), d_bias


def _linear_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, class_weight, *options = inputs
    ctx.save_for_backward(hidden, weight, bias, target, class_weight, output[1])
    ctx.options = tuple(options)


def _linear_backward(ctx, grad_loss, grad_lse):
    hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
    d_hidden, d_weight, d_bias = torch.ops.xent.linear_cross_entropy_bwd(
        grad_loss, hidden, weight, bias, target, class_weight, lse, *ctx.options)
    return (d_hidden, d_weight, d_bias if bias is not None else None, None, None, None, None,
            None, None, None)


torch.library.register_autograd("xent::linear_cross_entropy_fwd", _linear_backward,
                                setup_context=_linear_setup_context)


def linear_cross_entropy(hidden, weight, target, bias=None, class_weight=None, ignore_index=-100,
                         reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None):
    """cross_entropy(hidden @ weight.T + bias, target, ...) without materialising the logits.

    hidden (..., D), weight (V, D) (an LM head), bias (V,) or None, all of one dtype (float32,
    bfloat16 or float16); target (...) class ids, int64 or int32, or (..., V) class
    probabilities as cross_entropy takes them. CPU or CUDA tensors (on CUDA: cuBLAS GEMMs with
    torch's handle, float accumulation; bf16 / fp16 logits are rounded to that dtype, as torch's
    F.linear does). class_weight is
    cross_entropy's `weight` (per-class weights); every other option is cross_entropy's.
    The logits are computed a chunk of rows at a time (xent::linear_forward) and recomputed in
    backward (xent::linear_backward) from the saved per-row log-sum-exp.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    soft = target.is_floating_point()
    want = tuple(hidden.shape[:-1]) + ((weight.shape[0],) if soft else ())
    if tuple(target.shape) != want:
        raise ValueError(f"target shape {tuple(target.shape)} must be {want} (hidden's shape "
                         f"without its last dimension{', then V' if soft else ''})")
    if soft and target.requires_grad and torch.is_grad_enabled():
        raise ValueError("xent gives soft targets no gradient: pass target.detach()")
    h = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1, weight.shape[0]) if soft else target.reshape(-1)
    loss, _ = torch.ops.xent.linear_cross_entropy_fwd(
        h, weight, bias, t, class_weight, int(ignore_index),
        _REDUCTIONS[reduction], float(label_smoothing), float(z_loss),
        0.0 if softcap is None else float(softcap))
    if reduction == "none":
        loss = loss.reshape(hidden.shape[:-1])
    return loss.to(hidden.dtype)


# --- CUDA -----------------------------------------------------------------------------------------


def cuda_built():
    """Whether the extension was built with its CUDA kernels (see _build.py)."""
    return _build.with_cuda


def cuda_target_errors(device=None):
    """The int32 0-d tensor on `device` (default: the current CUDA device) that every xent call on
    that device adds its count of out-of-range class ids to (rows whose target is neither
    ignore_index nor in [0, C); their loss is NaN). Reading it does not synchronise until you
    ask for its value; zero it with .zero_(). Call it once before capturing a CUDA graph so the
    counter exists when the capture starts (captured calls find it then)."""
    if not _build.with_cuda:
        raise RuntimeError("xent_torch was built without CUDA kernels")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else \
        torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"cuda_target_errors needs a CUDA device, got {device}")
    return torch.ops.xent.cuda_target_errors(
        device.index if device.index is not None else torch.cuda.current_device())
