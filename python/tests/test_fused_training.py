"""The fused training path (csrc/xent_autograd.cpp): with grad mode on, an input requiring grad and
reduction mean or sum, the forward runs xent's forward_backward
(torch.ops.xent.cross_entropy_fwd_bwd and its in-place variant, linear_cross_entropy_fwd_bwd) with
upstream 1 and the node saves only the gradient; backward multiplies it by the loss's gradient
with torch.ops.xent.scale_grad_, read on the device. Checked against torch for upstream gradients
other than 1 and exactly 1, in every dtype the other files test; what the node saves (and that the
caller may overwrite its inputs after the forward); the in-place variant (the forward overwrites
the logits); retain_graph; reduction none on the split path; opcheck of the new ops;
torch.compile(fullgraph=True) of both ops together."""

import pytest

import torch
import torch.nn.functional as F

from test_cross_entropy import (
    DEVICES,
    TOL,
    make,
    on,
    reference_extended,  # noqa: E402
    requires_cuda,
    weights,
)
import test_linear_cross_entropy as lin  # noqa: E402
import xent.torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# float16 takes the split path (csrc/xent_autograd.cpp, fuses: its gradients underflow at 1).
FUSED_DTYPES = [torch.float32, torch.bfloat16]


def backward_with(loss, upstream, **kw):
    """loss.backward() the way a training loop writes it: `upstream` 1 is a plain backward(),
    a float multiplies the loss first ((loss * 3.0).backward()), a tensor is passed to backward."""
    if upstream == 1:
        loss.backward(**kw)
    elif isinstance(upstream, float):
        (loss * upstream).backward(**kw)
    else:
        loss.backward(upstream.to(loss), **kw)


UPSTREAMS = [1, 3.0, torch.tensor(0.5)]
UPSTREAM_IDS = ["backward()", "(loss*3).backward()", "backward(tensor(0.5))"]


def factor(upstream):
    return float(upstream)


def saved_tensors(fn):
    """fn()'s result and every tensor an autograd node saved while fn ran."""
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, packed


def shares_memory(tensors, other):
    ptr = other.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in tensors)


# --- cross_entropy --------------------------------------------------------------------------------


