"""xent.torch.linear_cross_entropy's sparse backward (sparse_threshold): on inputs shaped like a
trained model's, so that tiles are skipped, the loss is the exact call's and every gradient stays
within the bound of the skipped probabilities (docs/numerics.md) of the exact one, computed in
float64; on the fused path (reduction mean / sum) and the split one (none); the ops, their fake
kernels and the module pass it on; bad values and the calls that refuse it raise ValueError
naming it."""

import pytest
import torch

import test_linear_cross_entropy as lin  # loads xent.torch
import xent.torch
from test_cross_entropy import requires_cuda

# Three row tiles (64 rows) and a part, five 256-class blocks and a part.
N, D, V = 150, 48, 1300
TAU = 1.0 / 32


def trained(dtype=torch.float32, seed=0):
    """Each row's hidden state points at its target's weight row (targets among the first 40
    classes), so its softmax is peaked there and the other blocks' tiles are cold; every seventh
    row ignored."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=g) / D**0.5
    target = torch.randint(0, 40, (N,), generator=g)
    w_t = weight[target]
    hidden = 14.0 * w_t / w_t.pow(2).sum(-1, keepdim=True) + 0.05 * torch.randn(N, D, generator=g)
    target[::7] = -100
    return hidden.to(dtype), weight.to(dtype), target


def training(hidden, weight, target, reduction, **kw):
    """Loss and (d_hidden, d_weight) with upstream 1 (each row's for reduction none)."""
    h, w = (a.detach().clone().requires_grad_() for a in (hidden, weight))
    loss = xent.torch.linear_cross_entropy(h, w, target, reduction=reduction, **kw)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), h.grad, w.grad


def skipped_bound(hidden, weight, target, reduction, tau):
    """What dropping every g_n p_nj with p_nj < tau can move d_hidden and d_weight by."""
    z = hidden.double() @ weight.double().T
    p = torch.softmax(z, -1)
    valid = (target != -100).double()
    g = valid / valid.sum() if reduction == "mean" else valid
    drop = torch.where(p < tau, p, torch.zeros_like(p)) * g[:, None]
    return drop @ weight.double().abs(), drop.T @ hidden.double().abs()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("order", ["automatic", "low_memory"])
def test_loss_unchanged_and_gradients_within_the_bound(reduction, order):
    hidden, weight, target = trained()
    exact = training(hidden, weight, target, reduction, order="low_memory")
    sparse = training(hidden, weight, target, reduction, order=order, sparse_threshold=TAU)
    assert torch.equal(sparse[0], exact[0])
    bounds = skipped_bound(hidden, weight, target, reduction, TAU)
    moved = False
    for got, want, bound in zip(sparse[1:], exact[1:], bounds):
        slack = 1e-5 * want.abs().max().item()  # float32 sums over other tile sets
        assert ((got - want).double().abs() <= bound + slack).all()
        moved |= not torch.equal(got, want)
    assert moved, "no gradient moved: no tile was skipped"


def test_bfloat16_within_the_bound():
    hidden, weight, target = trained(torch.bfloat16)
    exact = training(hidden, weight, target, "mean", order="low_memory")
    sparse = training(hidden, weight, target, "mean", sparse_threshold=TAU)
    assert torch.equal(sparse[0], exact[0])
    bounds = skipped_bound(hidden, weight, target, "mean", TAU)
    for got, want, bound in zip(sparse[1:], exact[1:], bounds):
        # One bf16 rounding of each result on top (2^-8 of the element) and of the bound's terms.
        slack = 2.0**-7 * (want.double().abs() + bound) + 1e-3 * want.abs().max().item()
        assert ((got.double() - want.double()).abs() <= bound + slack).all()


