"""xent.torch.cross_entropy against torch.nn.functional.cross_entropy (values and gradients), the
extensions (softcap, z_loss) against a plain torch formula, the in-place contract, gradcheck,
torch.library.opcheck and torch.compile(fullgraph=True), on the CPU and, when a GPU is visible and
the extension has its CUDA kernels, on CUDA (those cases skip, saying why, otherwise). The
reference is torch on the CPU in float32, on the same input values; float64 inputs (CPU only) are
held to torch in float64 to double precision and pass gradcheck with its default tolerances.
The package is tested as installed (pip install ./python); the import compiles nothing.
"""

import pytest
import torch
import torch.nn.functional as F

import xent.torch


def _cuda_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not xent.torch.cuda_built():
        return "xent was built without its CUDA kernels (python/CMakeLists.txt)"
    return None


CUDA_SKIP = _cuda_skip_reason()
requires_cuda = pytest.mark.skipif(CUDA_SKIP is not None, reason=f"CUDA: {CUDA_SKIP}")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]

C = 37  # classes: not a multiple of any vector width
N = 19  # rows

TOL = {  # (rtol, atol) for the loss and the gradient, per input dtype
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-4),
}


def make(n=N, c=C, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, generator=g) * scale).to(dtype)
    t = torch.randint(0, c, (n,), generator=g)
    return x, t


def upstream_for(loss, seed=1):
    """A non-trivial upstream gradient: per row for reduction none, a scalar otherwise."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(loss.shape, generator=g) + 0.5).to(loss.dtype)


def on(device, kw):
    """kw with its tensors (weight) moved to device."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def loss_and_grad(fn, x, *args, device=None, **kwargs):
    """fn's loss and d loss / d x (under upstream_for) as CPU tensors; with device, x, the
    tensor arguments and tensor options go there first."""
    if device is not None:
        x, args, kwargs = x.to(device), [a.to(device) for a in args], on(device, kwargs)
    x = x.detach().clone().requires_grad_()
    loss = fn(x, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, x, upstream_for(loss.cpu()).to(loss.device))
    return loss.detach().cpu(), grad.cpu()


def plain_grad(fn, x, *args, **kwargs):
    """d fn / d x with upstream 1, as loss.backward() gives."""
    x = x.detach().clone().requires_grad_()
    fn(x, *args, **kwargs).backward()
    return x.grad


