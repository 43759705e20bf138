"""The comparison's native lines beside bench/compare.py's torch ones: xent's C++ kernels timed by
CUDA events (xent_bench_cuda's Google Benchmark JSON) and xent.jax against XLA
(bench/jax_cross_entropy.py's JSON lines), on the cross-entropy shapes compare.py ran.

    python3 bench/compare_native.py CUDA_JSON [JAX_JSONL...]     (bench/compare.sh runs it)
    python3 bench/compare_native.py --shapes filter|large

--shapes prints the cross-entropy shapes of $OUT/compare.jsonl for compare.sh: "filter", every
one as N/V joined by | (a benchmark filter's alternatives); "large", those of 1024 rows or more
as N,V,DTYPE separated by spaces (the JAX runs).

Appends to $OUT/compare.jsonl one row per shape and implementation (kind "ce-native") and to
$OUT/compare.md a table of them, so a user sees what the bindings add to the kernels:
  xent C++   forward, forward+backward (gradient in place) and backward from the saved LSE, the
             median of the run's repetitions, each with its % of the copy roof that the same
             binary measured first (xent_bench_cuda's roof_pct).
  XLA, xent.jax
             forward, and forward+backward with the logits donated (xent's gradient written
             over them), jax_cross_entropy.py's queued time (the device's time per call), and
             the device's peak memory above the arguments; % roof against compare.py's copy roof.
A shape or pass a file does not hold is shown as "—".
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

OUT = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "build" / "compare"))
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CXX_TYPES = {"float": "float32", "__nv_bfloat16": "bfloat16", "__half": "float16"}
CXX_PASSES = {"forward": "fwd", "forward_backward": "fwdbwd", "backward": "bwd"}
# BM_cross_entropy<T, op::PASS>/N/V[/min_time:...]: the default lines (mean, run-time sized).
CXX_LINE = re.compile(r"^BM_cross_entropy<([\w:]+), op::(\w+)>/(\d+)/(\d+)/")


def cxx_rows(path):
    """{(n, v, dtype): {pass: (ms, roof %)}} from xent_bench_cuda's JSON: each line's median
    (its only run when there were no repetitions)."""
    runs = {}
    try:
        lines = json.loads(Path(path).read_text())["benchmarks"]
    except (OSError, ValueError, KeyError) as e:  # a run that failed leaves a partial file
        print(f"{path}: no benchmark lines ({type(e).__name__}): no C++ rows", file=sys.stderr)
        return runs
    for b in lines:
        m = CXX_LINE.match(b["name"])
        if not m or b.get("error_occurred") or m[2] not in CXX_PASSES:
            continue
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        key = (int(m[3]), int(m[4]), CXX_TYPES.get(m[1], m[1]))
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        value = (b["real_time"] * scale, b.get("roof_pct"))
        # A median replaces the repetitions it summarises.
        slot = runs.setdefault(key, {})
        if b.get("run_type") == "aggregate" or CXX_PASSES[m[2]] not in slot:
            slot[CXX_PASSES[m[2]]] = value
    return runs


def jax_rows(paths):
    """{(n, v, dtype): {impl: row}} from jax_cross_entropy.py's JSON lines: per implementation its
    queued forward and donated forward+backward, and the larger of their peaks."""
    rows = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            impl = {"xla": "XLA", "xent": "xent.jax"}.get(r.get("impl"))
            if impl is None or (r["call"], r["logits"]) not in (
                ("fwd", "kept"),
                ("fwd+bwd", "donated"),
            ):
                continue
            slot = rows.setdefault((r["n"], r["v"], r["dtype"]), {}).setdefault(impl, {})
            slot["fwd_ms" if r["call"] == "fwd" else "fwdbwd_ms"] = r.get("queued_ms")
            peak = r.get("peak_mib")
            if peak is not None:
                slot["peak_MiB"] = max(peak, slot.get("peak_MiB", peak))
    return rows


def fmt(v, spec):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def ce_shapes(lines):
    """(n, v, dtype) of compare.py's cross-entropy rows, in their order, each once."""
    return list(dict.fromkeys((r["n"], r["v"], r["dtype"]) for r in lines if r["kind"] == "ce"))


