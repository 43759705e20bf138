"""Token accuracy and predicted tokens, xent.torch.cross_entropy's side outputs from the kernel's
pass over the logits, against torch: torch.argmax of the (soft-capped) logits (the first index on
ties, NaN counting as largest) and Liger's accuracy (rows not ignored whose argmax is the target,
over the rows not ignored). On the CPU and, when a GPU is visible and the extension has its CUDA
kernels, on CUDA; with and without a node recorded (the fused training pass and the forward
alone), in every reduction, and with the loss they come with unchanged: to the bit on the CPU,
to float32 rounding on CUDA (agreement says why).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import xent.torch
from test_cross_entropy import DEVICES, requires_cuda

C = 37
N = 23


def inputs(shape=(N, C), dtype=torch.float32, ties=False, seed=0):
    """Logits and class ids with some rows ignored; with `ties`, small integers, so most rows
    hold their largest value more than once."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(0, 3, shape, generator=g).float()
    else:
        x = torch.randn(shape, generator=g) * 3
    rows = shape[:1] + shape[2:]
    t = torch.randint(0, shape[1], rows, generator=g)
    # Some targets are the argmax, so the accuracy is neither 0 nor 1.
    t = torch.where(torch.rand(rows, generator=g) < 0.5, x.argmax(1), t)
    t.view(-1)[::5] = -100
    return x.to(dtype), t


def expected(x, t, reduction, ignore_index=-100, softcap=None):
    """torch's argmax (-1 on ignored rows) and Liger's token accuracy."""
    z = x.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    kept = t != ignore_index
    predicted = torch.where(kept, z.argmax(1), -1)
    right = (predicted == t) & kept
    if reduction == "none":
        return predicted, right.float()
    return predicted, right.sum() / kept.sum()


def agreement(x, t, device, reduction, **kw):
    """How closely the loss (rtol, atol) and the gradient (rtol, atol) of a call with side
    outputs agree with the same call without them. On the CPU one sweep computes both: to the
    bit. On CUDA the calls without side outputs take the kernels without option paths
    (include/xent/cuda/dispatch/rows.cuh), which have no argmax; asking for one takes the row
    kernel with option paths, whose float32 sums run in another order: the two agree to float32
    rounding, not to the bit (docs/numerics.md). Each is within the oracle tests' 2e-6 of the
    terms a row's loss is made of (|z| and its LSE, at most max |z| + log C), so they are within
    twice that: per row (times the rows for a sum); relative to each p_j of the gradient, and
    absolutely for its target term, times the row's scale (upstream, weight, z-loss). Plus one
    rounding of a 16-bit loss or gradient."""
    if device == "cpu":
        return (0.0, 0.0), (0.0, 0.0)
    terms = x.float().abs().amax().item() + math.log(x.shape[1])
    tol = 4e-6 * terms
    kept = t != kw.get("ignore_index", -100)
    w = kw.get("weight")
    weight_sum = kept.sum().item() if w is None else w.cpu()[t[kept]].sum().item()
    row_scale = (1.0 if w is None else w.max().item()) + 2 * kw.get("z_loss", 0.0) * terms
    if reduction == "mean":
        row_scale /= weight_sum
    rows = kept.sum().item() if reduction == "sum" else 1
    rounding = torch.finfo(x.dtype).eps if x.dtype.itemsize == 2 else 0.0
    return (rounding, tol * rows), (tol + rounding, tol * row_scale)


