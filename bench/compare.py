"""Side by side on one GPU, in one process, on the same tensors: PyTorch eager, torch.compile,
Liger-Kernel, quack, Cut Cross-Entropy and xent (the Python package in python/, installed), for
cross-entropy over given logits and for fused linear cross-entropy (LM head + loss).

    python3 bench/compare.py [ce] [lce] [--quick]     (default: ce lce; bench/compare.sh wraps it)

Writes to $OUT (default build/compare): compare.md (the tables), compare.png (the plot) and
compare.jsonl (one JSON object per measurement, errors included).

What a row reports:
  ms            median of triton.testing.do_bench (warmup 50 ms, rep 200 ms, as ANCHORS.md's
                figures were taken; CUDA-event medians when triton is missing). "fwd" runs
                under torch.no_grad(); "fwd+bwd" is loss.backward() from a view of a leaf that
                requires grad (as a model's logits come from an op), its .grad reset between
                repetitions: what a user calls (xent.torch.cross_entropy,
                autograd included). do_bench clears the L2 cache before each repetition, and the
                host can enqueue the call while the GPU clears it, so a row can hide host time
                shorter than that clear; bench/torch_overhead.py times calls back to back.
  % roof        cross-entropy: the fewest bytes (forward: the logits read once; forward+backward:
                read once and the gradient written once, 2x) per second, over a device-to-device
                copy's bytes (read + written) per second measured by this process first.
                Linear cross-entropy: the time of its three GEMMs alone (X W^T, G W, G^T X, cuBLAS
                through torch; forward: the first) over the row's time.
  extra MiB     peak torch.cuda.max_memory_allocated during one fwd+bwd step above what was
                allocated before it (the gradients the step returns included).
  max |d|       the largest absolute difference of the loss and of the gradient from torch eager's
                on the same tensors (a check that each implementation computed the same thing).
Implementations that cannot run say why in their row ("n/a: ...") instead of a figure.
The linear table has a row for each of xent's training memory choices (XENT_LINEAR_VARIANTS):
"xent (low memory)" (order="low_memory": the vocabulary outer, no V x D float sum; it computes the
logits twice, so its own floor is four GEMMs, 4/3 of the three-GEMM time its % GEMMs is taken
against) and "xent (accumulate=output)" (the fast order rounding each row chunk's d_weight sum into
bf16 d_weight: no V x D float sum). bench/linear_accuracy.py gives their errors.
"""

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from common.cuda_events import event_times

REPO = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT", REPO / "build" / "compare"))

# fmt: off
CE_SHAPES = [  # (N, V, dtype): the issue's seed shapes, then language-model shapes
    (32, 32000, torch.float32), (128, 32000, torch.float32), (32, 50257, torch.float32),
    (8192, 32000, torch.bfloat16), (16384, 128256, torch.bfloat16),
    (4096, 262144, torch.bfloat16), (8192, 128256, torch.float32),
]
# fmt: on
LCE_SHAPES = [(8192, 4096, 128256), (16384, 2304, 256000)]  # (N, D, V), bfloat16


def emit(log, **row):
    print(json.dumps(row), flush=True)
    log.write(json.dumps(row) + "\n")
    log.flush()


def short(e):
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text[:160]


# --- timing and memory ----------------------------------------------------------------------------