def ce_reference(x, t, reduction, upstream, **kw):
    """torch's float32 loss and d loss / d x (times the upstream factor) on the CPU."""
    leaf = x.detach().float().clone().requires_grad_()
    loss = F.cross_entropy(leaf, t, reduction=reduction, **kw)
    (loss * factor(upstream)).backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("upstream", UPSTREAMS, ids=UPSTREAM_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_fused_matches_torch(upstream, reduction, dtype, device):
    x, t = make(dtype=dtype)
    t[2] = -100
    kw = dict(weight=weights(), label_smoothing=0.1)
    leaf = x.to(device).requires_grad_()
    loss = xent.torch.cross_entropy(leaf, t.to(device), reduction=reduction, **on(device, kw))
    backward_with(loss, upstream)
    ref_loss, ref_grad = ce_reference(x, t, reduction, upstream, **kw)
    rtol, atol = TOL[dtype]
    assert leaf.grad.dtype == dtype
    torch.testing.assert_close(loss.detach().cpu().float(), ref_loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(
        leaf.grad.cpu().float(), ref_grad.to(dtype).float(), rtol=2 * rtol, atol=atol
    )  # rounded twice: upstream 1, then scaled


# Loss factors a 16-bit gradient's dtype cannot hold: a GradScaler's 65536 (inf in float16) and
# gradient accumulation's 1/3 (0.33398 in bfloat16). The factor is applied in float32 before the
# gradient is rounded, as torch's autograd applies it: no infinities, no bias (rounding the factor
# first made every float16 gradient inf or NaN and every bfloat16 one 0.19% too large), and no
# float16 gradient formed at upstream 1, where the small ones underflow (float16 takes the split
# path: formed at 1 and scaled, the float16 gradients here were 0.9% small on average).
@pytest.mark.parametrize(
    "dtype, upstream",
    [(torch.float16, 65536.0), (torch.bfloat16, 1 / 3), (torch.float16, 1 / 3)],
    ids=["float16-65536", "bfloat16-third", "float16-third"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_upstreams_that_the_gradients_dtype_cannot_hold(dtype, upstream, device):
    g = torch.Generator().manual_seed(7)
    x, t = make(n=64, c=1000, dtype=dtype)
    h = torch.randn(64, 48, generator=g).to(dtype)
    w = (torch.randn(1000, 48, generator=g) / 4).to(dtype)
    calls = {
        "cross_entropy": (xent.torch.cross_entropy, F.cross_entropy, (x,)),
        "linear": (
            xent.torch.linear_cross_entropy,
            lambda h, w, t: F.cross_entropy(h @ w.T, t),
            (h, w),
        ),
    }
    for name, (fn, ref_fn, inputs) in calls.items():
        leaves = [a.to(device).requires_grad_() for a in inputs]
        # Under autocast, as a GradScaler runs: the loss is float32, so its factor is too.
        with torch.autocast(torch.device(device).type, dtype=dtype):
            loss = fn(*leaves, t.to(device))
        assert loss.dtype == torch.float32
        (loss * upstream).backward()
        refs = [a.detach().double().requires_grad_() for a in inputs]
        (ref_fn(*refs, t) * upstream).backward()
        for leaf, ref in zip(leaves, refs):
            got, want = leaf.grad.cpu().double(), ref.grad
            assert got.isfinite().all(), name
            # Where the dtype holds the gradient as a normal number (below, torch's own underflows)
            normal = want.abs() >= torch.finfo(dtype).tiny
            bias = ((got - want)[normal] / want[normal]).mean().item()
            assert abs(bias) < 5e-4, (name, bias)
            torch.testing.assert_close(got, want, rtol=TOL[dtype][0] * 2, atol=1e-3 * upstream)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_only_the_split_path_saves_the_logits(reduction, dtype):
    # The fused node saves its gradient, one tensor of the logits' shape, and not the logits; the
    # split one (reduction none, float16) saves them for its backward.
    x, t = make(dtype=dtype)
    logits = x.clone().requires_grad_() * 1.0  # an intermediate, as an LM head's output is
    loss, packed = saved_tensors(lambda: xent.torch.cross_entropy(logits, t, reduction=reduction))
    split = reduction == "none" or dtype == torch.float16
    assert shares_memory(packed, logits) == split
    if not split:
        assert len(packed) == 1 and packed[0].shape == x.shape
    node = loss.grad_fn if dtype == torch.float32 else loss.grad_fn.next_functions[0][0]
    assert node.name() == "torch::autograd::CppNode<xent_torch::cross_entropy_function>"


@pytest.mark.parametrize("device", DEVICES)
def test_plain_backward_hands_the_saved_gradient_over(device):
    # loss.backward() scales the saved gradient in place and the node lets it go, so a leaf's
    # .grad is that very memory: no copy anywhere between the forward's write and .grad.
    x, t = make()
    leaf = x.to(device).requires_grad_()
    saved = []

    def pack(a):
        saved.append(a.data_ptr())  # not the tensor: holding it would force AccumulateGrad to copy
        return a

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda a: a):
        loss = xent.torch.cross_entropy(leaf, t.to(device), reduction="sum")
    loss.backward()
    assert saved == [leaf.grad.data_ptr()]


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_backward_after_the_caller_overwrites_its_logits(dtype, device):
    # Nothing of the logits is needed after the fused forward: a backward after they were
    # overwritten (which the split path's version check would refuse) still gives their gradient.
    x, t = make(dtype=dtype)
    leaf = x.to(device).requires_grad_()
    logits = leaf * 1.0
    loss = xent.torch.cross_entropy(logits, t.to(device), label_smoothing=0.1)
    with torch.no_grad():
        logits.fill_(float("nan"))
    del logits
    backward_with(loss, 3.0)
    _, ref_grad = ce_reference(x, t, "mean", 3.0, label_smoothing=0.1)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        leaf.grad.cpu().float(), ref_grad.to(dtype).float(), rtol=2 * rtol, atol=atol
    )


@pytest.mark.parametrize("upstream", UPSTREAMS, ids=UPSTREAM_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_inplace_fused_forward_writes_the_gradient_over_the_logits(
    upstream, reduction, dtype, device
):
    x, t = make(dtype=dtype)
    t[4] = -100
    leaf = x.to(device).requires_grad_()
    logits = leaf * 1.0
    ptr = logits.data_ptr()
    loss = xent.torch.cross_entropy(
        logits, t.to(device), reduction=reduction, inplace_backward=True
    )
    ref_loss, ref_grad = ce_reference(x, t, reduction, 1)
    rtol, atol = TOL[dtype]
    # After the forward alone, the logits' memory holds the gradient with upstream 1.
    torch.testing.assert_close(
        logits.detach().cpu().float(), ref_grad.to(dtype).float(), rtol=rtol, atol=atol
    )
    torch.testing.assert_close(loss.detach().cpu().float(), ref_loss, rtol=rtol, atol=atol)
    backward_with(loss, upstream)
    assert logits.data_ptr() == ptr
    assert torch.equal(logits.detach(), leaf.grad)  # the scaled gradient, in the same memory
    want = ce_reference(x, t, reduction, upstream)[1]
    torch.testing.assert_close(
        leaf.grad.cpu().float(), want.to(dtype).float(), rtol=2 * rtol, atol=atol
    )


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_retain_graph_scales_a_copy(inplace_backward, device):
    # A backward that keeps the graph must leave the saved gradient unscaled for the next one.
    x, t = make()
    leaf = x.to(device).requires_grad_()
    logits = leaf * 1.0
    loss = xent.torch.cross_entropy(logits, t.to(device), inplace_backward=inplace_backward)
    backward_with(loss, 3.0, retain_graph=True)
    backward_with(loss, torch.tensor(0.5, device=device))
    want = ce_reference(x, t, "mean", 3.5)[1]
    torch.testing.assert_close(leaf.grad.cpu(), want, rtol=1e-5, atol=1e-6)


def test_reduction_none_and_no_grad_keep_the_forward_alone():
    x, t = make()
    leaf = x.clone().requires_grad_()
    logits = leaf * 1.0
    before = logits.detach().clone()
    rows = xent.torch.cross_entropy(logits, t, reduction="none", inplace_backward=True)
    assert torch.equal(logits.detach(), before)  # none: nothing written until backward
    up = torch.rand(rows.shape) + 0.5
    rows.backward(up)
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref, t, reduction="none").backward(up)
    torch.testing.assert_close(leaf.grad, ref.grad)
    logits = x.clone().requires_grad_() * 1.0
    with torch.no_grad():
        xent.torch.cross_entropy(logits, t, inplace_backward=True)
    assert torch.equal(logits.detach(), x)  # no node: no gradient computed or written


def test_fused_ops_refuse_reduction_none():
    x, t = make()
    with pytest.raises(ValueError, match="mean or sum"):
        torch.ops.xent.cross_entropy_fwd_bwd(x, t, None, -100, 0, 0.0, 0.0, 0.0, False, False)
    hidden, weight, _, target = lin.make()
    with pytest.raises(ValueError, match="mean or sum"):
        torch.ops.xent.linear_cross_entropy_fwd_bwd(
            hidden, weight, None, target, None, -100, 0, 0.0, 0.0, 0.0, [True, True, True]
        )


# --- linear_cross_entropy -------------------------------------------------------------------------


def linear_tolerance(dtype, want):
    if dtype == torch.float32:
        return dict(rtol=1e-4, atol=1e-5)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3  # test_linear_cross_entropy's half precision
    return dict(rtol=tol, atol=tol * want.abs().max().item())


def linear_run(fn, hidden, weight, target, bias, upstream, device="cpu", requires=(0, 1, 2), **kw):
    """fn's loss and the gradients of the inputs that require grad (indices into hidden, weight,
    bias), after backward_with(upstream)."""
    args = [
        a.detach().clone().to(device) if a is not None else None for a in (hidden, weight, bias)
    ]
    for i in requires:
        if args[i] is not None:
            args[i].requires_grad_()
    loss = fn(args[0], args[1], target.to(device), args[2], **kw)
    backward_with(loss, upstream)
    return [loss.detach().cpu()] + [args[i].grad.cpu() for i in requires if args[i] is not None]


@pytest.mark.parametrize("upstream", UPSTREAMS, ids=UPSTREAM_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_linear_fused_matches_torch(upstream, reduction, with_bias, dtype, device):
    hidden, weight, bias, target = lin.make(dtype=dtype)
    target[::5] = -100
    bias = bias if with_bias else None
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    got = linear_run(
        xent.torch.linear_cross_entropy, hidden, weight, target, bias, upstream, device, **kw
    )
    want = linear_run(lin.torch_linear_ce, hidden, weight, target, bias, upstream, **kw)
    assert len(got) == len(want) == (4 if with_bias else 3)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w.float(), **linear_tolerance(dtype, w.float()))


@pytest.mark.parametrize("requires", [(0,), (1, 2)], ids=["frozen head", "frozen hidden"])
def test_linear_fused_with_frozen_inputs(requires):
    hidden, weight, bias, target = lin.make()
    got = linear_run(
        xent.torch.linear_cross_entropy, hidden, weight, target, bias, 3.0, requires=requires
    )
    want = linear_run(lin.torch_linear_ce, hidden, weight, target, bias, 3.0, requires=requires)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_fused_saves_gradients_not_inputs(reduction, with_bias):
    hidden, weight, bias, target = lin.make()
    leaves = [a.clone().requires_grad_() for a in (hidden, weight, bias)]
    b = leaves[2] if with_bias else None
    loss, packed = saved_tensors(
        lambda: xent.torch.linear_cross_entropy(
            leaves[0], leaves[1], target, b, reduction=reduction
        )
    )
    fused = reduction != "none"
    assert shares_memory(packed, leaves[0]) != fused
    assert shares_memory(packed, leaves[1]) != fused
    if fused:
        want = [hidden.shape, weight.shape] + ([bias.shape] if with_bias else [])
        assert [p.shape for p in packed] == want
        # Then the caller may overwrite its inputs (an optimizer step) before backward.
        with torch.no_grad():
            for leaf in leaves:
                leaf.zero_()
        loss.backward()
        ref = linear_run(
            lin.torch_linear_ce, hidden, weight, target, bias if with_bias else None, 1
        )
        for leaf, w in zip(leaves, ref[1:]):
            torch.testing.assert_close(leaf.grad, w, rtol=1e-4, atol=1e-5)


def test_linear_retain_graph_scales_a_copy():
    hidden, weight, bias, target = lin.make()
    leaves = [a.clone().requires_grad_() for a in (hidden, weight, bias)]
    loss = xent.torch.linear_cross_entropy(leaves[0], leaves[1], target, leaves[2])
    backward_with(loss, 3.0, retain_graph=True)
    backward_with(loss, torch.tensor(0.5))
    want = linear_run(lin.torch_linear_ce, hidden, weight, target, bias, 3.5)
    for leaf, w in zip(leaves, want[1:]):
        torch.testing.assert_close(leaf.grad, w, rtol=1e-4, atol=1e-5)


# --- the ops themselves: scale_grad_, opcheck, torch.compile --------------------------------------


def scale_cases(device):
    """Gradients scale_grad_ takes: contiguous (aligned or not, sizes that leave a head and a tail
    around the 16-byte packets), rows with padding (an in-place gradient over wider rows), a
    transposed matrix and a strided vector."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(7, 50, generator=g).to(device)
    return [base, base.reshape(-1)[1:], base.reshape(-1)[3:340], base[:, :37], base.t(), base[:, 5]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5, -3.0])
@pytest.mark.parametrize("device", DEVICES)
def test_scale_grad_(dtype, scale, device):
    for case in scale_cases(device):
        base = case._base if case._base is not None else case
        buf = base.to(dtype, copy=True)
        grad = buf.as_strided(case.shape, case.stride(), case.storage_offset())
        want = (grad.float() * scale).to(dtype)
        outside = buf.clone()
        torch.ops.xent.scale_grad_(grad, torch.tensor(scale, dtype=torch.float64, device=device))
        assert torch.equal(grad, want)
        mask = torch.ones_like(buf, dtype=torch.bool)
        mask.as_strided(case.shape, case.stride(), case.storage_offset()).fill_(False)
        assert torch.equal(buf[mask], outside[mask])  # nothing outside the view is written


def test_opcheck_fused_ops():
    x, t = make(n=6, c=9)
    hidden, weight, bias, target = lin.make(n=6, d=4, v=9)
    for reduction in (1, 2):
        torch.library.opcheck(
            torch.ops.xent.cross_entropy_fwd_bwd.default,
            (x, t, weights(c=9), -100, reduction, 0.1, 1e-3, 0.0, False, False),
        )
        torch.library.opcheck(
            torch.ops.xent.cross_entropy_fwd_bwd_.default,
            (x.clone(), t, None, -100, reduction, 0.0, 0.0, 2.0, False, False),
        )
        for b in (None, bias):
            for mask in ([True, True, True], [True, False, False], [False, True, True]):
                torch.library.opcheck(
                    torch.ops.xent.linear_cross_entropy_fwd_bwd.default,
                    (hidden, weight, b, target, None, -100, reduction, 0.1, 0.0, 0.0, mask),
                )
    for scale in (1.0, 0.5):
        torch.library.opcheck(torch.ops.xent.scale_grad_.default, (x.clone(), torch.tensor(scale)))


def fused_step(inplace_backward):
    """A training step through both ops: an LM head in miniature into cross_entropy, and the fused
    linear op on the same hidden states."""

    def step(h, proj, w, b, t):
        logits = torch.tanh(h) @ proj
        a = xent.torch.cross_entropy(
            logits, t, label_smoothing=0.1, z_loss=1e-3, inplace_backward=inplace_backward
        )
        c = xent.torch.linear_cross_entropy(h, w, t, b, reduction="sum", softcap=5.0)
        return 2.0 * a + 0.25 * c

    def reference(h, proj, w, b, t):
        a = reference_extended(torch.tanh(h) @ proj, t, label_smoothing=0.1, z_loss=1e-3)
        c = lin.torch_linear_ce(h, w, t, b, reduction="sum", softcap=5.0)
        return 2.0 * a + 0.25 * c

    return step, reference


def step_inputs(device):
    g = torch.Generator().manual_seed(8)
    h = torch.randn(8, 16, generator=g)
    leaves = [
        h,
        torch.randn(16, 12, generator=g),
        torch.randn(12, 16, generator=g) / 4,
        torch.randn(12, generator=g),
    ]
    t = torch.randint(0, 12, (8,), generator=g)
    t[3] = -100
    return [a.to(device) for a in leaves], t.to(device)


def run_step(fn, leaves, t):
    leaves = [a.clone().requires_grad_() for a in leaves]
    loss = fn(*leaves, t)
    loss.backward()
    return [loss.detach()] + [a.grad for a in leaves]


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_both_ops(inplace_backward, device):
    torch._dynamo.reset()
    step, reference = fused_step(inplace_backward)
    leaves, t = step_inputs(device)
    got = run_step(torch.compile(step, fullgraph=True), leaves, t)
    want = run_step(reference, leaves, t)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_torch_compile_traces_the_fused_ops():
    # The graphs AOTAutograd hands the compiler: the linear op fused (forward through its fused
    # op, backward through scale_grad_), cross_entropy split (inductor would copy its saved N x V
    # gradient before scale_grad_ mutates it: xent_autograd.cpp, traced).
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm.code
            return make_boxed_func(gm.forward)

        return compiler

    step, reference = fused_step(False)
    leaves, t = step_inputs("cpu")
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    got = run_step(torch.compile(step, backend=backend, fullgraph=True), leaves, t)
    for g, w in zip(got, run_step(reference, leaves, t)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert "xent.cross_entropy_fwd_bwd" not in graphs["forward"]
    assert "xent.cross_entropy_fwd." in graphs["forward"]
    assert "xent.linear_cross_entropy_fwd_bwd" in graphs["forward"]
    assert "scale_grad_" in graphs["backward"]
    assert "xent.cross_entropy_bwd." in graphs["backward"]
    assert "linear_cross_entropy_bwd." not in graphs["backward"]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_scale_grad_reads_the_scale_on_the_device(dtype):
    # Under a captured graph the scale is whatever the tensor holds at replay: 1 leaves the
    # gradient alone, anything else scales it; no host read could give both from one capture.
    grad = torch.randn(33, 4099, device="cuda").to(dtype)
    scale = torch.ones((), device="cuda")
    static = grad.clone()
    torch.ops.xent.scale_grad_(grad.clone(), scale)  # loads the kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.xent.scale_grad_(static, scale)
    for s in (1.0, 0.25, 1.0, -2.0):
        static.copy_(grad)
        scale.fill_(s)
        graph.replay()
        torch.testing.assert_close(static, (grad.float() * s).to(dtype), rtol=0, atol=0)


# --- output_mask: only the gradients some tensor wants --------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])  # the fused path and the split one
@pytest.mark.parametrize("frozen", ["weight", "hidden", "bias"])
@pytest.mark.parametrize("device", DEVICES)
def test_linear_frozen_tensors_get_no_gradient_and_the_others_torchs(reduction, frozen, device):
    hidden, weight, bias, target = lin.make(n=12, d=8, v=23)
    leaves = {"hidden": hidden, "weight": weight, "bias": bias}
    ours = {k: v.to(device).clone().requires_grad_(k != frozen) for k, v in leaves.items()}
    refs = {k: v.clone().requires_grad_(k != frozen) for k, v in leaves.items()}
    loss = xent.torch.linear_cross_entropy(
        ours["hidden"], ours["weight"], target.to(device), bias=ours["bias"], reduction=reduction
    )
    ref = lin.torch_linear_ce(
        refs["hidden"], refs["weight"], target, bias=refs["bias"], reduction=reduction
    )
    up = torch.rand(ref.shape, generator=torch.Generator().manual_seed(3)) + 0.5
    loss.backward(up.to(device))
    ref.backward(up)
    assert ours[frozen].grad is None
    for k in leaves:
        if k != frozen:
            torch.testing.assert_close(ours[k].grad.cpu(), refs[k].grad, rtol=1e-4, atol=1e-5)


def test_linear_ops_skip_the_gradients_not_asked_for():
    # What the mask changes in the ops themselves: (0,) in place of each gradient not asked for,
    # and the others equal to the full call's.
    hidden, weight, bias, target = lin.make(n=6, d=4, v=9)
    args = (hidden, weight, bias, target, None, -100, 1, 0.0, 0.0, 0.0)
    full = torch.ops.xent.linear_cross_entropy_fwd_bwd(*args, [True, True, True])
    head_frozen = torch.ops.xent.linear_cross_entropy_fwd_bwd(*args, [True, False, False])
    assert head_frozen[3].shape == (0,) and head_frozen[4].shape == (0,)
    torch.testing.assert_close(head_frozen[2], full[2], rtol=0, atol=0)
    lse = full[1]
    split = torch.ops.xent.linear_cross_entropy_bwd(
        torch.ones(()),
        hidden,
        weight,
        bias,
        target,
        None,
        lse,
        -100,
        1,
        0.0,
        0.0,
        0.0,
        [False, True, False],
    )
    assert split[0].shape == (0,) and split[2].shape == (0,)
    torch.testing.assert_close(split[1], full[3], rtol=1e-5, atol=1e-6)