def check(x, t, device, reduction, grad, **kw):
    (loss_rtol, loss_atol), (grad_rtol, grad_atol) = agreement(x, t, device, reduction, **kw)
    x, t = x.to(device), t.to(device)
    leaf = x.clone().requires_grad_(grad)
    out = xent.torch.cross_entropy(
        leaf, t, reduction=reduction, return_token_accuracy=True, return_predicted_tokens=True, **kw
    )
    predicted, accuracy = expected(x.cpu(), t.cpu(), reduction, softcap=kw.get("softcap"))
    assert out.predicted_tokens.dtype == torch.int64 and out.predicted_tokens.shape == t.shape
    assert torch.equal(out.predicted_tokens.cpu(), predicted)
    assert out.token_accuracy.dtype == torch.float32
    torch.testing.assert_close(out.token_accuracy.cpu(), accuracy, rtol=0, atol=0)
    assert out.token_accuracy.grad_fn is None and out.predicted_tokens.grad_fn is None
    # The loss is the one the call gives without side outputs, and so is its gradient.
    alone = x.clone().requires_grad_(grad)
    loss = xent.torch.cross_entropy(alone, t, reduction=reduction, **kw)
    torch.testing.assert_close(out.loss, loss, rtol=loss_rtol, atol=loss_atol)
    if grad:
        out.loss.sum().backward()
        loss.sum().backward()
        torch.testing.assert_close(leaf.grad, alone.grad, rtol=grad_rtol, atol=grad_atol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("device", DEVICES)
def test_match_torch_argmax_and_liger_accuracy(reduction, grad, device):
    x, t = inputs()
    check(x, t, device, reduction, grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("device", DEVICES)
def test_ties_go_to_the_first_index(dtype, grad, device):
    x, t = inputs(ties=True, dtype=dtype)
    assert ((x == x.max(1, keepdim=True).values).sum(1) > 1).any()
    check(x, t, device, "mean", grad)
    check(x, t, device, "none", grad)


@pytest.mark.parametrize("device", DEVICES)
def test_of_the_soft_capped_logits_with_label_smoothing_and_weights(device):
    x, t = inputs()
    w = torch.rand(C) + 0.5
    kw = dict(softcap=4.0, label_smoothing=0.1, z_loss=1e-3, weight=w.to(device))
    for reduction in ("mean", "none"):
        check(x, t, device, reduction, True, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_counts_as_largest(device):
    x, t = inputs()
    x[3, 7] = float("nan")
    x[4, 2] = x[4, 30] = float("nan")
    t[3], t[4] = 7, 30
    out = xent.torch.cross_entropy(
        x.to(device), t.to(device), reduction="none", return_predicted_tokens=True
    )
    assert out.predicted_tokens[3] == 7 and out.predicted_tokens[4] == 2
    assert torch.equal(out.predicted_tokens.cpu(), expected(x, t, "none")[0])


@pytest.mark.parametrize("device", DEVICES)
def test_torch_layout_and_an_ignore_index_that_is_a_class(device):
    x, t = inputs(shape=(3, C, 5))
    xr = x.movedim(1, -1).reshape(-1, C)
    for ignore_index in (-100, 4):
        t = torch.where(t == -100, ignore_index, t)
        out = xent.torch.cross_entropy(
            x.to(device),
            t.to(device),
            ignore_index=ignore_index,
            reduction="none",
            return_token_accuracy=True,
            return_predicted_tokens=True,
        )
        predicted, accuracy = expected(xr, t.reshape(-1), "none", ignore_index)
        assert out.predicted_tokens.shape == t.shape
        assert torch.equal(out.predicted_tokens.cpu().reshape(-1), predicted)
        torch.testing.assert_close(out.token_accuracy.cpu().reshape(-1), accuracy)
        mean = xent.torch.cross_entropy(
            x.to(device), t.to(device), ignore_index=ignore_index, return_token_accuracy=True
        )
        torch.testing.assert_close(
            mean.token_accuracy.cpu(), expected(xr, t.reshape(-1), "mean", ignore_index)[1]
        )


@pytest.mark.parametrize("device", DEVICES)
def test_every_row_ignored(device):
    x, t = inputs()
    t[:] = -100
    out = xent.torch.cross_entropy(
        x.to(device), t.to(device), return_token_accuracy=True, return_predicted_tokens=True
    )
    assert out.token_accuracy.isnan()
    assert (out.predicted_tokens == -1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_with_inplace_backward(device):
    x, t = inputs()
    leaf = x.to(device).clone().requires_grad_()
    logits = leaf * 1.0
    out = xent.torch.cross_entropy(
        logits,
        t.to(device),
        inplace_backward=True,
        return_token_accuracy=True,
        return_predicted_tokens=True,
    )
    # Found before the gradient overwrote the logits.
    predicted, accuracy = expected(x, t, "mean")
    assert torch.equal(out.predicted_tokens.cpu(), predicted)
    torch.testing.assert_close(out.token_accuracy.cpu(), accuracy)
    out.loss.backward()
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref, t).backward()
    torch.testing.assert_close(leaf.grad.cpu(), ref.grad)


def test_predicted_tokens_of_class_probabilities_and_no_accuracy():
    x, _ = inputs()
    p = torch.softmax(torch.randn(N, C), dim=1)
    out = xent.torch.cross_entropy(x, p, return_predicted_tokens=True)
    assert torch.equal(out.predicted_tokens, x.argmax(1))
    with pytest.raises(ValueError, match="class ids"):
        xent.torch.cross_entropy(x, p, return_token_accuracy=True)


def test_module_returns_them():
    x, t = inputs()
    loss = xent.torch.CrossEntropyLoss(return_token_accuracy=True, return_predicted_tokens=True)
    out = loss(x, t)
    predicted, accuracy = expected(x, t, "mean")
    assert torch.equal(out.predicted_tokens, predicted)
    torch.testing.assert_close(out.token_accuracy, accuracy)
    assert out.lse is None and out.z_loss is None


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    x, t = inputs()
    x, t = x.to(device), t.to(device)

    def fn(a, b):
        out = xent.torch.cross_entropy(
            a, b, return_token_accuracy=True, return_predicted_tokens=True
        )
        return out.loss, out.token_accuracy, out.predicted_tokens

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaf = x.clone().requires_grad_()
    loss, accuracy, predicted = compiled(leaf, t)
    loss.backward()
    want_predicted, want_accuracy = expected(x.cpu(), t.cpu(), "mean")
    assert torch.equal(predicted.cpu(), want_predicted)
    torch.testing.assert_close(accuracy.cpu(), want_accuracy)
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref, t).backward()
    torch.testing.assert_close(leaf.grad, ref.grad)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "training"])
def test_opcheck_with_side_outputs(grad):
    x, t = inputs(shape=(6, 9))
    x = x.clone().requires_grad_(grad)
    for reduction in (0, 1, 2):
        for flags in ((True, False), (False, True), (True, True)):
            torch.library.opcheck(
                torch.ops.xent.cross_entropy_fwd.default,
                (x, t, None, -100, reduction, 0.0, 0.0, 0.0, False, *flags),
            )
            if reduction:
                torch.library.opcheck(
                    torch.ops.xent.cross_entropy_fwd_bwd.default,
                    (x.detach(), t, None, -100, reduction, 0.0, 0.0, 0.0, *flags),
                )


@requires_cuda
def test_cuda_graph_capture():
    x, t = inputs()
    x, t = x.cuda(), t.cuda()
    out = xent.torch.cross_entropy(x, t, return_token_accuracy=True)  # warm-up, outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = xent.torch.cross_entropy(
            x, t, return_token_accuracy=True, return_predicted_tokens=True
        )
    graph.replay()
    predicted, accuracy = expected(x.cpu(), t.cpu(), "mean")
    assert torch.equal(out.predicted_tokens.cpu(), predicted)
    torch.testing.assert_close(out.token_accuracy.cpu(), accuracy)
