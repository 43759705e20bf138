"""xent.torch.distributed.vocab_parallel_cross_entropy on the CPU: 2 and 4 processes over gloo,
started by torch.multiprocessing, each holding a slice of the vocabulary.

Every process builds the same full inputs from a seed, keeps its slice and runs the sharded call
forward and backward; the test process then holds each rank's loss and gradient slice to the
unsharded single-process call (xent.torch.cross_entropy on the whole vocabulary: within 1e-6
relative) and to a float64 reference written out with torch's own ops, for every option, even
and uneven splits, an empty slice, all rows ignored, soft targets and bfloat16.
"""

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import xent.torch
import xent.torch.distributed as xd

# name -> (rows shape, V, dtype, options); options as vocab_parallel_cross_entropy's keywords,
# plus "soft" (class probabilities), "int32", "ignore" ("some" / "all"), "split" ("even" for
# Megatron's default, else explicit slice sizes per world size), "scale" (the loss's gradient).
CASES = {
    "mean": ((6,), 37, torch.float32, {"reduction": "mean"}),
    "sum": ((6,), 37, torch.float32, {"reduction": "sum", "scale": 0.5}),
    "none": ((2, 3), 37, torch.float32, {"reduction": "none"}),
    "even_split": ((5,), 40, torch.float32, {"reduction": "mean", "split": "even"}),
    "smoothing": ((6,), 37, torch.float32, {"reduction": "mean", "label_smoothing": 0.1}),
    "weights": ((7,), 37, torch.float32, {"reduction": "mean", "weight": True, "ignore": "some"}),
    "weights_none": ((7,), 37, torch.float32, {"reduction": "none", "weight": True}),
    "z_loss_softcap": (
        (6,),
        37,
        torch.float32,
        {"reduction": "mean", "z_loss": 1e-3, "softcap": 5.0},
    ),
    "ignored_some": ((8,), 37, torch.float32, {"reduction": "mean", "ignore": "some"}),
    "ignored_all": ((4,), 37, torch.float32, {"reduction": "mean", "ignore": "all"}),
    "ignored_all_none": ((4,), 37, torch.float32, {"reduction": "none", "ignore": "all"}),
    "int32": ((6,), 37, torch.float32, {"reduction": "sum", "int32": True}),
    "soft": ((5,), 37, torch.float32, {"reduction": "mean", "soft": True}),
    "soft_smoothing": (
        (5,),
        37,
        torch.float32,
        {"reduction": "none", "soft": True, "label_smoothing": 0.2},
    ),
    "no_rows": ((0,), 37, torch.float32, {"reduction": "sum"}),
    "bfloat16": ((6,), 37, torch.bfloat16, {"reduction": "mean", "label_smoothing": 0.1}),
}

# The fused linear cases: name -> (rows shape, D, V, dtype, options); "bias": an LM head bias,
# "frozen": the head's weight needs no gradient.
LINEAR_CASES = {
    "mean": ((6,), 8, 37, torch.float32, {"reduction": "mean", "bias": True}),
    "sum_smoothing": ((2, 3), 8, 37, torch.float32, {"reduction": "sum", "label_smoothing": 0.1}),
    "none_weights": ((7,), 8, 37, torch.float32, {"reduction": "none", "weight": True}),
    "z_loss_softcap_ignored": (
        (8,),
        8,
        37,
        torch.float32,
        {"reduction": "mean", "z_loss": 1e-3, "softcap": 5.0, "ignore": "some", "bias": True},
    ),
    "soft": ((5,), 8, 37, torch.float32, {"reduction": "mean", "soft": True}),
    "even_split_frozen": (
        (5,),
        8,
        40,
        torch.float32,
        {"reduction": "mean", "split": "even", "frozen": True},
    ),
    "ignored_all": ((4,), 8, 37, torch.float32, {"reduction": "sum", "ignore": "all"}),
    "bfloat16": ((6,), 8, 37, torch.bfloat16, {"reduction": "mean", "bias": True}),
}

