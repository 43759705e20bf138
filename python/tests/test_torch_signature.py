"""xent.torch.cross_entropy and CrossEntropyLoss as drop-ins for torch's: the same signature,
torch's own argument patterns (positional, legacy size_average / reduce, every layout and target
kind) giving the same losses and gradients, and bad arguments giving torch's exception type and
message, with nothing written. The side outputs (lse, z-loss term) against plain torch formulas.
"""

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import xent.torch

C = 7


def inputs(shape=(5, C), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    rows = shape[:1] + shape[2:] if len(shape) > 1 else ()
    t = torch.randint(0, shape[1] if len(shape) > 1 else shape[0], rows, generator=g)
    return x, t


def both(args, kwargs=None, x_index=0):
    """Loss and input gradient of torch's and xent's cross_entropy on the same arguments (the
    input, args[x_index], is made a leaf requiring grad for each)."""
    kwargs = kwargs or {}
    results = []
    for fn in (F.cross_entropy, xent.torch.cross_entropy):
        a = list(args)
        a[x_index] = a[x_index].detach().clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation warning for the legacy args
            loss = fn(*a, **kwargs)
        loss.sum().backward()
        results.append((loss.detach(), a[x_index].grad))
    return results


def assert_same(args, kwargs=None):
    (ref, ref_grad), (mine, grad) = both(args, kwargs)
    assert mine.shape == ref.shape and mine.dtype == ref.dtype
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_signature_is_torchs_then_keyword_only_extensions():
    torch_params = list(inspect.signature(F.cross_entropy).parameters.values())
    params = list(inspect.signature(xent.torch.cross_entropy).parameters.values())
    n = len(torch_params)
    assert [(p.name, p.default, p.kind) for p in params[:n]] == [
        (p.name, p.default, p.kind) for p in torch_params
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[n:])
    assert {"z_loss", "softcap", "inplace_backward", "return_lse"} <= {p.name for p in params[n:]}


@pytest.mark.parametrize(
    "pattern",
    [
        lambda x, t, w: ((x, t), {}),
        lambda x, t, w: ((x, t, w), {}),
        lambda x, t, w: ((x, t, w, None, -100, None, "mean"), {}),
        lambda x, t, w: ((x, t, w, None, 3, None, "sum", 0.1), {}),
        lambda x, t, w: ((x, t, None, None, 2, None, "none"), {}),
        lambda x, t, w: ((x, t), dict(weight=w, ignore_index=1, label_smoothing=0.2)),
        lambda x, t, w: ((x, t), dict(reduction="sum", label_smoothing=1.0)),
        # the legacy arguments, as torch maps them to a reduction
        lambda x, t, w: ((x, t, w, False), {}),
        lambda x, t, w: ((x, t, w, True, -100, False), {}),
        lambda x, t, w: ((x, t), dict(size_average=False, reduce=True)),
        lambda x, t, w: ((x, t), dict(reduce=False, reduction="sum")),
        lambda x, t, w: ((x, t), dict(size_average=True, reduction="none")),
    ],
)
def test_torchs_argument_patterns(pattern):
    x, t = inputs()
    t[2] = 3
    w = torch.rand(C, generator=torch.Generator().manual_seed(1)) + 0.5
    args, kwargs = pattern(x, t, w)
    assert_same(args, kwargs)


@pytest.mark.parametrize(
    "shape", [(C,), (5, C), (4, C, 3), (2, C, 3, 2), (2, C, 1, 2, 2), (0, C), (2, C, 0)]
)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_layout_with_class_ids(shape, reduction):
    x, t = inputs(shape)
    assert_same((x, t), dict(reduction=reduction, label_smoothing=0.1))


@pytest.mark.parametrize("shape", [(C,), (5, C), (4, C, 3), (2, C, 3, 2)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_layout_with_class_probabilities(shape, reduction):
    x, _ = inputs(shape)
    p = torch.softmax(torch.randn(shape, generator=torch.Generator().manual_seed(2)), dim=-1)
    assert_same((x, p), dict(reduction=reduction, label_smoothing=0.1))


def test_target_dtypes_torch_takes():
    x, t = inputs()
    assert_same((x, t.to(torch.uint8)))
    p = torch.softmax(torch.randn(x.shape), dim=-1)
    assert_same((x, p.double()))  # probabilities of another float dtype
    assert_same((x, p.half()))


def test_non_contiguous_and_expanded_inputs():
    x, t = inputs((C, 5))
    assert_same((x.t(), torch.randint(0, C, (5,))))  # (5, C) with the class dimension strided
    x, t = inputs((3, C, 4))
    assert_same((x[:, :, ::2], t[:, ::2]))


def _bad_calls():
    x, t = inputs((3, 5))
    w = torch.ones(5)
    return {
        "batch size": ((x, t[:2]), {}),
        "target size (N, C, d1)": ((torch.randn(3, 5, 4), torch.zeros(3, 3, dtype=torch.long)), {}),
        "target rank (N, C, d1)": ((torch.randn(3, 5, 4), torch.zeros(3, dtype=torch.long)), {}),
        "2-D class ids": ((x, torch.zeros(3, 4, dtype=torch.long)), {}),
        "class ids of input's shape": ((x, torch.zeros(3, 5, dtype=torch.long)), {}),
        "target out of range": ((x, torch.tensor([1, 2, 7])), {}),
        "negative target": ((x, torch.tensor([1, 2, -3])), {}),
        "reduction": ((x, t), dict(reduction="avg")),
        "reduction None": ((x, t), dict(reduction=None)),
        "label_smoothing > 1": ((x, t), dict(label_smoothing=1.5)),
        "weight size": ((x, t), dict(weight=torch.ones(6))),
        "weight rank": ((x, t), dict(weight=torch.ones(5, 1))),
        "weight requires grad": ((x, t), dict(weight=w.clone().requires_grad_())),
        "int16 target": ((x, t.short()), {}),
        "bool target": ((x, t > 1), {}),
        "float class ids": ((x, t.float()), {}),
        "probabilities with ignore_index": ((x, torch.rand(3, 5)), dict(ignore_index=1)),
        "target on meta": ((x, t.to("meta")), {}),
        "float ignore_index": ((x, t), dict(ignore_index=1.5)),
    }


# Where torch's message comes from deep inside aten (a dtype or device check written for its own
# kernels), xent gives the same type with a message of its own that names the argument.
OWN_MESSAGE = {
    "target out of range",
    "negative target",
    "target on meta",
    "weight requires grad",
    "float ignore_index",
}


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_bad_arguments_raise_torchs_error(case):
    args, kwargs = _bad_calls()[case]
    with pytest.raises(Exception) as ref:
        F.cross_entropy(*args, **kwargs)
    x = args[0].clone()
    with pytest.raises(Exception) as mine:
        xent.torch.cross_entropy(x, *args[1:], inplace_backward=True, **kwargs)
    assert type(mine.value) is type(ref.value), (mine.value, ref.value)
    if case not in OWN_MESSAGE:
        assert str(mine.value) == str(ref.value)
    torch.testing.assert_close(x, args[0], rtol=0, atol=0)  # nothing written


def test_a_bad_target_dtype_gets_the_installed_torchs_message(monkeypatch):
    # torch's wording of this error differs between versions: xent asks the torch it runs with.
    x, t = inputs((3, 5))
    seen = []

    def other_torch(input, target, *args, **kwargs):
        seen.append(target.dtype)
        raise RuntimeError(f"another wording for {target.dtype}")

    monkeypatch.setattr(F, "cross_entropy", other_torch)
    with pytest.raises(RuntimeError, match="^another wording for torch.int16$"):
        xent.torch.cross_entropy(x, t.short())
    with pytest.raises(RuntimeError, match="^another wording for torch.int64$"):
        xent.torch.cross_entropy(x, torch.zeros(3, 5, dtype=torch.long))  # not probabilities
    # A torch call that does not raise (fake tensors' meta checks): xent's own message.
    monkeypatch.setattr(F, "cross_entropy", lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="target must hold class ids of an integer type"):
        xent.torch.cross_entropy(x, t > 1)
    assert seen == [torch.int16, torch.int64]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_is_torchs_with_the_same_state(reduction):
    w = torch.rand(C) + 0.5
    ref = torch.nn.CrossEntropyLoss(w, None, 2, None, reduction, 0.1)
    mine = xent.torch.CrossEntropyLoss(w, None, 2, None, reduction, 0.1)
    assert isinstance(mine, torch.nn.CrossEntropyLoss)
    assert mine.state_dict().keys() == ref.state_dict().keys()
    assert (mine.ignore_index, mine.reduction, mine.label_smoothing) == (2, reduction, 0.1)
    x, t = inputs((4, C, 3))
    torch.testing.assert_close(mine(x, t), ref(x, t))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = xent.torch.CrossEntropyLoss(size_average=False)
    assert legacy.reduction == "sum"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_side_outputs_lse_and_z_loss_term(reduction, weighted):
    x, t = inputs((4, C, 3))
    t[1, 2] = -100
    w = torch.rand(C) + 0.5 if weighted else None
    z = 0.01
    out = xent.torch.cross_entropy(
        x, t, w, reduction=reduction, z_loss=z, return_lse=True, return_z_loss=True
    )
    keep = t != -100
    lse = torch.logsumexp(x, dim=1) * keep
    torch.testing.assert_close(out.lse, lse)
    term = z * lse**2
    if reduction == "sum":
        term = term.sum()
    elif reduction == "mean":
        term = term.sum() / (w[t.clamp(min=0)] * keep if weighted else keep).sum()
    torch.testing.assert_close(out.z_loss, term)
    ref = F.cross_entropy(x, t, w, reduction=reduction) + term
    torch.testing.assert_close(out.loss, ref)
    alone = xent.torch.cross_entropy(x, t, w, reduction=reduction, z_loss=z)
    torch.testing.assert_close(out.loss, alone, rtol=0, atol=0)
    assert out.lse.grad_fn is None and out.z_loss.grad_fn is None


def test_side_outputs_not_asked_for_are_none():
    x, t = inputs()
    out = xent.torch.cross_entropy(x, t, return_lse=True)
    assert isinstance(out, xent.torch.CrossEntropyOutput) and out.z_loss is None
    assert isinstance(xent.torch.cross_entropy(x, t), torch.Tensor)


def test_compiles_fullgraph_with_torchs_layout():
    x, t = inputs((2, C, 3))

    def fn(a, b):
        return xent.torch.cross_entropy(a, b, None, None, -100, None, "mean", 0.1)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    xr = x.clone().requires_grad_()
    compiled(xr, t).backward()
    xe = x.clone().requires_grad_()
    F.cross_entropy(xe, t, label_smoothing=0.1).backward()
    torch.testing.assert_close(xr.grad, xe.grad)


@pytest.mark.parametrize("label_smoothing", [-0.1, -1.0, -5.0, float("-inf"), float("nan")])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("soft", [False, True], ids=["class_ids", "probabilities"])
def test_label_smoothing_at_or_below_zero_is_none_as_in_torch(label_smoothing, reduction, soft):
    # torch smooths only for label_smoothing > 0: a negative value (or NaN) gives the plain loss.
    x, t = inputs((6, C))
    if soft:
        t = torch.softmax(torch.randn(6, C, generator=torch.Generator().manual_seed(5)), dim=1)
    else:
        t[2] = -100
    assert_same((x, t), dict(reduction=reduction, label_smoothing=label_smoothing))
    assert_same(
        (x, t),
        dict(reduction=reduction, weight=torch.rand(C) + 0.5, label_smoothing=label_smoothing),
    )


@pytest.mark.parametrize("label_smoothing", [1.5, float("inf")])
def test_label_smoothing_above_one_raises_torchs_error(label_smoothing):
    x, t = inputs()
    with pytest.raises(RuntimeError) as ref:
        F.cross_entropy(x, t, label_smoothing=label_smoothing)
    with pytest.raises(RuntimeError) as mine:
        xent.torch.cross_entropy(x, t, label_smoothing=label_smoothing)
    assert str(mine.value) == str(ref.value)
    with pytest.raises(RuntimeError) as module:
        xent.torch.CrossEntropyLoss(label_smoothing=label_smoothing)(x, t)
    assert str(module.value) == str(ref.value)