def main(argv):
    if not argv:
        sys.exit(__doc__)
    log = OUT / "compare.jsonl"
    lines = [json.loads(t) for t in log.read_text().splitlines()] if log.exists() else []
    if argv[0] == "--shapes":
        shapes = ce_shapes(lines)
        if argv[1:] == ["filter"]:
            print("|".join(dict.fromkeys(f"{n}/{v}" for n, v, _ in shapes)))
        elif argv[1:] == ["large"]:
            print(" ".join(f"{n},{v},{dtype}" for n, v, dtype in shapes if n >= 1024))
        else:
            sys.exit(__doc__)
        return 0
    machine = next((r for r in lines if r.get("kind") == "machine"), {})
    roof = machine.get("copy_roof_GBps")  # compare.py's, for the JAX rows
    shapes = ce_shapes(lines)
    cxx = cxx_rows(argv[0])
    jax = jax_rows(argv[1:])
    shapes = shapes or list(dict.fromkeys([*cxx, *jax]))

    def pct(ms, n, v, dtype, reads):
        if ms is None or ms <= 0 or not roof:
            return None
        return 100 * reads * n * v * BYTES[dtype] / (ms * 1e-3) / (roof * 1e9)

    new = []
    for n, v, dtype in shapes:
        got = cxx.get((n, v, dtype), {})
        shape = {"kind": "ce-native", "n": n, "v": v, "dtype": dtype}
        row = {**shape, "impl": "xent C++", "timer": "CUDA events"}
        for p in ("fwd", "fwdbwd", "bwd"):
            ms, roof_pct = got.get(p, (None, None))
            row[f"{p}_ms"], row[f"{p}_roof_pct"] = ms, roof_pct
        new.append(row)
        for impl in ("XLA", "xent.jax"):
            j = jax.get((n, v, dtype), {}).get(impl, {})
            row = {**shape, "impl": impl, "timer": "JAX queued"}
            row["fwd_ms"], row["fwdbwd_ms"] = j.get("fwd_ms"), j.get("fwdbwd_ms")
            row["fwd_roof_pct"] = pct(row["fwd_ms"], n, v, dtype, 1)
            row["fwdbwd_roof_pct"] = pct(row["fwdbwd_ms"], n, v, dtype, 2)
            row["peak_MiB"] = j.get("peak_MiB")
            new.append(row)

    with open(log, "a") as f:
        for row in new:
            f.write(json.dumps(row) + "\n")
    table = [
        "## Cross-entropy: xent's C++ kernels and JAX\n",
        (
            "xent C++: xent_bench_cuda, CUDA events, its own copy roof; XLA and xent.jax: "
            "jax_cross_entropy.py's queued time, forward+backward with the logits donated.\n"
        ),
        (
            "| logits N x V | impl | fwd ms | fwd % roof | fwd+bwd ms | fwd+bwd % roof "
            "| bwd from LSE ms | bwd % roof | peak MiB |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in new:
        table.append(
            f"| {r['n']} x {r['v']} {r['dtype']} | {r['impl']} | {fmt(r['fwd_ms'], '.4g')} "
            f"| {fmt(r['fwd_roof_pct'], '.1f')} | {fmt(r['fwdbwd_ms'], '.4g')} "
            f"| {fmt(r['fwdbwd_roof_pct'], '.1f')} | {fmt(r.get('bwd_ms'), '.4g')} "
            f"| {fmt(r.get('bwd_roof_pct'), '.1f')} | {fmt(r.get('peak_MiB'), '.0f')} |"
        )
    md = OUT / "compare.md"
    with open(md, "a") as f:
        f.write("\n" + "\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
