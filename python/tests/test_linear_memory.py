"""xent.torch.linear_cross_entropy's training memory choices, order ("automatic", "fast",
"low_memory") and accumulate ("fp32", "output"): every choice against torch's
cross_entropy(hidden @ weight.T) and the float64 oracle, on the fused path (reduction mean / sum),
the split one (reduction none: linear_backward) and the forward alone; the ops, their fake
kernels and torch.compile with the choices; bad values; and the workspace the binding allocates
(linear_workspace_bytes), observed by torch's profiler, since the low-memory order's peak is not
measurable on the CPU."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import test_linear_cross_entropy as lin  # loads xent.torch
import xent.torch
from test_cross_entropy import requires_cuda, weights

ORDERS = ["automatic", "fast", "low_memory"]
ACCUMULATIONS = ["fp32", "output"]
# V above the CPU's low-memory panel (1024 weight rows at 2 threads), so that order runs several
# panels, and a multiple of no tile.
N, D, V = 29, 24, 2503


def make(dtype=torch.float32, seed=0, soft=False):
    hidden, weight, bias, target = lin.make(N, D, V, dtype=dtype, seed=seed)
    target[::6] = -100
    if soft:
        g = torch.Generator().manual_seed(seed + 1)
        target = torch.softmax(torch.randn(N, V, generator=g), -1).to(dtype)
    return hidden, weight, bias, target


OPTION_SETS = {
    "plain": dict(),
    "weighted+smoothing": dict(class_weight="w", label_smoothing=0.25),
    "z_loss+softcap": dict(z_loss=2.0**-7, softcap=4.0),
}


def options(name):
    kw = dict(OPTION_SETS[name])
    if kw.get("class_weight") == "w":
        kw["class_weight"] = weights(c=V)
    return kw


def widened(hidden, weight, target, bias):
    """The same values in float64, for the oracle."""
    return hidden.double(), weight.double(), target, bias.double()


def widened_options(kw):
    cw = kw.get("class_weight")
    return kw if cw is None else dict(kw, class_weight=cw.double())


def run(fn, hidden, weight, target, bias, **kw):
    """fn's loss and the gradients of hidden, weight and bias, after a backward with a random
    upstream gradient (the same for every fn)."""
    return lin.losses_and_grads(fn, hidden, weight, target, bias, **kw)


def ours(hidden, weight, target, bias, **kw):
    """run() of xent.torch.linear_cross_entropy."""
    return run(xent.torch.linear_cross_entropy, hidden, weight, target, bias, **kw)


def assert_all_close(got, want, **tol):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("accumulate", ACCUMULATIONS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", list(OPTION_SETS))
def test_every_choice_matches_torch_and_float64(order, accumulate, reduction, opts):
    kw = dict(options(opts), reduction=reduction)
    hidden, weight, bias, target = make()
    got = ours(hidden, weight, target, bias, order=order, accumulate=accumulate, **kw)
    # torch's own F.cross_entropy(h @ w.T + b) in float32 (softcap and z-loss in torch ops)...
    assert_all_close(
        got, run(lin.torch_linear_ce, hidden, weight, target, bias, **kw), rtol=1e-4, atol=1e-5
    )
    # ...and the float64 oracle on the same values.
    exact = run(lin.torch_linear_ce, *widened(hidden, weight, target, bias), **widened_options(kw))
    assert_all_close([g.double() for g in got], exact, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("soft", [False, True], ids=["class ids", "soft targets"])
def test_float64_every_order_is_exact(order, reduction, soft):
    # The CPU's float64 path sums everything in double: the low-memory order's reordered sums
    # agree with the oracle to double precision, as the fast order's do. Soft targets against
    # torch's own class-probability cross-entropy.
    hidden, weight, bias, target = make(torch.float64, soft=soft)
    if soft:
        kw = dict(reduction=reduction, label_smoothing=0.25)
        oracle = lambda h, w, t, b, **k: F.cross_entropy(F.linear(h, w, b), t, **k)  # noqa: E731
    else:
        kw = dict(reduction=reduction, label_smoothing=0.25, z_loss=2.0**-7, softcap=4.0)
        kw["class_weight"] = weights(c=V).double()
        oracle = lin.torch_linear_ce
    got = ours(hidden, weight, target, bias, order=order, **kw)
    want = run(oracle, hidden, weight, target, bias, **kw)
    for g in got:
        assert g.dtype == torch.float64
    assert_all_close(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("accumulate", ACCUMULATIONS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_every_choice(order, accumulate, reduction, dtype):
    # 16-bit gradients: the low-memory order sums d_hidden in its N x D float buffer, and
    # accumulate="output" rounds d_weight once per row chunk. Errors against the float64 oracle
    # on the same values, within what test_linear_cross_entropy allows torch's float32 path.
    hidden, weight, bias, target = make(dtype)
    kw = dict(reduction=reduction, label_smoothing=0.1)
    got = ours(hidden, weight, target, bias, order=order, accumulate=accumulate, **kw)
    exact = run(lin.torch_linear_ce, *widened(hidden, weight, target, bias), **kw)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for g, w in zip(got, exact):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * w.abs().max().item())


@pytest.mark.parametrize("order", ORDERS)
def test_forward_alone_is_the_same_for_every_order(order):
    # Under no_grad the op runs xent::linear_forward, which has one order: the choice is checked
    # and changes nothing.
    hidden, weight, bias, target = make()
    with torch.no_grad():
        got = xent.torch.linear_cross_entropy(hidden, weight, target, bias, order=order)
        want = xent.torch.linear_cross_entropy(hidden, weight, target, bias)
    assert torch.equal(got, want)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mask", [[True, False, False], [False, True, True], [True, True, True]])
def test_ops_every_order_and_output_mask(order, mask):
    # The ops themselves, float64: the fused op and the split backward (its order applies there
    # too) against the fast order's gradients, with the gradients not asked for left out.
    hidden, weight, bias, target = make(torch.float64)
    code = {"automatic": 0, "fast": 1, "low_memory": 2}[order]
    args = (hidden, weight, bias, target, None, -100, 2, 0.1, 0.0, 0.0)
    fast = torch.ops.xent.linear_cross_entropy_fwd_bwd(*args, [True, True, True], 1, 0)
    fused = torch.ops.xent.linear_cross_entropy_fwd_bwd(*args, mask, code, 1)
    up = torch.tensor(0.75, dtype=torch.float64)
    split = torch.ops.xent.linear_cross_entropy_bwd(
        up, hidden, weight, bias, target, None, fast[1], -100, 2, 0.1, 0.0, 0.0, mask, code, 0
    )
    torch.testing.assert_close(fused[0], fast[0], rtol=1e-13, atol=0)
    for i, wanted in enumerate(mask):
        if not wanted:
            assert fused[2 + i].shape == (0,) and split[i].shape == (0,)
            continue
        torch.testing.assert_close(fused[2 + i], fast[2 + i], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(split[i], fast[2 + i] * 0.75, rtol=1e-12, atol=1e-14)


def test_opcheck_with_the_choices():
    hidden, weight, bias, target = lin.make(n=6, d=4, v=9)
    for order in (0, 1, 2):
        for accumulate in (0, 1):
            torch.library.opcheck(
                torch.ops.xent.linear_cross_entropy_fwd.default,
                (hidden.clone().requires_grad_(), weight.clone().requires_grad_(), bias, target)
                + (None, -100, 0, 0.0, 0.0, 0.0, order, accumulate),
            )
            torch.library.opcheck(
                torch.ops.xent.linear_cross_entropy_fwd_bwd.default,
                (hidden, weight, bias, target, None, -100, 1, 0.1, 0.0, 0.0)
                + ([True, True, True], order, accumulate),
            )


@pytest.mark.parametrize("order", ["fast", "low_memory"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph_with_the_choices(order, reduction):
    torch._dynamo.reset()
    hidden, weight, bias, target = make()

    def step(x, w, b):
        loss = xent.torch.linear_cross_entropy(
            torch.relu(x), w, target, b, reduction=reduction, order=order, accumulate="output"
        )
        return loss.sum() * 3.0

    def reference(x, w, b):
        return lin.torch_linear_ce(torch.relu(x), w, target, b, reduction=reduction).sum() * 3.0

    results = lin.compiled_and_reference(step, reference, hidden, weight, bias)
    assert_all_close(*results, rtol=1e-4, atol=1e-5)


def test_module_and_patch_forward_the_choices():
    hidden, weight, bias, target = make()
    module = xent.torch.LinearCrossEntropyLoss(reduction="sum", order="low_memory")
    assert "order='low_memory'" in repr(module)
    got = run(lambda h, w, t, b: module(h, w, t, b), hidden, weight, target, bias)
    assert_all_close(
        got,
        run(lin.torch_linear_ce, hidden, weight, target, bias, reduction="sum"),
        rtol=1e-4,
        atol=1e-5,
    )


def test_patched_model_trains_in_the_low_memory_order():
    hf = pytest.importorskip("test_huggingface")
    ref, _ = hf.make_pair("llama")
    mine = xent.torch.patch(copy.deepcopy(ref), order="low_memory", accumulate="output")
    ids, labels = hf.batch()
    out_ref, out = ref(ids, labels=labels), mine(ids, labels=labels)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=0)
    out_ref.loss.backward()
    out.loss.backward()
    hf.assert_same_grads(ref, mine)


def test_bad_values_raise_value_error_naming_the_argument():
    hidden, weight, bias, target = make()
    call = xent.torch.linear_cross_entropy
    for kw, name in (
        (dict(order="slow"), "order"),
        (dict(order=2), "order"),
        (dict(order=None), "order"),
        (dict(accumulate="bf16"), "accumulate"),
        (dict(accumulate=0), "accumulate"),
    ):
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            call(hidden, weight, target, bias, **kw)
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            xent.torch.linear_workspace_bytes(hidden, weight, **kw)
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            xent.torch.LinearCrossEntropyLoss(**kw)
    with pytest.raises(TypeError):  # keyword-only
        call(hidden, weight, target, bias, None, -100, "mean", 0.0, 0.0, None, "fast")
    # The ops' own checks, in the kernels and in the fake kernels torch.compile traces with.
    args = (hidden, weight, bias, target, None, -100, 1, 0.0, 0.0, 0.0)
    for device in ("cpu", "meta"):
        a = [x.to(device) if isinstance(x, torch.Tensor) else x for x in args]
        with pytest.raises(ValueError, match="order must be 0"):
            torch.ops.xent.linear_cross_entropy_fwd(*a, 3, 0)
        with pytest.raises(ValueError, match="accumulate must be 0"):
            torch.ops.xent.linear_cross_entropy_fwd_bwd(*a, [True, True, True], 0, 2)
        up, lse = torch.ones((), device=device), torch.zeros(N, device=device)
        with pytest.raises(ValueError, match="order must be 0"):
            torch.ops.xent.linear_cross_entropy_bwd(
                up, *a[:5], lse, *a[5:], [True, True, True], -1, 0
            )


# --- the workspace the binding allocates -----------------------------------------------------------


def allocations(fn):
    """The bytes of every tensor allocated while fn() runs on the CPU (torch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [
        e.cpu_memory_usage
        for e in prof.events()
        if e.name in ("aten::empty", "aten::empty_strided") and e.cpu_memory_usage > 0
    ]


# A shape whose V x D float sum (4 V D bytes: 8 MiB) is larger than every other buffer of a call.
WN, WD, WV = 64, 512, 4096


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("accumulate", ACCUMULATIONS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_call_allocates_linear_workspace_bytes_and_nothing_more(order, accumulate, reduction):
    # Everything a training step allocates: its gradients, its per-row outputs (loss, LSE, the
    # loss in hidden's dtype) and one workspace of exactly linear_workspace_bytes(...).
    hidden, weight, _, target = lin.make(WN, WD, WV, dtype=torch.bfloat16)
    h, w = (a.clone().requires_grad_() for a in (hidden, weight))
    kw = dict(reduction=reduction, order=order, accumulate=accumulate)
    want = xent.torch.linear_workspace_bytes(hidden, weight, order=order, accumulate=accumulate)
    grads = 2 * (WN * WD + WV * WD)
    per_row = 16 * WN + 64  # loss, LSE, the upstream gradient, small casts
    if reduction == "none":
        loss = xent.torch.linear_cross_entropy(h, w, target, **kw)
        seen = allocations(lambda: loss.backward(torch.ones_like(loss)))
    else:
        seen = allocations(lambda: xent.torch.linear_cross_entropy(h, w, target, **kw))
    assert want in seen
    assert grads + want <= sum(seen) <= grads + want + per_row


@pytest.fixture
def two_threads():
    # The CPU plan keeps a converted weight block and (accumulate="output") a d_weight block of
    # 256 rows per thread: at 16 threads those hold WV x WD floats twice, more than the float sum
    # the test compares with. Two threads, whatever the machine has, keep them below it.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_low_memory_workspace_holds_no_vocab_by_hidden_float_sum(two_threads):
    hidden, weight = (torch.empty(n, WD, dtype=torch.bfloat16) for n in (WN, WV))
    sizes = {
        (order, accumulate): xent.torch.linear_workspace_bytes(
            hidden, weight, order=order, accumulate=accumulate
        )
        for order in ORDERS
        for accumulate in ACCUMULATIONS
    }
    vd_sum = 4 * WV * WD
    # automatic is the fast order, whose fp32 accumulation keeps the V x D float sum...
    assert sizes["automatic", "fp32"] == sizes["fast", "fp32"] >= vd_sum
    assert sizes["automatic", "output"] == sizes["fast", "output"]
    # ...which accumulate="output" and the low-memory order (for either accumulation) drop: their
    # whole workspace is smaller than that sum alone.
    assert sizes["fast", "output"] < vd_sum
    assert sizes["low_memory", "fp32"] == sizes["low_memory", "output"] < vd_sum
    # hidden (..., D) counts its rows, as linear_cross_entropy does.
    batched = hidden.reshape(2, WN // 2, WD)
    assert xent.torch.linear_workspace_bytes(batched, weight) == sizes["automatic", "fp32"]
    # A frozen LM head needs no float sum of d_weight in any order.
    frozen = xent.torch.linear_workspace_bytes(hidden, weight, d_weight=False)
    assert frozen == sizes["fast", "output"]
    # A forward alone has one order and no gradient buffers.
    forward = {
        xent.torch.linear_workspace_bytes(hidden, weight, training=False, order=o) for o in ORDERS
    }
    assert len(forward) == 1 and forward.pop() <= sizes["low_memory", "fp32"]


@pytest.mark.parametrize("shape", [(8192, 4096, 128256), (16384, 2304, 256000)])
def test_low_memory_workspace_at_the_issue_shapes(shape):
    # No values are read: expanded 0-d tensors stand for the bf16 hidden states and LM head.
    n, d, v = shape
    one = torch.zeros((), dtype=torch.bfloat16)
    hidden, weight = one.expand(n, d), one.expand(v, d)
    low = xent.torch.linear_workspace_bytes(hidden, weight, order="low_memory")
    fast = xent.torch.linear_workspace_bytes(hidden, weight, order="fast")
    assert fast >= 4 * v * d  # the V x D float sum
    # The low-memory order: 256 MiB of logits tiles (the binding's budget) beyond its fixed
    # buffers: d_hidden's N x D float sum, each row's LSE and target mass, and a panel's (the
    # CPU's panel has P = 256 weight rows per thread, at least 1024; its buffers hold at most
    # four floats per panel row and hidden unit: the panel's d_weight sum, converted weights).
    p = 256 * max(4, torch.get_num_threads())
    assert low <= 256 * 2**20 + 4 * n * d + 8 * n + 4 * 4 * p * (d + 1)


# --- CUDA ------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("accumulate", ACCUMULATIONS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_every_choice_matches_torch(order, accumulate, reduction):
    # 8192 x 32000 bf16 logits exceed the workspace's 256 MiB of row chunks: the fast order runs
    # several chunks (accumulate="output" rounds d_weight after each), the low-memory order
    # several panels of 8192 weight rows.
    hidden, weight, _, target = (a.cuda() for a in lin.make(8192, 64, 32000, dtype=torch.bfloat16))
    target[::7] = -100
    kw = dict(reduction=reduction, label_smoothing=0.1)
    got = ours(hidden, weight, target, None, order=order, accumulate=accumulate, **kw)
    want = run(lin.torch_linear_ce, hidden, weight, target, None, **kw)
    for g, w in zip(got, want):  # bf16 gradients: bounds relative to each tensor's scale
        w = w.float()
        torch.testing.assert_close(g.float(), w, rtol=3e-2, atol=1e-2 * w.abs().max().item())


@requires_cuda
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("accumulate", ACCUMULATIONS)
def test_cuda_peak_is_the_gradients_and_the_workspace(order, accumulate):
    # What a training step adds to the allocated memory at its peak: the gradients it returns,
    # the per-row outputs and the workspace linear_workspace_bytes gives, nothing else.
    n, d, v = 4096, 256, 32000
    hidden, weight, _, target = (a.cuda() for a in lin.make(n, d, v, dtype=torch.bfloat16))
    h, w = (a.clone().requires_grad_() for a in (hidden, weight))
    kw = dict(order=order, accumulate=accumulate)

    def step():
        xent.torch.linear_cross_entropy(h, w, target, **kw).backward()
        h.grad = w.grad = None

    step()  # torch's cuBLAS handle and xent's per-device buffers, which later calls reuse
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    workspace = xent.torch.linear_workspace_bytes(hidden, weight, **kw)
    grads = 2 * (n * d + v * d)
    # Each allocation is rounded up to the caching allocator's 512-byte blocks.
    assert extra <= grads + workspace + 16 * n + 8 * 512