def make_bench():
    try:
        from triton.testing import do_bench

        def bench(fn, grad_to_none=None):
            return do_bench(fn, warmup=50, rep=200, grad_to_none=grad_to_none, return_mode="median")

        return bench, "triton.testing.do_bench median"
    except Exception as e:  # noqa: BLE001  (any import failure: fall back)
        reason = short(e)

    def bench(fn, grad_to_none=None):
        def reset_grads():
            for t in grad_to_none or []:
                t.grad = None

        fn()
        torch.cuda.synchronize()
        (once,) = event_times(fn, 1)
        reps = max(3, min(1000, int(200 / max(once, 1e-3))))
        times = sorted(event_times(fn, reps, before=reset_grads))
        return times[len(times) // 2]

    return bench, f"CUDA-event median (triton unavailable: {reason})"


def free():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def peak_extra_mib(fn):
    free()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def copy_roof_gbps(bench):
    """Device-to-device copy of 2 GiB: bytes read + written per second (GB/s)."""
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * 2 * 2**30 / ms / 1e6, ms  # x and y go with this frame


# --- implementations ------------------------------------------------------------------------------


def load_libraries():
    """name -> (module-level callables or None, reason when unavailable)."""
    libs = {}
    try:
        import xent.torch

        if not xent.torch.cuda_built():
            raise RuntimeError("xent was built without its CUDA kernels")
        libs["xent"] = (xent.torch, None)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        libs["xent"] = (None, short(e))
    try:
        from liger_kernel.transformers.functional import (
            liger_cross_entropy,
            liger_fused_linear_cross_entropy,
        )
        import liger_kernel

        libs["liger"] = ((liger_cross_entropy, liger_fused_linear_cross_entropy), None)
        libs["liger_version"] = getattr(liger_kernel, "__version__", None)
    except Exception as e:  # noqa: BLE001
        libs["liger"] = (None, short(e))
    try:
        from quack import cross_entropy as quack_ce

        libs["quack"] = (quack_ce, None)
    except Exception as e:  # noqa: BLE001
        libs["quack"] = (None, short(e))
    try:
        from cut_cross_entropy import linear_cross_entropy as cce_lce

        libs["cce"] = (cce_lce, None)
    except Exception as e:  # noqa: BLE001
        libs["cce"] = (None, short(e))
    return libs


def version_of(dist):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def fresh_compile(fn):
    # Each shape gets its own compiled function; a reset keeps dynamo's per-code cache (and its
    # recompile limit) from carrying guards across shapes.
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


class _Produced(torch.autograd.Function):
    """The logits as an op's output, as a model's LM head gives them: the same memory, neither a
    leaf nor a view of one (measure's leaves are leaves, whose views inplace_backward refuses to
    write over, as torch refuses in-place writes)."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def ce_impls(libs):
    """(name, fn(logits, target) -> loss, or None, reason) for cross-entropy over logits."""
    xent, xent_why = libs["xent"]
    liger, liger_why = libs["liger"]
    cce, cce_why = libs["cce"]
    eager = lambda x, t: F.cross_entropy(x, t)  # noqa: E731
    impls = [("torch", eager, None), ("torch.compile", "compile", None)]
    impls.append(("Liger", (lambda x, t: liger[0](x, t)) if liger else None, liger_why))
    quack, quack_why = libs["quack"]
    impls.append(("quack", (lambda x, t: quack(x, t)) if quack else None, quack_why))
    impls.append(("CCE", None, "no logits entry (CCE fuses the classifier)" if cce else cce_why))
    impls.append(("xent", (lambda x, t: xent.cross_entropy(x, t)) if xent else None, xent_why))
    impls.append(
        (
            "xent in-place",
            (lambda x, t: xent.cross_entropy(_Produced.apply(x), t, inplace_backward=True))
            if xent
            else None,
            xent_why,
        )
    )
    return impls


def lce_impls(libs):
    xent, xent_why = libs["xent"]
    liger, liger_why = libs["liger"]
    cce, cce_why = libs["cce"]
    impls = [
        ("torch", lambda x, w, t: F.cross_entropy(x @ w.T, t), None),
        ("torch.compile", "compile", None),
        ("Liger", (lambda x, w, t: liger[1](x, w, t)) if liger else None, liger_why),
        ("CCE", (lambda x, w, t: cce(x, w, t)) if cce else None, cce_why),
    ]
    why = xent_linear_unavailable(xent) if xent else xent_why
    for name, memory in XENT_LINEAR_VARIANTS:
        impls.append((name, None if why else xent_linear(xent, **memory), why))
    return impls


# xent's fused linear rows: the default, then its training memory choices
# (xent.torch.linear_cross_entropy's order and accumulate).
XENT_LINEAR_VARIANTS = [
    ("xent", {}),
    ("xent (low memory)", {"order": "low_memory"}),
    ("xent (accumulate=output)", {"accumulate": "output"}),
]


def xent_linear(xent, **memory):
    return lambda x, w, t: xent.linear_cross_entropy(x, w, t, **memory)


def xent_linear_unavailable(xent):
    """None when xent.torch.linear_cross_entropy runs on CUDA, else why not."""
    try:
        h = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(16, 8, device="cuda", dtype=torch.bfloat16)
        xent.linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long, device="cuda"))
        return None
    except NotImplementedError:
        return "no CUDA linear backend in xent yet"
    except Exception as e:  # noqa: BLE001
        return short(e)


# --- measurement ----------------------------------------------------------------------------------


def measure(bench, fn, leaves, args, reference):
    """fwd ms, fwd+bwd ms, extra MiB, max |d loss|, max |d grad| for loss = fn(*leaves, *args).

    leaves are the differentiable inputs (used as the tensors themselves: an in-place backward
    writes over them, as it would over a model's logits; every figure is taken from fresh copies).
    reference: (loss, grads) of torch eager, or None for torch eager itself."""
    base = [x.detach() for x in leaves]
    with torch.no_grad():
        fwd_ms = bench(lambda: fn(*base, *args))
    xs = [x.clone().requires_grad_(True) for x in base]

    # Each implementation gets views of the leaves, as a model's loss gets logits that an op
    # produced: autograd then hands the gradient to the view's backward. Given the leaf itself, an
    # in-place gradient (the leaf's own memory) would reach AccumulateGrad, which copies a
    # gradient it cannot steal: an N x V clone no model pays.
    def step():
        fn(*(x.view_as(x) for x in xs), *args).backward()

    fwdbwd_ms = bench(step, grad_to_none=xs)
    for x in xs:
        x.grad = None
    mem = peak_extra_mib(step)
    del xs
    free()
    # Values, from fresh copies.
    xs = [x.clone().requires_grad_(True) for x in base]
    loss = fn(*(x.view_as(x) for x in xs), *args)
    loss.backward()
    result = dict(fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms, extra_MiB=mem)
    grads = [x.grad for x in xs]
    if reference is not None:
        ref_loss, ref_grads = reference
        result["loss_diff"] = abs(loss.float().item() - ref_loss)
        result["grad_diff"] = max(
            (g.float() - r.float()).abs().max().item() for g, r in zip(grads, ref_grads)
        )
        del grads
        free()
        return result, None
    return result, (loss.float().item(), grads)


def run_impls(bench, log, impls, compiled, leaves, args, pct, shape):
    """One row per implementation on the same tensors; torch eager (first) is the reference.
    pct(result) -> (fwd %, fwd+bwd %) of the roof; shape: the rows' common fields."""
    rows, reference = [], None
    for name, fn, why in impls:
        row = dict(shape, impl=name)
        if fn == "compile":
            fn = fresh_compile(compiled)
        if fn is None:
            row["na"] = why
        else:
            try:
                res, ref = measure(bench, fn, leaves, args, reference)
                if name == "torch":
                    reference = ref
                res["fwd_roof_pct"], res["fwdbwd_roof_pct"] = pct(res)
                row.update(res)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["na"] = short(e)
        emit(log, **row)
        rows.append(row)
        free()
    return rows


def run_ce(bench, libs, roof, log, shapes):
    rows = []
    for n, v, dt in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dt)
        target = torch.randint(0, v, (n,), device="cuda", generator=g)
        nbytes = logits.numel() * logits.element_size()
        compiled = lambda x, t: F.cross_entropy(x, t)  # noqa: E731

        def pct(res):  # the fewest bytes per second over the copy roof's
            return (
                100 * nbytes / res["fwd_ms"] / 1e6 / roof,
                100 * 2 * nbytes / res["fwdbwd_ms"] / 1e6 / roof,
            )

        rows += run_impls(
            bench,
            log,
            ce_impls(libs),
            compiled,
            [logits],
            (target,),
            pct,
            dict(kind="ce", n=n, v=v, dtype=str(dt).split(".")[-1]),
        )
        del logits, target
        free()
    return rows


def gemm_floor(bench, x, w):
    """The three GEMMs of a linear cross-entropy step, timed alone: logits X W^T (forward), then
    dX = G W and dW = G^T X for a logit gradient G."""
    grad = torch.randn(x.shape[0], w.shape[0], device="cuda", dtype=x.dtype)
    t1, t2, t3 = (
        bench(lambda: x @ w.T),
        bench(lambda: grad @ w),
        bench(lambda: grad.T @ x),
    )
    return dict(fwd_ms=t1, fwdbwd_ms=t1 + t2 + t3)


def run_lce(bench, libs, log, shapes):
    rows = []
    for n, d, v in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(n, d, device="cuda", generator=g) / d**0.25).to(torch.bfloat16)
        w = (torch.randn(v, d, device="cuda", generator=g) / d**0.25).to(torch.bfloat16)
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        floor = gemm_floor(bench, x, w)
        free()
        emit(log, kind="lce_floor", n=n, d=d, v=v, **floor)
        rows.append(dict(kind="lce", impl="GEMM floor", n=n, d=d, v=v, **floor))
        compiled = lambda a, b, c: F.cross_entropy(a @ b.T, c)  # noqa: E731

        def pct(res):  # the GEMMs' time over the row's
            return (
                100 * floor["fwd_ms"] / res["fwd_ms"],
                100 * floor["fwdbwd_ms"] / res["fwdbwd_ms"],
            )

        rows += run_impls(
            bench,
            log,
            lce_impls(libs),
            compiled,
            [x, w],
            (t,),
            pct,
            dict(kind="lce", n=n, d=d, v=v, dtype="bfloat16"),
        )
        del x, w, t
        free()
    return rows