def assert_matches_torch(x, t, dtype=torch.float32, device="cpu", **kw):
    """xent on x (any dtype) on device vs torch's float32 cross_entropy on the CPU, same values."""
    rtol, atol = TOL[dtype]
    loss, grad = loss_and_grad(xent.torch.cross_entropy, x, t, device=device, **kw)
    ref_t = t.float() if t.is_floating_point() else t.long()
    ref_loss, ref_grad = loss_and_grad(F.cross_entropy, x.float(), ref_t, **kw)
    assert loss.dtype == x.dtype
    torch.testing.assert_close(loss.float(), ref_loss, rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(
        grad.float(), ref_grad.to(dtype).float(), rtol=rtol, atol=atol, equal_nan=True
    )


def weights(c=C, seed=3):
    return torch.rand(c, generator=torch.Generator().manual_seed(seed)) + 0.25


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("targets", ["class ids", "some ignored", "probabilities"])
@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_every_option(reduction, weighted, label_smoothing, targets, device):
    x, t = make()
    if targets == "some ignored":
        t[::3] = -100
    elif targets == "probabilities":
        t = soft_targets()
    assert_matches_torch(
        x,
        t,
        device=device,
        reduction=reduction,
        weight=weights() if weighted else None,
        label_smoothing=label_smoothing,
    )


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("device", DEVICES)
def test_int32_and_int64_targets(target_dtype, device):
    x, t = make()
    t[4] = 7
    assert_matches_torch(
        x, t.to(target_dtype), device=device, weight=weights(), ignore_index=7, label_smoothing=0.05
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("device", DEVICES)
def test_half_precision_inputs(dtype, reduction, device):
    x, t = make(dtype=dtype)
    t[1] = -100
    assert_matches_torch(x, t, dtype=dtype, device=device, reduction=reduction, label_smoothing=0.1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_row_ignored(reduction, device):
    # mean: NaN loss (PyTorch's choice); sum: 0; gradient zero in both.
    x, _ = make()
    t = torch.full((N,), -100)
    assert_matches_torch(x, t, device=device, reduction=reduction)
    loss = xent.torch.cross_entropy(x.to(device), t.to(device), reduction=reduction).cpu()
    if reduction == "mean":
        assert torch.isnan(loss)
    else:
        assert (loss == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_ignore_index_that_is_a_valid_class(device):
    x, t = make()
    t[:5] = 2
    assert_matches_torch(x, t, device=device, ignore_index=2, weight=weights())


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    x = torch.randn(0, C, device=device)
    t = torch.zeros(0, dtype=torch.long, device=device)
    assert torch.isnan(xent.torch.cross_entropy(x, t).cpu())
    assert xent.torch.cross_entropy(x, t, reduction="sum").cpu() == 0
    assert xent.torch.cross_entropy(x, t, reduction="none").shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_row_stride_larger_than_classes(device):
    # The last dimension is contiguous: xent reads the rows in place with ld = 50.
    wide, t = make(c=50)
    wide = wide.to(device)
    x = wide[:, :C]
    t = t % C
    assert x.stride() == (50, 1)
    loss, grad = loss_and_grad(xent.torch.cross_entropy, x, t.to(device), label_smoothing=0.1)
    ref_loss, ref_grad = loss_and_grad(F.cross_entropy, x.cpu(), t, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_input(device):
    # The last dimension is strided: the binding makes a contiguous copy.
    xt, t = make(n=C, c=N)
    xt = xt.to(device)
    x = xt.t()
    t = torch.randint(0, C, (N,))
    assert x.stride(1) != 1
    loss, grad = loss_and_grad(
        xent.torch.cross_entropy, x, t.to(device), reduction="none", weight=weights().to(device)
    )
    ref_loss, ref_grad = loss_and_grad(
        F.cross_entropy, x.cpu(), t, reduction="none", weight=weights()
    )
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("soft", [False, True], ids=["class_ids", "probabilities"])
def test_torch_layout_n_c_d1_d2(device, reduction, soft):
    # torch's (N, C, d1, d2): the class dimension is dim 1, each (n, d1, d2) a row.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, C, 4, 2, generator=g) * 3
    if soft:
        t = torch.softmax(torch.randn(x.shape, generator=g), dim=1)
        kw = {}
    else:
        t = torch.randint(0, C, (3, 4, 2), generator=g)
        t[1, 2, 0] = -100
        kw = dict(weight=weights())
    assert_matches_torch(x, t, device=device, reduction=reduction, label_smoothing=0.1, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_unbatched_input(device):
    x, t = make(n=1)
    assert_matches_torch(x[0], t[0], device=device, label_smoothing=0.2)


def reference_extended(
    x,
    t,
    weight=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
):
    """softcap and z-loss written with torch ops: per row
    CE(softcap * tanh(x / softcap)) + z_loss * logsumexp^2 (rows not ignored), mean over W; in
    float32, or float64 for float64 x."""
    xf = x if x.dtype == torch.float64 else x.float()
    if softcap is not None:
        xf = softcap * torch.tanh(xf / softcap)
    keep = t != ignore_index
    rows = F.cross_entropy(
        xf,
        t.long(),
        weight=weight,
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    rows = rows + z_loss * torch.logsumexp(xf, dim=-1) ** 2 * keep
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    w = weight[t.clamp(min=0)] if weight is not None else torch.ones(t.shape, device=t.device)
    return rows.sum() / (w * keep).sum()


def assert_matches_formula(formula, x, t, device, **kw):
    """xent on device vs `formula` (torch ops, float32, CPU) on the same values."""
    loss, grad = loss_and_grad(xent.torch.cross_entropy, x, t, device=device, **kw)
    ref_loss, ref_grad = loss_and_grad(formula, x, t, **kw)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z_loss,softcap", [(1e-2, None), (0.0, 5.0), (1e-3, 2.5)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_softcap_and_z_loss_match_torch_formula(reduction, z_loss, softcap, weighted, device):
    x, t = make(scale=6.0)
    t[::4] = -100
    kw = dict(
        reduction=reduction, z_loss=z_loss, softcap=softcap, weight=weights() if weighted else None
    )
    assert_matches_formula(reference_extended, x, t, device, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_with_label_smoothing(device):
    x, t = make(scale=6.0)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=3.0)
    assert_matches_formula(reference_extended, x, t, device, **kw)


# --- the in-place contract (Liger #272): the logits are overwritten only when asked ---------------


def test_default_backward_leaves_the_logits_alone():
    x, t = make()
    leaf = x.clone().requires_grad_()
    logits = leaf * 1.0  # an intermediate, as an LM head's output is
    before = logits.detach().clone()
    xent.torch.cross_entropy(logits, t, label_smoothing=0.1).backward()
    assert torch.equal(logits.detach(), before)
    torch.testing.assert_close(leaf.grad, plain_grad(F.cross_entropy, x, t, label_smoothing=0.1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_writes_the_gradient_over_the_logits(dtype):
    x, t = make(dtype=dtype)
    leaf = x.clone().requires_grad_()
    logits = leaf * 1.0
    ptr = logits.data_ptr()
    xent.torch.cross_entropy(logits, t, reduction="sum", inplace_backward=True).backward()
    # The gradient is the logits' own memory, and it is correct.
    assert torch.equal(logits.detach(), leaf.grad)
    assert logits.data_ptr() == ptr
    ref_grad = plain_grad(xent.torch.cross_entropy, x, t, reduction="sum")
    torch.testing.assert_close(leaf.grad, ref_grad, rtol=0, atol=0)


def test_inplace_backward_of_n_c_d1_logits_leaves_the_callers_tensor():
    # (N, C, d1) rows are not contiguous: they are moved into a copy, and only the copy is
    # overwritten; the gradient is torch's.
    x, t = make(n=12)
    leaf = x.reshape(3, 4, C).transpose(1, 2).contiguous().requires_grad_()
    logits = leaf + 0.0
    before = logits.detach().clone()
    xent.torch.cross_entropy(logits, t.reshape(3, 4), inplace_backward=True).backward()
    assert torch.equal(logits.detach(), before)
    torch.testing.assert_close(leaf.grad, plain_grad(F.cross_entropy, before, t.reshape(3, 4)))


def test_inplace_backward_refuses_to_corrupt_saved_logits():
    # tanh saves its output for its own backward; writing the gradient over it must fail loudly
    # (autograd's version check), not hand tanh's backward the gradient as if it were the logits.
    x, t = make()
    leaf = x.clone().requires_grad_()
    logits = torch.tanh(leaf)
    loss = xent.torch.cross_entropy(logits, t, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inplace_backward_refuses_a_leaf_that_requires_grad():
    # Its values would become the gradient and its .grad would share their memory: an optimizer
    # step would read garbage. torch refuses in-place writes to such a leaf too.
    x, t = make()
    leaf = x.clone().requires_grad_()
    for reduction in ("mean", "none"):
        with pytest.raises(RuntimeError, match="inplace_backward"):
            xent.torch.cross_entropy(leaf, t, reduction=reduction, inplace_backward=True)
    assert torch.equal(leaf.detach(), x)
    with torch.no_grad():  # nothing is written without a gradient
        xent.torch.cross_entropy(leaf, t, inplace_backward=True)
    assert torch.equal(leaf.detach(), x)
    # A view of it shares its memory as much (torch refuses in-place writes to one too); the
    # leaf's values became its gradient.
    for view in (leaf[:], leaf.view(N, C), leaf.t().t()):
        with pytest.raises(RuntimeError, match="a view of a leaf"):
            xent.torch.cross_entropy(view, t, inplace_backward=True)
    assert torch.equal(leaf.detach(), x)


@pytest.mark.parametrize(
    "shape, target_shape, layout",
    [
        ((C,), (), lambda x: x),
        ((N, C, 1), (N, 1), lambda x: x),
        ((3, 4, C), (3, 4), lambda x: x.movedim(-1, 1)),  # (N, C, d1), classes innermost
    ],
    ids=["(C)", "(N, C, 1)", "(N, C, d1) channels-last"],
)
def test_inplace_backward_overwrites_logits_laid_out_as_rows(shape, target_shape, layout):
    # As documented: layouts whose rows xent reads where they lie take the gradient in place.
    g = torch.Generator().manual_seed(4)
    base = torch.randn(shape, generator=g)
    t = torch.randint(0, C, target_shape, generator=g)
    leaf = base.clone().requires_grad_()
    logits = layout(leaf * 1.0)
    xent.torch.cross_entropy(logits, t, reduction="sum", inplace_backward=True).backward()
    want = plain_grad(F.cross_entropy, layout(base), t, reduction="sum")
    torch.testing.assert_close(logits.detach(), want)
    torch.testing.assert_close(layout(leaf.grad), want)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_non_finite_weight_of_a_class_no_row_targets(bad, reduction):
    # torch's nll_loss reads each row's own class weight: a non-finite weight elsewhere changes
    # nothing (the core once formed sum_c w_c without smoothing: every gradient became NaN).
    x, t = make()
    t = t % (C - 1)
    t[2] = -100
    w = weights()
    w[C - 1] = bad
    assert_matches_torch(x, t, weight=w, reduction=reduction)


def test_inplace_backward_with_strided_classes_falls_back_to_a_new_gradient():
    xt, _ = make(n=C, c=N)
    leaf = xt.clone().requires_grad_()
    logits = leaf.t() * 1.0  # not contiguous in the class dimension
    logits = logits.t().contiguous().t()
    assert logits.stride(1) != 1
    t = torch.randint(0, C, (N,))
    before = logits.detach().clone()
    xent.torch.cross_entropy(logits, t, inplace_backward=True).backward()
    assert torch.equal(logits.detach(), before)
    torch.testing.assert_close(leaf.grad.t(), plain_grad(F.cross_entropy, xt.t(), t))


# --- gradcheck, opcheck, torch.compile ------------------------------------------------------------
#
# gradcheck runs as torch intends, in float64 with its default step and tolerances (eps 1e-6,
# atol 1e-5, rtol 1e-3), on the CPU backend's float64 path: xent accumulates float64 logits in
# double everywhere, so that is xent's own code, not a reference beside it. It checks xent's
# backward against finite differences of xent's forward, independently of torch's cross_entropy.
# The float32 gradcheck stays, for the float32 kernels (the ones training runs): tiny shapes with a
# step (eps = 1e-2) and tolerances sized for float32 central differences (truncation
# ~ eps^2 |f'''|, rounding ~ 1e-7 / eps ~ 1e-5): atol 2e-4, rtol 2e-3, tight enough that a
# gradient 1% off fails. xent has no second derivatives (its backward is not differentiable), so
# there is no gradgradcheck.

GRADCHECK_OPTIONS = [
    dict(),
    dict(reduction="sum", weight="w", label_smoothing=0.2),
    dict(reduction="none", ignore=True, z_loss=0.05),
    dict(softcap=2.0, z_loss=0.01, label_smoothing=0.1, weight="w", ignore=True),
]


def gradcheck_case(kw, dtype):
    """Tiny logits of `dtype` requiring grad, their targets and cross_entropy's options."""
    kw = dict(kw)
    x, t = make(n=5, c=7, scale=1.0, seed=11, dtype=dtype)
    if kw.pop("ignore", False):
        t[2] = -100
    if kw.get("weight") == "w":
        kw["weight"] = weights(c=7).to(dtype)
    return x.requires_grad_(), t, kw


@pytest.mark.parametrize("kw", GRADCHECK_OPTIONS)
@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double precision")
def test_gradcheck_float32(kw):
    x, t, kw = gradcheck_case(kw, torch.float32)
    fn = lambda a: xent.torch.cross_entropy(a, t, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-2, atol=2e-4, rtol=2e-3, fast_mode=False)


@pytest.mark.parametrize("kw", GRADCHECK_OPTIONS + [dict(soft=True, label_smoothing=0.1)])
def test_gradcheck_float64(kw):
    x, t, kw = gradcheck_case(kw, torch.float64)
    if kw.pop("soft", False):
        t = torch.softmax(
            torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64),
            dim=-1,
        )
    fn = lambda a: xent.torch.cross_entropy(a, t, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(weight="w", label_smoothing=0.25, ignore=True),
        dict(z_loss=2.0**-7, softcap=4.0, ignore=True),
    ],
)
def test_float64_matches_torch_to_double_precision(reduction, kw):
    # The options are float32 values for every dtype (float64 widens them exactly): the float64
    # reference gets the same values, 0.25 and 2^-7, and weights that float32 holds.
    kw = dict(kw, reduction=reduction)
    x, t = make(dtype=torch.float64)
    if kw.pop("ignore", False):
        t[::4] = -100
    if kw.get("weight") == "w":
        kw["weight"] = weights().double()
    loss, grad = loss_and_grad(xent.torch.cross_entropy, x, t, **kw)
    ref_loss, ref_grad = loss_and_grad(reference_extended, x, t, **kw)
    assert loss.dtype == grad.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)


@requires_cuda
def test_float64_on_cuda_is_refused_clearly():
    x, t = make(dtype=torch.float64)
    with pytest.raises(TypeError, match="float64 on cuda.*runs on the CPU only"):
        xent.torch.cross_entropy(x.cuda(), t.cuda())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_registrations(device):
    # Schema, fake kernels, autograd registration and AOT dispatch, as torch.library defines them.
    x, t = make(n=6, c=9)
    x, t = x.to(device), t.to(device)
    lse = torch.logsumexp(x, dim=-1)
    for reduction in (0, 1, 2):
        options = (-100, reduction, 0.1, 1e-3, 0.0, False, False, False)
        torch.library.opcheck(
            torch.ops.xent.cross_entropy_fwd.default,
            (x.clone().requires_grad_(), t, weights(c=9).to(device), *options),
        )
        g = torch.rand(6) if reduction == 0 else torch.tensor(0.5)
        g = g.to(device)
        torch.library.opcheck(
            torch.ops.xent.cross_entropy_bwd.default,
            (g, x, t, None, lse, -100, reduction, 0.0, 0.0, 0.0),
        )
        torch.library.opcheck(
            torch.ops.xent.cross_entropy_bwd_.default,
            (g, x.clone(), t, None, lse, -100, reduction, 0.0, 0.0, 0.0),
        )


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_forward_and_backward(inplace_backward, device):
    torch._dynamo.reset()
    x, t = make(n=8, c=16)
    w = weights(c=16).to(device)
    t[3] = -100
    x, t = x.to(device), t.to(device)

    def step(h, proj):
        logits = torch.tanh(h) @ proj  # an LM head in miniature
        loss = xent.torch.cross_entropy(
            logits, t, weight=w, label_smoothing=0.1, z_loss=1e-3, inplace_backward=inplace_backward
        )
        return loss * 2.0

    def reference(h, proj):
        logits = torch.tanh(h) @ proj
        return 2.0 * reference_extended(logits, t, weight=w, label_smoothing=0.1, z_loss=1e-3)

    compiled = torch.compile(step, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    h0, p0 = x, torch.randn(16, 16, generator=g).to(device)
    results = []
    for fn in (compiled, reference):
        h, p = h0.clone().requires_grad_(), p0.clone().requires_grad_()
        loss = fn(h, p)
        loss.backward()
        results.append((loss.detach(), h.grad, p.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_module_wrapper_matches_torch_module():
    x, t = make()
    t[0] = -100
    w = weights()
    mine = xent.torch.CrossEntropyLoss(weight=w, label_smoothing=0.1, reduction="sum")
    ref = torch.nn.CrossEntropyLoss(weight=w, label_smoothing=0.1, reduction="sum")
    loss, grad = loss_and_grad(mine, x, t)
    ref_loss, ref_grad = loss_and_grad(ref, x, t)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert "label_smoothing=0.1" in repr(mine)
    assert mine.weight is not None and "weight" in dict(mine.named_buffers())


def test_no_grad_forward():
    x, t = make()
    with torch.no_grad():
        loss = xent.torch.cross_entropy(x, t)
    torch.testing.assert_close(loss, F.cross_entropy(x, t))
    leaf = x.clone().requires_grad_()
    with torch.no_grad():
        assert not xent.torch.cross_entropy(leaf, t).requires_grad
    assert not xent.torch.cross_entropy(x, t).requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_one_cpp_node(device):
    # The autograd formula is C++ (csrc/xent_autograd.cpp): a float32 loss's grad_fn is xent's
    # node, and its one edge with a gradient goes straight to the logits (no Python node, no
    # second op between them).
    x, t = make()
    x = x.to(device).requires_grad_()
    loss = xent.torch.cross_entropy(x, t.to(device), weight=weights().to(device))
    node = loss.grad_fn
    assert node.name() == "torch::autograd::CppNode<xent_torch::cross_entropy_function>"
    edges = [fn for fn, _ in node.next_functions if fn is not None]
    assert len(edges) == 1 and edges[0].variable is x
    (grad,) = torch.autograd.grad(loss, x)
    ref = plain_grad(F.cross_entropy, x.detach().cpu(), t, weight=weights())
    torch.testing.assert_close(grad.cpu(), ref)


def test_first_derivative_under_create_graph():
    # backward(create_graph=True) still gives the right gradient (xent has no second derivative).
    x, t = make()
    x.requires_grad_()
    (grad,) = torch.autograd.grad(
        xent.torch.cross_entropy(x, t, label_smoothing=0.1), x, create_graph=True
    )
    torch.testing.assert_close(
        grad.detach(), plain_grad(F.cross_entropy, x, t, label_smoothing=0.1)
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_second_derivative_is_refused_clearly(reduction):
    # A gradient penalty through xent's gradient: an error naming the missing second derivative,
    # where reduction none gave a silent zero and mean "does not require grad".
    x, t = make(dtype=torch.float64)
    x.requires_grad_()
    (grad,) = torch.autograd.grad(
        xent.torch.cross_entropy(x, t, reduction=reduction).sum(), x, create_graph=True
    )
    with pytest.raises(RuntimeError, match="no second derivative"):
        grad.pow(2).sum().backward()
    h = torch.randn(N, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, 5, dtype=torch.float64, requires_grad=True)
    (dh,) = torch.autograd.grad(
        xent.torch.linear_cross_entropy(h, w, t, reduction=reduction).sum(), h, create_graph=True
    )
    with pytest.raises(RuntimeError, match="no second derivative"):
        dh.pow(2).sum().backward()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_second_derivative_is_refused_where_autograd_grad_prunes(reduction):
    # autograd.grad back to the input and a Hessian follow only the paths to the input: the error
    # node lies on them (hung on fresh leaves, as once_differentiable hangs it, a Hessian came
    # back all zeros and autograd.grad(allow_unused=True) None).
    x, t = make(n=4, c=3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.functional.hessian(
            lambda z: xent.torch.cross_entropy(z, t, reduction=reduction).sum(), x
        )
    z = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(
        xent.torch.cross_entropy(z, t, reduction=reduction).sum(), z, create_graph=True
    )
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(g.pow(2).sum(), z, allow_unused=True)
    h = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    dh, dw = torch.autograd.grad(
        xent.torch.linear_cross_entropy(h, w, t, reduction=reduction).sum(),
        (h, w),
        create_graph=True,
    )
    for wrt in (h, w):
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.autograd.grad(dh.pow(2).sum() + dw.pow(2).sum(), wrt, allow_unused=True)


def test_bad_arguments_raise_torch_errors():
    x, t = make()
    bad = t.clone()
    bad[5] = C
    with pytest.raises(IndexError, match="row 5 has target"):
        xent.torch.cross_entropy(x, bad)
    # A target of a dtype torch refuses: the installed torch's own message, whose wording differs
    # between versions (test_torch_signature.py compares it with torch's).
    with pytest.raises(RuntimeError, match="Long"):
        xent.torch.cross_entropy(x, t.to(torch.int16))
    with pytest.raises(RuntimeError, match="Long"):
        xent.torch.cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="to match target batch_size"):
        xent.torch.cross_entropy(x, t[:-1])
    with pytest.raises(ValueError, match=r"to match target batch_size \(0\)"):
        xent.torch.cross_entropy(x, t[0])  # torch compares batch sizes before the target's rank
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        xent.torch.cross_entropy(x, t, ignore_index=True)
    with pytest.raises(ValueError, match="ignore_index must fit in 64 bits"):
        xent.torch.cross_entropy(x, t, ignore_index=2**70)
    # A cap that float32 holds as 0 (or whose reciprocal it cannot hold) is refused, not off.
    for cap in (1e-50, 1e-40):
        with pytest.raises(ValueError, match="softcap"):
            xent.torch.cross_entropy(x, t, softcap=cap)
    with pytest.raises(ValueError, match="reduction"):
        xent.torch.cross_entropy(x, t, reduction="avg")
    with pytest.raises(RuntimeError, match="label_smoothing"):
        xent.torch.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(RuntimeError, match="weight"):
        xent.torch.cross_entropy(x, t, weight=torch.ones(C + 1))
    # The same checks when the call records a node (the autograd kernel's other path).
    leaf = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="weight"):
        xent.torch.cross_entropy(leaf, t, weight=torch.ones(C + 1))
    with pytest.raises(IndexError, match="row 5 has target"):
        xent.torch.cross_entropy(leaf, bad)


def test_tensors_on_another_device_are_refused():
    # A meta target or weight reached the fake kernels (torch runs them for the meta device too)
    # and gave an uninitialised loss and gradient.
    x, t = make()
    x.requires_grad_()
    with pytest.raises(RuntimeError, match="target is on meta"):
        xent.torch.cross_entropy(x, t.to("meta"))
    with pytest.raises(RuntimeError, match="weight is on meta"):
        xent.torch.cross_entropy(x, t, weight=torch.ones(C, device="meta"))
    with pytest.raises(RuntimeError, match="class_weight is on meta"):
        xent.torch.linear_cross_entropy(
            x, torch.randn(C, C), t, class_weight=torch.ones(C, device="meta")
        )
    with pytest.raises(RuntimeError, match="bias is on meta"):
        xent.torch.linear_cross_entropy(x, torch.randn(C, C), t, bias=torch.ones(C, device="meta"))


def test_class_weights_get_no_gradient():
    # torch's cross_entropy refuses to differentiate its weight; a weight requiring grad had its
    # grad silently left None.
    x, t = make()
    w = torch.rand(C).requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'weight'"):
        xent.torch.cross_entropy(x.clone().requires_grad_(), t, weight=w)
    with pytest.raises(RuntimeError, match="argument 'class_weight'"):
        xent.torch.linear_cross_entropy(x, torch.randn(C, C, requires_grad=True), t, class_weight=w)
    with torch.no_grad():
        torch.testing.assert_close(
            xent.torch.cross_entropy(x, t, weight=w), F.cross_entropy(x, t, weight=w)
        )


# --- soft targets (class probabilities, torch's semantics) ----------------------------------------


def soft_targets(n=N, c=C, seed=7, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, c, generator=g) * 2, dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_soft_targets_half_precision(dtype, device):
    # The targets are held in the input's dtype; the reference gets the same rounded values.
    x, _ = make(dtype=dtype)
    assert_matches_torch(
        x, soft_targets(dtype=dtype), dtype=dtype, device=device, label_smoothing=0.1
    )


@pytest.mark.parametrize("device", DEVICES)
def test_soft_targets_with_softcap_z_loss_and_3d_input(device):
    # reference: softcap then torch's soft-target cross-entropy, plus z * lse^2 on every row.
    x, _ = make(n=12, scale=5.0)
    p = soft_targets(n=12)
    kw = dict(softcap=4.0, z_loss=1e-2, label_smoothing=0.1)

    def reference(a, q, softcap, z_loss, label_smoothing):
        z = softcap * torch.tanh(a.float() / softcap)
        z, q = z.movedim(1, -1).reshape(-1, C), q.movedim(1, -1).reshape(-1, C)
        rows = F.cross_entropy(z, q, reduction="none", label_smoothing=label_smoothing)
        return (rows + z_loss * torch.logsumexp(z, -1) ** 2).mean()

    # torch's (N, C, d1) layout
    x3, p3 = x.reshape(3, 4, C).transpose(1, 2), p.reshape(3, 4, C).transpose(1, 2)
    assert_matches_formula(reference, x3, p3, device, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_targets_inplace_backward(device):
    x, _ = make()
    p = soft_targets().to(device)
    leaf = x.to(device).requires_grad_()
    logits = leaf * 1.0
    xent.torch.cross_entropy(logits, p, reduction="sum", inplace_backward=True).backward()
    assert torch.equal(logits.detach(), leaf.grad)
    ref = plain_grad(F.cross_entropy, x, p.cpu(), reduction="sum")
    torch.testing.assert_close(leaf.grad.cpu(), ref)


def test_autocast_gives_a_float32_loss_as_torch():
    # torch's cross_entropy runs in float32 under autocast; the bf16 logits' loss came back bf16.
    x, t = make()
    h = x.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(h, t)
        loss = xent.torch.cross_entropy(h, t)
        lin = xent.torch.linear_cross_entropy(h, torch.eye(C, dtype=torch.bfloat16), t)
    assert ref.dtype == torch.float32 and loss.dtype == torch.float32 and lin.dtype == torch.float32
    torch.testing.assert_close(loss, ref)
    assert xent.torch.cross_entropy(h, t).dtype == torch.bfloat16  # outside autocast: h's dtype


def test_soft_targets_refuse_an_ignore_index_as_torch_does():
    x, _ = make()
    p = soft_targets()
    with pytest.raises(RuntimeError, match="ignore_index"):
        F.cross_entropy(x, p, ignore_index=3)
    with pytest.raises(RuntimeError, match="ignore_index is not supported"):
        xent.torch.cross_entropy(x, p, ignore_index=3)
    with pytest.raises(RuntimeError, match="ignore_index is not supported"):
        xent.torch.linear_cross_entropy(x, torch.randn(C, C), p, ignore_index=0)
    torch.testing.assert_close(
        xent.torch.cross_entropy(x, p, ignore_index=-1), F.cross_entropy(x, p, ignore_index=-1)
    )


def test_soft_targets_get_no_gradient():
    x, _ = make()
    p = soft_targets().requires_grad_()
    with pytest.raises(RuntimeError, match="no gradient"):
        xent.torch.cross_entropy(x, p)
    with torch.no_grad():
        torch.testing.assert_close(xent.torch.cross_entropy(x, p), F.cross_entropy(x, p))


# --- CUDA: sizes the kernels vectorise, streams, graphs, devices ----------------------------------


@requires_cuda
@pytest.mark.parametrize(
    "n,c,dtype",
    [
        (64, 32000, torch.float32),
        (33, 50257, torch.bfloat16),
        (7, 65537, torch.float16),
        (257, 4096, torch.bfloat16),
        (3, 1, torch.float32),
        (5, 3, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(reduction="none", label_smoothing=0.1, z_loss=1e-4),
        dict(reduction="sum", softcap=30.0, weight="w"),
    ],
)
def test_cuda_language_model_sizes(n, c, dtype, kw):
    kw = dict(kw)
    if kw.get("weight") == "w":
        kw["weight"] = weights(c=c)
    x, t = make(n=n, c=c, dtype=dtype, scale=2.0)
    t[::5] = -100
    rtol, atol = TOL[dtype]
    loss, grad = loss_and_grad(xent.torch.cross_entropy, x, t, device="cuda", **kw)
    ref_loss, ref_grad = loss_and_grad(reference_extended, x.float(), t, **kw)
    torch.testing.assert_close(loss.float(), ref_loss, rtol=max(rtol, 1e-4), atol=atol)
    # float32: at c = 32000 the row's LSE is ~12, whose float32 spacing is ~1e-6, so a target's
    # probability near 1 carries ~1e-6 of absolute error in any float32 computation (the float32
    # reference's too), and the target's gradient p - (1 - eps) keeps it while the value shrinks:
    # On an H200 one element of 2048000 differed by 1.9e-6 at p ~ 0.93.
    grad_atol = 4e-6 if dtype == torch.float32 else max(atol, 1e-7)
    torch.testing.assert_close(grad.float(), ref_grad.to(dtype).float(), rtol=rtol, atol=grad_atol)


@requires_cuda
def test_cuda_inplace_backward_and_default_leaves_logits_alone():
    x, t = make(n=64, c=1000)
    x, t = x.cuda(), t.cuda()
    for inplace in (False, True):
        leaf = x.clone().requires_grad_()
        logits = leaf * 1.0
        before = logits.detach().clone()
        xent.torch.cross_entropy(logits, t, inplace_backward=inplace).backward()
        assert torch.equal(logits.detach(), leaf.grad) == inplace
        if not inplace:
            assert torch.equal(logits.detach(), before)
        torch.testing.assert_close(leaf.grad.cpu(), plain_grad(F.cross_entropy, x.cpu(), t.cpu()))


@requires_cuda
def test_cuda_out_of_range_target_is_nan_and_counted():
    counter = xent.torch.cuda_target_errors()
    counter.zero_()
    x, t = make()
    t[5] = C + 3
    t[6] = -7
    x, t = x.cuda(), t.cuda()
    rows = xent.torch.cross_entropy(x, t, reduction="none")
    assert torch.isnan(rows[5]) and torch.isnan(rows[6])
    assert torch.isfinite(rows[:5]).all() and torch.isfinite(rows[7:]).all()
    assert torch.isnan(xent.torch.cross_entropy(x, t))
    assert int(counter) == 4  # two rows, two calls
    counter.zero_()
    xent.torch.cross_entropy(x, t.clamp(0, C - 1))
    assert int(counter) == 0


@requires_cuda
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_cuda_graph_capture_and_replay(reduction, inplace_backward):
    # forward and backward captured in one graph; replays on new data match eager calls, also when
    # eager calls on the same stream run between replays (the cached workspace is never captured).
    n, c = 96, 3001
    w = weights(c=c).cuda()
    static_x = torch.zeros(n, c, device="cuda")
    static_t = torch.zeros(n, dtype=torch.long, device="cuda")
    up = torch.rand(n if reduction == "none" else (), device="cuda") + 0.5

    def step(x, t):
        leaf = x.detach().requires_grad_()
        logits = leaf * 1.0
        loss = xent.torch.cross_entropy(
            logits,
            t,
            weight=w,
            reduction=reduction,
            label_smoothing=0.1,
            inplace_backward=inplace_backward,
        )
        loss.backward(up)
        return loss.detach(), leaf.grad

    xent.torch.cuda_target_errors()  # the counter exists before the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
        for _ in range(2):
            step(static_x, static_t)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, static_grad = step(static_x, static_t)
    for seed in range(3):
        x, t = make(n=n, c=c, seed=seed)
        t[::7] = -100
        static_x.copy_(x)
        static_t.copy_(t)
        graph.replay()
        eager_loss, eager_grad = step(x.cuda(), t.cuda())  # eager, between replays
        torch.testing.assert_close(static_loss, eager_loss, rtol=0, atol=0)
        torch.testing.assert_close(static_grad, eager_grad, rtol=0, atol=0)
        xr = x.clone().requires_grad_()
        ref = F.cross_entropy(xr, t, weight=w.cpu(), reduction=reduction, label_smoothing=0.1)
        ref.backward(up.cpu())
        torch.testing.assert_close(static_loss.cpu(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(static_grad.cpu(), xr.grad, rtol=1e-5, atol=1e-7)


@requires_cuda
def test_cuda_concurrent_streams_each_get_their_own_workspace():
    # Reduced losses on two streams at once (one workspace per stream), checked against torch.
    inputs = [make(n=2048, c=4096, seed=s) for s in range(4)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    cuda_inputs = [(x.cuda(), t.cuda()) for x, t in inputs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = []
    for rep in range(3):
        for i, (x, t) in enumerate(cuda_inputs):
            with torch.cuda.stream(streams[i % 2]):
                results.append((i, xent.torch.cross_entropy(x, t, reduction="sum")))
    torch.cuda.synchronize()
    for i, loss in results:
        x, t = inputs[i]
        torch.testing.assert_close(
            loss.cpu(), F.cross_entropy(x, t, reduction="sum"), rtol=1e-5, atol=1e-2
        )


@requires_cuda
def test_cuda_mixed_devices_are_refused():
    x, t = make()
    with pytest.raises(RuntimeError, match="one device"):
        xent.torch.cross_entropy(x.cuda(), t.cuda(), weight=weights())


@requires_cuda
@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double precision")
def test_cuda_gradcheck_float32():
    x, t = make(n=5, c=7, scale=1.0, seed=11)
    t[2] = -100
    x = x.cuda().requires_grad_()
    t, w = t.cuda(), weights(c=7).cuda()
    fn = lambda a: xent.torch.cross_entropy(
        a,
        t,
        weight=w,
        label_smoothing=0.1,  # noqa: E731
        z_loss=0.01,
        softcap=2.0,
    )
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-2, atol=2e-4, rtol=2e-3)


def test_build_info_matches_the_loaded_library():
    # The CUDA kernels' registration comes with the .cu file, so the op that only it defines says
    # what was compiled; the build records the same (the wheel's _build_info.py).
    assert xent.torch.cuda_built() == hasattr(torch.ops.xent, "cuda_target_errors")