# Uneven slices of V = 37: world 4 has an empty one, and a world of 2 the larger slice first.
SPLITS = {2: [20, 17], 4: [10, 0, 20, 7]}


def _inputs(name):
    """The full inputs of a case, the same in every process."""
    rows, vocab, dtype, opts = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    n = 1
    for r in rows:
        n *= r
    logits = (torch.randn(*rows, vocab, generator=g) * 2).to(dtype)
    if opts.get("soft"):
        target = torch.softmax(torch.randn(*rows, vocab, generator=g), -1).to(dtype)
    else:
        target = torch.randint(0, vocab, rows, generator=g)
        flat = target.view(-1)
        if opts.get("ignore") == "some":
            flat[::3] = -100
        elif opts.get("ignore") == "all":
            flat[:] = -100
        if opts.get("int32"):
            target = target.int()
    weight = torch.rand(vocab, generator=g) + 0.5 if opts.get("weight") else None
    upstream = torch.rand(rows, generator=g) + 0.5 if opts["reduction"] == "none" else None
    return logits, target, weight, upstream


def _slices(name, world):
    vocab = CASES[name][1]
    if CASES[name][3].get("split") == "even":
        return [vocab // world] * world, True
    return SPLITS[world], False


def _keywords(name):
    opts = dict(CASES[name][3])
    for k in ("soft", "int32", "ignore", "split", "scale", "weight"):
        opts.pop(k, None)
    return opts


# The device of this process's ranks: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank); set by
# _worker in each spawned process.
DEVICE = "cpu"


def _on_device(*tensors):
    return [t.to(DEVICE) if t is not None else None for t in tensors]


def _on_host(*tensors):
    return tuple(t.cpu() if t is not None else None for t in tensors)


def _run_rank(name, rank, world):
    """This rank's (loss, gradient slice) of a case."""
    logits, target, weight, upstream = _on_device(*_inputs(name))
    sizes, even = _slices(name, world)
    start = sum(sizes[:rank])
    mine = logits[..., start : start + sizes[rank]].clone().requires_grad_()
    t = target[..., start : start + sizes[rank]] if target.is_floating_point() else target
    where = {} if even else {"vocab_start": start, "vocab_size": logits.shape[-1]}
    loss = xd.vocab_parallel_cross_entropy(mine, t, weight=weight, **where, **_keywords(name))
    scale = CASES[name][3].get("scale", 1.0)
    if upstream is not None:
        loss.backward(upstream)
    else:
        (loss * scale).backward()
    return _on_host(loss.detach(), mine.grad)


def _linear_inputs(name):
    """hidden, weight, bias, target, class weights and per-row upstream of a linear case."""
    rows, d, vocab, dtype, opts = LINEAR_CASES[name]
    g = torch.Generator().manual_seed(1000 + sum(map(ord, name)))
    hidden = torch.randn(*rows, d, generator=g).to(dtype)
    weight = (torch.randn(vocab, d, generator=g) / d**0.5 * 2).to(dtype)
    bias = (torch.randn(vocab, generator=g) / 2).to(dtype) if opts.get("bias") else None
    if opts.get("soft"):
        target = torch.softmax(torch.randn(*rows, vocab, generator=g), -1).to(dtype)
    else:
        target = torch.randint(0, vocab, rows, generator=g)
        if opts.get("ignore") == "some":
            target.view(-1)[::3] = -100
        elif opts.get("ignore") == "all":
            target.fill_(-100)
    class_weight = torch.rand(vocab, generator=g) + 0.5 if opts.get("weight") else None
    upstream = torch.rand(rows, generator=g) + 0.5 if opts["reduction"] == "none" else None
    return hidden, weight, bias, target, class_weight, upstream


def _linear_keywords(name):
    opts = dict(LINEAR_CASES[name][4])
    for k in ("soft", "ignore", "split", "bias", "weight", "frozen"):
        opts.pop(k, None)
    return opts


def _linear_slices(name, world):
    vocab = LINEAR_CASES[name][2]
    if LINEAR_CASES[name][4].get("split") == "even":
        return [vocab // world] * world, True
    return SPLITS[world], False


def _backward(loss, upstream):
    if upstream is not None:
        loss.backward(upstream.to(loss.dtype))
    else:
        loss.backward()


def _run_linear_rank(name, rank, world):
    """This rank's (loss, d_hidden, d_weight rows, d_bias rows) of a linear case."""
    hidden, weight, bias, target, class_weight, upstream = _on_device(*_linear_inputs(name))
    opts = LINEAR_CASES[name][4]
    sizes, even = _linear_slices(name, world)
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    x = hidden.clone().requires_grad_()
    w = weight[start:stop].clone().requires_grad_(not opts.get("frozen"))
    b = bias[start:stop].clone().requires_grad_() if bias is not None else None
    t = target[..., start:stop] if target.is_floating_point() else target
    where = {} if even else {"vocab_start": start, "vocab_size": weight.shape[0]}
    loss = xd.vocab_parallel_linear_cross_entropy(
        x, w, t, None, b, class_weight=class_weight, **where, **_linear_keywords(name)
    )
    _backward(loss, upstream)
    return _on_host(loss.detach(), x.grad, w.grad, b.grad if b is not None else None)


def _disagreement(rank, world):
    """Rank 1 with one row more, then with another label smoothing: every rank must raise."""
    errors = []
    for what in ("rows", "options"):
        logits = torch.randn(4 + (what == "rows" and rank == 1), 37, device=DEVICE)
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=DEVICE)
        sizes = SPLITS[world]
        start = sum(sizes[:rank])
        smoothing = 0.1 if what == "options" and rank == 1 else 0.0
        try:
            xd.vocab_parallel_cross_entropy(
                logits[:, start : start + sizes[rank]],
                target,
                vocab_start=start,
                vocab_size=37,
                label_smoothing=smoothing,
            )
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _bad_inputs(rank, world):
    """Calls every rank makes wrongly in the same way: (exception type name, message) of each."""
    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    x = torch.randn(4, sizes[rank], device=DEVICE)
    y = torch.zeros(4, dtype=torch.long, device=DEVICE)
    calls = {
        "float64": lambda: xd.vocab_parallel_cross_entropy(
            x.double(), y, vocab_start=start, vocab_size=37
        ),
        "outside": lambda: xd.vocab_parallel_cross_entropy(
            x, y, vocab_start=start + 40, vocab_size=37
        ),
        "weight": lambda: xd.vocab_parallel_cross_entropy(
            x, y, vocab_start=start, vocab_size=37, weight=x.new_ones(sizes[rank] + 1)
        ),
        "half_shard": lambda: xd.vocab_parallel_cross_entropy(x, y, vocab_start=start),
    }
    return {name: _outcome(call) for name, call in calls.items()}


def _outcome(call):
    """(exception type name, message) of what call() raises, (None, "") if nothing."""
    try:
        call()
        return None, ""
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        return type(e).__name__, str(e)


def _one_rank_wrong(rank, world):
    """Calls that only the last rank makes wrongly, each followed by a right one: (exception type
    name, message) of each wrong call on this rank, and the right calls' losses. The ranks that
    did nothing wrong raise too, instead of waiting for the last in their exchange."""
    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    torch.manual_seed(3)
    x = torch.randn(4, 37, device=DEVICE)[:, start : start + sizes[rank]]
    y = torch.arange(4, device=DEVICE)
    h, w = torch.randn(4, 8, device=DEVICE), torch.randn(37, 8, device=DEVICE)
    last = rank == world - 1
    where = dict(vocab_start=start, vocab_size=37)
    calls = {
        "outside": lambda: xd.vocab_parallel_cross_entropy(
            x, y, vocab_start=start + 40 * last, vocab_size=37
        ),
        "weight": lambda: xd.vocab_parallel_cross_entropy(
            x, y, weight=x.new_ones(37 + last), **where
        ),
        "float64": lambda: xd.vocab_parallel_cross_entropy(x.double() if last else x, y, **where),
        "linear_class_weight": lambda: xd.vocab_parallel_linear_cross_entropy(
            h, w[start : start + sizes[rank]], y, class_weight=h.new_ones(37 + last), **where
        ),
        # Refused by the Python side, before the op.
        "target_shape": lambda: xd.vocab_parallel_cross_entropy(x, y[: 4 - last], **where),
        "linear_target_shape": lambda: xd.vocab_parallel_linear_cross_entropy(
            h, w[start : start + sizes[rank]], y[: 4 - last], **where
        ),
        "half_shard": lambda: xd.vocab_parallel_cross_entropy(
            x, y, vocab_start=start, vocab_size=None if last else 37
        ),
        "reduction": lambda: xd.vocab_parallel_cross_entropy(
            x, y, reduction="avg" if last else "sum", **where
        ),
        "z_loss": lambda: xd.vocab_parallel_cross_entropy(
            x, y, z_loss=None if last else 0.0, **where
        ),
        "vocab_size_range": lambda: xd.vocab_parallel_cross_entropy(
            x, y, vocab_start=start, vocab_size=2**64 if last else 37
        ),
        "logits_list": lambda: xd.vocab_parallel_cross_entropy(
            x.tolist() if last else x, y, **where
        ),
        # A linear call of no rows makes no exchange of records: its agreement exchange still.
        "linear_zero_rows": lambda: xd.vocab_parallel_linear_cross_entropy(
            h[:0],
            w[start : start + sizes[rank]],
            y[:0],
            reduction="avg" if last else "sum",
            **where,
        ),
        # A backward from class ids exchanges nothing but its agreement.
        "bwd_lse": lambda: torch.ops.xent.vocab_parallel_cross_entropy_bwd(
            x.new_ones(()),
            x,
            y,
            None,
            x.new_zeros(4 - last),
            start,
            37,
            dist.group.WORLD.group_name,
            -100,
            2,
            0.0,
            0.0,
            0.0,
        ),
    }
    got, losses = {}, []
    for name, call in calls.items():
        got[name] = _outcome(call)
        losses.append(xd.vocab_parallel_cross_entropy(x, y, reduction="sum", **where).item())
    return got, losses


def _autograd_cases(rank, world):
    """A second backward through a kept graph (reduction mean and none, logits and linear), and a
    gradient differentiated again: (first gradients, second gradients, the error of the latter)."""
    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    where = dict(vocab_start=start, vocab_size=37)
    torch.manual_seed(4)
    full, h, w = torch.randn(5, 37), torch.randn(5, 8), torch.randn(37, 8)
    y = torch.tensor([0, 3, 36, 20, 9])
    x = full[:, start : start + sizes[rank]].to(DEVICE).requires_grad_()
    h = h.to(DEVICE).requires_grad_()
    ws = w[start : start + sizes[rank]].to(DEVICE).requires_grad_()
    y = y.to(DEVICE)
    out = {}
    for reduction in ("mean", "none"):
        loss = xd.vocab_parallel_cross_entropy(x, y, reduction=reduction, **where).sum()
        (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
        (g2,) = torch.autograd.grad(loss, x)
        out[reduction] = (g1.cpu(), g2.cpu())
        lin = xd.vocab_parallel_linear_cross_entropy(h, ws, y, reduction=reduction, **where).sum()
        first = torch.autograd.grad(lin, (h, ws), retain_graph=True)
        second = torch.autograd.grad(lin, (h, ws))
        out["linear_" + reduction] = ([g.cpu() for g in first], [g.cpu() for g in second])
    errors = {}
    for name, make in {
        "logits": lambda: (xd.vocab_parallel_cross_entropy(x, y, **where).sum(), x),
        "linear": lambda: (xd.vocab_parallel_linear_cross_entropy(h, ws, y, **where).sum(), h),
    }.items():
        # Through backward(), and through autograd.grad back to the input itself (which prunes
        # whatever lies off the paths to it: an error hung on fresh leaves gave None there).
        for how, differentiate in {
            "backward": lambda g, wrt: (g * g).sum().backward(),
            "grad": lambda g, wrt: torch.autograd.grad((g * g).sum(), wrt, allow_unused=True),
        }.items():
            loss, wrt = make()
            (g,) = torch.autograd.grad(loss, wrt, create_graph=True)
            try:
                differentiate(g, wrt)
                errors[f"{name} {how}"] = None
            except RuntimeError as e:
                errors[f"{name} {how}"] = str(e)
    return out, errors


def _options_as_cross_entropy(rank, world):
    """softcap None and 0 (off), a negative label smoothing (none, as in torch): each call's loss
    beside the plain call's."""
    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    where = dict(vocab_start=start, vocab_size=37, reduction="sum")
    torch.manual_seed(5)
    x = torch.randn(4, 37, device=DEVICE)[:, start : start + sizes[rank]]
    y = torch.arange(4, device=DEVICE)
    plain = xd.vocab_parallel_cross_entropy(x, y, **where).item()
    return plain, [
        xd.vocab_parallel_cross_entropy(x, y, softcap=None, **where).item(),
        xd.vocab_parallel_cross_entropy(x, y, softcap=0, **where).item(),
        xd.vocab_parallel_cross_entropy(x, y, label_smoothing=-0.1, **where).item(),
    ]


def _worker(rank, world, init_file, out_dir, backend):
    global DEVICE
    torch.set_num_threads(1)
    if backend == "nccl":
        DEVICE = f"cuda:{rank}"
        torch.cuda.set_device(rank)
        os.environ["XENT_CHECK_RANKS"] = "1"  # the disagreement cases need the checked exchange
    # A rank left waiting in an exchange fails in minutes instead of hanging the run (gloo: 30).
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    results = {}
    for name in CASES:
        try:
            results[name] = _run_rank(name, rank, world)
        except Exception:
            results[name] = traceback.format_exc()
    for name in LINEAR_CASES:
        try:
            results["linear:" + name] = _run_linear_rank(name, rank, world)
        except Exception:
            results["linear:" + name] = traceback.format_exc()
    if rank == 0:  # the unsharded calls on the same device, against which the tests hold the ranks
        for name in CASES:
            results["unsharded:" + name] = _unsharded(name)
        for name in LINEAR_CASES:
            results["unsharded:linear:" + name] = _linear_unsharded(name)
    results["__disagreement__"] = _disagreement(rank, world)
    results["__bad__"] = _bad_inputs(rank, world)
    results["__one_wrong__"] = _one_rank_wrong(rank, world)
    results["__autograd__"] = _autograd_cases(rank, world)
    results["__options__"] = _options_as_cross_entropy(rank, world)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _gpus_for(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        return f"needs {world} GPUs"
    if not xent.torch.cuda_built():
        return "xent was built without its CUDA kernels"
    return None


@pytest.fixture(
    scope="module",
    params=[("gloo", 2), ("gloo", 4), ("nccl", 2)],
    ids=["gloo-2", "gloo-4", "nccl-2"],
)
def ranks(request, tmp_path_factory):
    """Each rank's results of every case, from one group of `world` processes: gloo on the CPU,
    or NCCL with one GPU per rank (skipped without enough GPUs)."""
    backend, world = request.param
    if backend == "nccl" and _gpus_for(world):
        pytest.skip(_gpus_for(world))
    out = tmp_path_factory.mktemp(f"{backend}{world}")
    mp.spawn(_worker, args=(world, str(out / "init"), str(out), backend), nprocs=world, join=True)
    return world, [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _unsharded(name):
    """The single-process xent call on the whole vocabulary, on this process's device (rank 0 of
    each group makes it): (loss, gradient)."""
    logits, target, weight, upstream = _on_device(*_inputs(name))
    x = logits.reshape(-1, logits.shape[-1]).clone().requires_grad_()
    t = target.reshape(-1, logits.shape[-1]) if target.is_floating_point() else target.reshape(-1)
    loss = xent.torch.cross_entropy(
        x, t.long() if not t.is_floating_point() else t, weight=weight, **_keywords(name)
    )
    scale = CASES[name][3].get("scale", 1.0)
    if upstream is not None:
        loss.backward(upstream.reshape(-1))
    else:
        (loss * scale).backward()
    if loss.dim():
        loss = loss.reshape(logits.shape[:-1])
    return _on_host(loss.detach(), x.grad.reshape(logits.shape))


def _reference(name):
    """The loss and gradient in float64 by torch's own ops, z-loss and soft-capping written out."""
    logits, target, weight, upstream = _inputs(name)
    opts = CASES[name][3]
    x = logits.double().reshape(-1, logits.shape[-1]).requires_grad_()
    z = x
    if opts.get("softcap"):
        z = opts["softcap"] * torch.tanh(x / opts["softcap"])
    t = (
        target.reshape(-1, logits.shape[-1]).double()
        if target.is_floating_point()
        else (target.reshape(-1).long())
    )
    w = weight.double() if weight is not None else None
    red = opts["reduction"]
    rows = F.cross_entropy(
        z, t, weight=w, reduction="none", label_smoothing=opts.get("label_smoothing", 0.0)
    )
    if opts.get("z_loss"):
        lse = torch.logsumexp(z, -1)
        keep = torch.ones_like(lse) if t.is_floating_point() else (t != -100).double()
        wy = keep if w is None or t.is_floating_point() else w[t.clamp(min=0)] * keep
        rows = rows + opts["z_loss"] * lse**2 * wy
    if red == "none":
        loss = rows
    elif red == "sum":
        loss = rows.sum()
    else:
        if t.is_floating_point():
            denom = torch.tensor(float(t.shape[0]), dtype=torch.float64)
        else:
            keep = (t != -100).double()
            denom = (keep if w is None else w[t.clamp(min=0)] * keep).sum()
        loss = rows.sum() / denom
    scale = opts.get("scale", 1.0)
    if upstream is not None:
        loss.backward(upstream.double().reshape(-1))
    else:
        (loss * scale).backward()
    return loss.detach(), x.grad.reshape(logits.shape)


def _assemble(name, world, results):
    sizes, _ = _slices(name, world)
    return torch.cat([results[r][name][1] for r in range(world)], dim=-1), sizes


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_matches_the_unsharded_call(ranks, name):
    world, results = ranks
    for r in range(world):
        assert not isinstance(results[r][name], str), f"rank {r}:\n{results[r][name]}"
    losses = [results[r][name][0] for r in range(world)]
    for r in range(1, world):  # bit for bit the same loss on every rank
        torch.testing.assert_close(losses[r], losses[0], rtol=0, atol=0, equal_nan=True)
    grad, sizes = _assemble(name, world, results)
    loss_u, grad_u = results[0]["unsharded:" + name]
    loss_r, grad_r = _reference(name)
    dtype = CASES[name][2]
    assert losses[0].dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(losses[0], loss_u, rtol=1e-6, atol=1e-6, equal_nan=True)
        scale = max(grad_u.abs().max().item(), 1e-30) if grad_u.numel() else 1.0
        torch.testing.assert_close(grad, grad_u, rtol=1e-6, atol=1e-6 * scale)
        tol = dict(rtol=1e-5, atol=1e-6, equal_nan=True)
    else:  # bfloat16: the slices and the whole round differently; the float64 reference judges
        tol = dict(rtol=2e-2, atol=2e-3, equal_nan=True)
    torch.testing.assert_close(losses[0].double(), loss_r.reshape(losses[0].shape), **tol)
    torch.testing.assert_close(grad.double(), grad_r, **tol)


def test_ranks_that_disagree_all_raise(ranks):
    world, results = ranks
    rows = [results[r]["__disagreement__"][0] for r in range(world)]
    options = [results[r]["__disagreement__"][1] for r in range(world)]
    assert all(e is not None and "number of rows" in e for e in rows), rows
    assert all(e is not None and "options" in e for e in options), options


# Each bad call's exception type and a word of its message.
ERRORS = {
    "float64": ("TypeError", "float64"),
    "outside": ("ValueError", "shard.first"),
    "weight": ("ValueError", "weight"),
    "half_shard": ("ValueError", "vocab_size"),
    "linear_class_weight": ("ValueError", "class_weight"),
    "target_shape": ("ValueError", "target must be"),
    "linear_target_shape": ("ValueError", "target must be"),
    "reduction": ("ValueError", "reduction"),
    "z_loss": ("TypeError", "z_loss"),
    "vocab_size_range": ("ValueError", "64 bits"),
    "logits_list": ("TypeError", "logits"),
    "linear_zero_rows": ("ValueError", "reduction"),
    "bwd_lse": ("ValueError", "lse"),
}


def test_bad_inputs_raise_torchs_error_types_naming_the_argument(ranks):
    world, results = ranks
    for r in range(world):
        assert set(results[r]["__bad__"]) == {"float64", "outside", "weight", "half_shard"}
        for name in results[r]["__bad__"]:
            kind, words = ERRORS[name]
            got_kind, message = results[r]["__bad__"][name]
            assert got_kind == kind and words in message, (r, name, got_kind, message)


def test_one_rank_with_a_bad_argument_makes_every_rank_raise(ranks):
    world, results = ranks
    for r in range(world):
        got, losses = results[r]["__one_wrong__"]
        assert set(got) == {
            "float64",
            "outside",
            "weight",
            "linear_class_weight",
            "target_shape",
            "linear_target_shape",
            "half_shard",
            "reduction",
            "z_loss",
            "vocab_size_range",
            "logits_list",
            "linear_zero_rows",
            "bwd_lse",
        }
        for name, (got_kind, message) in got.items():
            kind, words = ERRORS[name]
            if r == world - 1:
                assert got_kind == kind and words in message, (r, name, got_kind, message)
            else:
                assert got_kind == "ValueError" and "refused its arguments" in message, (r, name)
        # The right call after each wrong one pairs with the other ranks' (no exchange left over).
        assert losses == results[0]["__one_wrong__"][1]


def test_a_kept_graph_gives_a_second_backward_and_no_second_derivative(ranks):
    world, results = ranks
    for r in range(world):
        grads, errors = results[r]["__autograd__"]
        for name, (first, second) in grads.items():
            if not isinstance(first, list):
                first, second = [first], [second]
            for a, b in zip(first, second):
                assert a.numel() == 0 or a.abs().sum() > 0, (r, name)
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} rank {r}")
        for name, error in errors.items():
            assert error is not None and "second derivative" in error, (r, name, error)


def test_options_are_taken_as_cross_entropys(ranks):
    world, results = ranks
    for r in range(world):
        plain, others = results[r]["__options__"]
        assert others == [plain] * 3, r
    x, y = torch.randn(2, 5), torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match="ignore_index"):
        xd.vocab_parallel_cross_entropy(x, y, ignore_index=1.5)
    with pytest.raises(RuntimeError, match="label_smoothing"):
        xd.vocab_parallel_cross_entropy(x, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap"):
        xd.vocab_parallel_linear_cross_entropy(torch.randn(2, 3), torch.randn(5, 3), y, softcap=-1)


def test_target_shape_and_reduction_are_checked_before_any_exchange():
    x = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="target must be"):
        xd.vocab_parallel_cross_entropy(x, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction"):
        xd.vocab_parallel_cross_entropy(x, torch.zeros(2, 3, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="target must be"):
        xd.vocab_parallel_linear_cross_entropy(
            torch.randn(4, 8), torch.randn(5, 8), torch.zeros(3, dtype=torch.long)
        )


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        xd.vocab_parallel_cross_entropy(torch.randn(2, 4), torch.zeros(2, dtype=torch.long))


def _linear_unsharded(name):
    """xent.torch.linear_cross_entropy on the whole head, on this process's device (rank 0 of each
    group makes it): (loss, d_hidden, d_weight, d_bias)."""
    hidden, weight, bias, target, class_weight, upstream = _on_device(*_linear_inputs(name))
    opts = LINEAR_CASES[name][4]
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(not opts.get("frozen"))
    b = bias.clone().requires_grad_() if bias is not None else None
    loss = xent.torch.linear_cross_entropy(
        x, w, target, bias=b, class_weight=class_weight, **_linear_keywords(name)
    )
    _backward(loss, upstream)
    return _on_host(loss.detach(), x.grad, w.grad, b.grad if b is not None else None)


def _linear_reference(name):
    """The same in float64 by torch's ops: logits formed, soft-capped, z-loss written out."""
    hidden, weight, bias, target, class_weight, upstream = _linear_inputs(name)
    opts = LINEAR_CASES[name][4]
    x = hidden.double().requires_grad_()
    w = weight.double().requires_grad_(not opts.get("frozen"))
    b = bias.double().requires_grad_() if bias is not None else None
    logits = torch.nn.functional.linear(x, w, b)
    z = logits
    if opts.get("softcap"):
        z = opts["softcap"] * torch.tanh(logits / opts["softcap"])
    t = target.double() if target.is_floating_point() else target
    cw = class_weight.double() if class_weight is not None else None
    zr = z.reshape(-1, z.shape[-1])
    tr = t.reshape(-1, z.shape[-1]) if t.is_floating_point() else t.reshape(-1)
    rows = F.cross_entropy(
        zr, tr, weight=cw, reduction="none", label_smoothing=opts.get("label_smoothing", 0.0)
    )
    keep = torch.ones_like(rows) if tr.is_floating_point() else (tr != -100).double()
    wy = keep if cw is None or tr.is_floating_point() else cw[tr.clamp(min=0)] * keep
    if opts.get("z_loss"):
        rows = rows + opts["z_loss"] * torch.logsumexp(zr, -1) ** 2 * wy
    red = opts["reduction"]
    loss = (
        rows.reshape(z.shape[:-1])
        if red == "none"
        else rows.sum() / (wy.sum() if red == "mean" else 1.0)
    )
    _backward(loss, upstream.double() if upstream is not None else None)
    return loss.detach(), x.grad, w.grad, b.grad if b is not None else None


@pytest.mark.parametrize("name", list(LINEAR_CASES))
def test_fused_linear_matches_the_unsharded_call(ranks, name):
    world, results = ranks
    key = "linear:" + name
    for r in range(world):
        assert not isinstance(results[r][key], str), f"rank {r}:\n{results[r][key]}"
    got = [results[r][key] for r in range(world)]
    for r in range(1, world):  # the loss bit for bit, d_hidden summed over the same group
        torch.testing.assert_close(got[r][0], got[0][0], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got[r][1], got[0][1], rtol=0, atol=0)
    frozen = LINEAR_CASES[name][4].get("frozen")
    assert all((g[2] is None) == bool(frozen) for g in got)
    dw = None if frozen else torch.cat([g[2] for g in got])
    db = None if got[0][3] is None else torch.cat([g[3] for g in got])
    mine = (got[0][0], got[0][1], dw, db)
    unsharded = results[0]["unsharded:linear:" + name]
    reference = _linear_reference(name)
    names = ("loss", "d_hidden", "d_weight", "d_bias")
    if LINEAR_CASES[name][3] == torch.float32:
        for what, a, u in zip(names, mine, unsharded):
            if a is None:
                assert u is None, what
                continue
            scale = max(u.abs().max().item(), 1e-30) if u.numel() else 1.0
            torch.testing.assert_close(
                a, u, rtol=1e-6, atol=1e-6 * scale, equal_nan=True, msg=lambda m: f"{what}: {m}"
            )
        tol = dict(rtol=1e-5, atol=1e-5, equal_nan=True)
    else:
        tol = dict(rtol=3e-2, atol=3e-2, equal_nan=True)
    for what, a, ref in zip(names, mine, reference):
        if a is not None:
            torch.testing.assert_close(a.double(), ref, **tol, msg=lambda m: f"{what}: {m}")