# --- report ---------------------------------------------------------------------------------------


def fmt(v, digits):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def table(rows, kind):
    if kind == "ce":
        head = (
            "| logits N x V | impl | fwd ms | fwd % roof | fwd+bwd ms | fwd+bwd % roof "
            "| extra MiB | max abs d loss / grad |\n|---|---|---|---|---|---|---|---|"
        )
    else:
        head = (
            "| N, D, V (bf16) | impl | fwd ms | fwd % GEMMs | fwd+bwd ms | fwd+bwd % GEMMs "
            "| extra MiB | max abs d loss / grad |\n|---|---|---|---|---|---|---|---|"
        )
    lines = [head]
    for r in rows:
        if r["kind"] != kind:
            continue
        shape = (
            f"{r['n']} x {r['v']} {r.get('dtype', '')}"
            if kind == "ce"
            else f"{r['n']}, {r['d']}, {r['v']}"
        )
        if "na" in r:
            lines.append(f"| {shape} | {r['impl']} | n/a: {r['na']} | | | | | |")
            continue
        diff = (
            "reference"
            if r["impl"] == "torch"
            else f"{r['loss_diff']:.2e} / {r['grad_diff']:.2e}"
            if "loss_diff" in r
            else ""
        )
        lines.append(
            f"| {shape} | {r['impl']} | {fmt(r['fwd_ms'], 3)} | {fmt(r.get('fwd_roof_pct'), 0)} "
            f"| {fmt(r['fwdbwd_ms'], 3)} | {fmt(r.get('fwdbwd_roof_pct'), 0)} "
            f"| {fmt(r.get('extra_MiB'), 0)} | {diff} |"
        )
    return "\n".join(lines)