def test_zero_is_the_exact_call_bit_for_bit():
    hidden, weight, target = trained()
    a = training(hidden, weight, target, "mean", order="low_memory")
    b = training(hidden, weight, target, "mean", order="low_memory", sparse_threshold=0.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_module_and_ops_pass_the_threshold_on():
    hidden, weight, target = trained()
    module = xent.torch.LinearCrossEntropyLoss(reduction="sum", sparse_threshold=TAU)
    assert "sparse_threshold=0.03125" in repr(module)
    h = hidden.clone().requires_grad_()
    module(h, weight, target).backward()
    assert torch.equal(h.grad, training(hidden, weight, target, "sum", sparse_threshold=TAU)[1])
    # The fused op with and without it, and its fake kernel.
    args = (hidden, weight, None, target, None, -100, 2, 0.0, 0.0, 0.0, [True, True, False], 2, 0)
    exact = torch.ops.xent.linear_cross_entropy_fwd_bwd(*args)
    sparse = torch.ops.xent.linear_cross_entropy_fwd_bwd(*args, TAU)
    assert torch.equal(exact[0], sparse[0]) and not torch.equal(exact[2], sparse[2])
    torch.library.opcheck(torch.ops.xent.linear_cross_entropy_fwd_bwd.default, (*args, TAU))
    small = lin.make(n=6, d=4, v=9)
    torch.library.opcheck(
        torch.ops.xent.linear_cross_entropy_fwd.default,
        (small[0].clone().requires_grad_(), small[1].clone().requires_grad_(), small[2])
        + (small[3], None, -100, 0, 0.0, 0.0, 0.0, 2, 0, TAU),
    )
    assert xent.torch.linear_workspace_bytes(
        hidden, weight, sparse_threshold=TAU
    ) > xent.torch.linear_workspace_bytes(hidden, weight, order="low_memory")


def test_bad_values_and_refused_calls_raise_value_error_naming_it():
    hidden, weight, target = trained()
    call = xent.torch.linear_cross_entropy
    for bad in (-0.1, 1.5, float("nan"), "0.1", True, None):
        with pytest.raises(ValueError, match="sparse_threshold"):
            call(hidden, weight, target, sparse_threshold=bad)
        with pytest.raises(ValueError, match="sparse_threshold"):
            xent.torch.linear_workspace_bytes(hidden, weight, sparse_threshold=bad)
        with pytest.raises(ValueError, match="sparse_threshold"):
            xent.torch.LinearCrossEntropyLoss(sparse_threshold=bad)
        with pytest.raises(ValueError, match="sparse_threshold"):
            xent.torch.patch(object(), sparse_threshold=bad)
    h = hidden.clone().requires_grad_()
    with pytest.raises(ValueError, match="sparse_threshold"):
        call(h, weight, target, order="fast", sparse_threshold=TAU)
    with pytest.raises(ValueError, match="sparse_threshold"):
        call(h, weight, target, label_smoothing=0.1, softcap=5.0, sparse_threshold=TAU)
    # The ops' own checks, in the kernels and the fake kernels torch.compile traces with.
    args = (hidden, weight, None, target, None, -100, 1, 0.0, 0.0, 0.0)
    for device in ("cpu", "meta"):
        a = [x.to(device) if isinstance(x, torch.Tensor) else x for x in args]
        with pytest.raises(ValueError, match="sparse_threshold"):
            torch.ops.xent.linear_cross_entropy_fwd_bwd(*a, [True, True, True], 2, 0, 2.0)


@requires_cuda
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_within_the_bound(reduction):
    hidden, weight, target = (a.cuda() for a in trained(torch.bfloat16))
    exact = training(hidden, weight, target, reduction, order="low_memory")
    sparse = training(hidden, weight, target, reduction, sparse_threshold=TAU)
    assert torch.equal(sparse[0], exact[0])
    bounds = skipped_bound(hidden, weight, target, reduction, TAU)
    for got, want, bound in zip(sparse[1:], exact[1:], bounds):
        slack = 2.0**-7 * (want.double().abs() + bound) + 1e-3 * want.abs().max().item()
        assert ((got.double() - want.double()).abs() <= bound + slack).all()


@requires_cuda
def test_cuda_refuses_what_its_kernels_do_not_take():
    hidden, weight, target = (a.cuda() for a in trained())  # float32
    h = hidden.clone().requires_grad_()
    with pytest.raises(ValueError, match="sparse_threshold"):
        xent.torch.linear_cross_entropy(h, weight, target, sparse_threshold=TAU)