COLORS = {
    "torch": "#1f77b4",
    "torch.compile": "#ff7f0e",
    "Liger": "#2ca02c",
    "quack": "#17becf",
    "CCE": "#9467bd",
    "xent": "#d62728",
    "xent in-place": "#8c564b",
    "xent (low memory)": "#e377c2",
    "xent (accumulate=output)": "#bcbd22",
}  # one colour per implementation


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("ce", "lce") if any(r["kind"] == k and "na" not in r for r in rows)]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(13, 4.5 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        ok = [r for r in rows if r["kind"] == kind and "na" not in r and r["impl"] != "GEMM floor"]
        shapes = list(
            dict.fromkeys(
                (
                    f"{r['n']}x{r['v']}\n{r['dtype']}"
                    if kind == "ce"
                    else f"{r['n']}x{r['d']}x{r['v']}"
                )
                for r in ok
            )
        )
        impls = list(dict.fromkeys(r["impl"] for r in ok))
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            values = []
            for s in shapes:
                hit = [
                    r
                    for r in ok
                    if r["impl"] == impl
                    and (
                        f"{r['n']}x{r['v']}\n{r['dtype']}"
                        if kind == "ce"
                        else f"{r['n']}x{r['d']}x{r['v']}"
                    )
                    == s
                ]
                values.append(hit[0]["fwdbwd_roof_pct"] if hit else 0.0)
            ax.bar(
                [j + i * width for j in range(len(shapes))],
                values,
                width,
                label=impl,
                color=COLORS.get(impl),
            )
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=8)
        ax.set_ylabel("fwd+bwd, % of copy roof" if kind == "ce" else "fwd+bwd, % of GEMM time")
        ax.set_title(
            (
                "cross-entropy over logits"
                if kind == "ce"
                else "linear cross-entropy (LM head + loss)"
            )
            + " — higher is better"
        )
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="*", help="ce, lce or both (the default)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the first three cross-entropy shapes and no linear shapes (a smoke run)",
    )
    args = ap.parse_args()
    what = args.what or ["ce", "lce"]
    if set(what) - {"ce", "lce"}:
        ap.error(f"unknown part(s) {sorted(set(what) - {'ce', 'lce'})}: choose ce and/or lce")
    if not torch.cuda.is_available():
        print("compare.py needs a CUDA device; none is visible to torch")
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    log = open(OUT / "compare.jsonl", "w")
    bench, timer = make_bench()
    libs = load_libraries()
    dev = torch.cuda.get_device_properties(0)
    import subprocess

    # The device tool copies the working tree, not .git: the caller names the commit there.
    commit = (
        os.environ.get("XENT_COMMIT")
        or subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        or "unknown"
    )
    versions = dict(
        torch=torch.__version__,
        triton=version_of("triton"),
        liger_kernel=version_of("liger-kernel"),
        quack_kernels=version_of("quack-kernels"),
        cut_cross_entropy=version_of("cut-cross-entropy"),
    )
    roof, roof_ms = copy_roof_gbps(bench)
    free()
    emit(
        log,
        kind="machine",
        gpu=dev.name,
        sms=dev.multi_processor_count,
        commit=commit,
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        timer=timer,
        copy_roof_GBps=roof,
        copy_roof_ms=roof_ms,
        **versions,
        unavailable={k: v[1] for k, v in libs.items() if isinstance(v, tuple) and v[1]},
    )
    rows = []
    if "ce" in what:
        rows += run_ce(bench, libs, roof, log, CE_SHAPES[:3] if args.quick else CE_SHAPES)
    if "lce" in what and not args.quick:
        rows += run_lce(bench, libs, log, LCE_SHAPES)

    title = (
        f"{dev.name}, {time.strftime('%Y-%m-%d', time.gmtime())}, xent {commit}, "
        f"torch {versions['torch']}, Liger {versions['liger_kernel'] or 'n/a'}, "
        f"quack {versions['quack_kernels'] or 'n/a'}, "
        f"CCE {versions['cut_cross_entropy'] or 'n/a'}"
    )
    md = [
        "# xent vs PyTorch, torch.compile, Liger-Kernel, quack, Cut Cross-Entropy\n",
        title + "\n",
        f"Timer: {timer}. Copy roof (device-to-device, read + written), measured in this run: "
        f"{roof:.0f} GB/s. Legend: bench/compare.py's docstring.\n",
    ]
    if any(r["kind"] == "ce" for r in rows):
        md += ["## Cross-entropy over logits\n", table(rows, "ce"), ""]
    if any(r["kind"] == "lce" for r in rows):
        md += [
            "## Linear cross-entropy (bf16 hidden N x D, weight V x D)\n",
            table(rows, "lce"),
            "",
        ]
    (OUT / "compare.md").write_text("\n".join(md) + "\n")
    try:
        plot(rows, OUT / "compare.png", title)
    except Exception as e:  # noqa: BLE001
        print(f"no plot: {short(e)}")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
