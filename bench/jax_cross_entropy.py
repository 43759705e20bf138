"""xent.jax.cross_entropy next to XLA's own cross-entropy, in one process, on the same inputs.

    python bench/jax_cross_entropy.py [--shape N,V] [--dtype float32|bfloat16|float16]
                                      [--reps R] [--warmup W] [--platform cpu|gpu]

XLA's is jax.jit of optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
(forward) and of jax.value_and_grad of it (forward+backward); xent's is the same two jits around
xent.jax.cross_entropy(logits, labels) (mean reduction), and on the forward+backward lines
"xent (own grad)", the same with inplace_backward=False (the gradient in a buffer of its own, not
over the logits). Defaults: fp32 4096 x 32000 on the CPU, bf16 16384 x 128256 on a GPU. Each line
runs under two ways of passing the logits:
  kept     the logits are a jit argument that outlives the call, so where a call writes its
           gradient over the logits (xent's fused pass does) XLA copies them first;
  donated  the logits are donated (donate_argnums), as an LM head's logits die inside a training
           step; a fresh copy is made before each call, outside the timed region.
Time per call, two ways, the implementations taking turns (a shared machine's load falls on
both alike):
  ms       one call then block_until_ready, the median of --reps calls after --warmup: the host's
           dispatch and wait are in it, as in a loop that reads every step's loss;
  queued   the device's time per call: one call waited for, then --depth calls issued back to
           back with only the last waited for; the difference over depth - 1 calls, the median
           of --rounds. Each call is dispatched while the one before runs, and the difference
           drops what a run pays once (the first dispatch, the wake-up after the last): on a GPU
           the figure to set beside CUDA-event timings such as do_bench's.
A copy of the logits into a fresh buffer (jnp.array(copy=True)), the copy XLA makes before the
kept fused line and that line's floor, takes turns with it.

Threads. XLA's CPU client runs an intra-op pool of one thread per CPU the process may run on
(its affinity mask; the table's foot counts the pool's threads, named tf_XLAEigen), and xent's
handler runs xent::cpu with one worker per hardware thread (std::thread::hardware_concurrency,
which ignores the mask): the same count unless the process is pinned to fewer CPUs. Each line
reports `cores`, the process's CPU time over wall time while it ran, and `other_cores`, what the
rest of the machine used meanwhile (from /proc/stat), so a loaded machine shows in the figures
(/proc/stat counts in clock ticks, 10 ms: `other_cores` means something only for calls much
longer than that). `page_faults` counts the process's minor faults per call: on the CPU a large
buffer XLA allocates is fresh memory, each of its 4 KiB pages faulted in (and zeroed by the
kernel) on first write.

Memory. `xla_temp_mib` is the compiled executable's own scratch (memory_analysis().temp), and
`extra_mib` what the call needs beyond its arguments (temp + outputs - outputs aliased to
donated arguments): what XLA plans, on every platform. On a GPU `peak_mib` is also measured:
the device's peak_bytes_in_use over one call, less what was in use before it, in a fresh
process per line, run first (the allocator's peak cannot be reset within one; the script sets
XLA_PYTHON_CLIENT_PREALLOCATE=false unless it is set, so those processes find memory free).

JSON lines go to $OUT/jax_cross_entropy.jsonl when OUT is set; a table is printed (and written
to $OUT/jax_cross_entropy.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import xent.jax as xj

# On a GPU XLA would otherwise take 75% of the memory at start-up, leaving the peak probes'
# processes (below) too little; the allocator's statistics count what is allocated either way.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# (call, logits): a forward writes nothing over its inputs, so donation changes nothing there.
LINES = (("fwd", "kept"), ("fwd+bwd", "kept"), ("fwd+bwd", "donated"))
DEFAULTS = {"cpu": ((4096, 32000), "float32"), "gpu": ((16384, 128256), "bfloat16")}
MIB = 1 << 20


def xla_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def xent_loss(logits, labels):
    return xj.cross_entropy(logits, labels)


def xent_own_grad_loss(logits, labels):
    return xj.cross_entropy(logits, labels, inplace_backward=False)


# XLA first: the ratios divide by its time. "xent (own grad)" writes the gradient into a buffer of
# its own instead of over the logits (no copy of kept logits first); forward lines leave it out.
IMPLS = {"xla": xla_loss, "xent": xent_loss, "xent (own grad)": xent_own_grad_loss}


def impls_of(kind):
    return [impl for impl in IMPLS if kind != "fwd" or impl != "xent (own grad)"]


def make_call(impl, kind, donated):
    loss = IMPLS[impl]
    fn = loss if kind == "fwd" else jax.value_and_grad(loss)
    return jax.jit(fn, donate_argnums=(0,) if donated else ())


def make_inputs(n, v, dtype, device):
    kx, ky = jax.random.split(jax.random.key(0))
    logits = (2.0 * jax.random.normal(kx, (n, v), jnp.float32)).astype(dtype)
    labels = jax.random.randint(ky, (n,), 0, v, jnp.int32)
    return jax.device_put(logits, device), jax.device_put(labels, device)


def xla_pool_threads():
    """The threads of XLA's CPU intra-op pool in this process (Linux), or None."""
    try:
        tasks = os.listdir("/proc/self/task")
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tasks]
    except OSError:
        return None
    return sum(name == "tf_XLAEigen" for name in names)


class Load:
    """Wall time, this process's CPU time and page faults, and the machine's busy CPU time
    (Linux /proc/stat, in clock ticks: summed over many calls) over the intervals between
    start() and stop()."""

    def __init__(self):
        self.wall = self.own = self.busy = self.faults = 0.0
        self.calls = 0

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
            busy = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        except OSError:
            busy = float("nan")
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return time.perf_counter(), time.process_time(), busy, faults

    def start(self):
        self._at = self._read()

    def stop(self):
        now = self._read()
        self.wall += now[0] - self._at[0]
        self.own += now[1] - self._at[1]
        self.busy += now[2] - self._at[2]
        self.faults += now[3] - self._at[3]
        self.calls += 1
        return now[0] - self._at[0]

    def summary(self):
        """(this process's cores, the other processes' cores, page faults per interval)."""
        wall = max(self.wall, 1e-9)
        other = max(0.0, self.busy - self.own) / wall
        return self.own / wall, other, self.faults / max(self.calls, 1)


def time_calls(fns, logits, labels, donated, reps, warmup):
    """Per function: (median seconds per call, cores used, other processes' cores, page faults
    per call, the last call's outputs). The functions take turns, call by call, so that a
    shared machine's load falls on each alike."""

    def args():
        # A donated buffer is consumed: each call gets a fresh copy, made before the clock starts.
        x = jnp.array(logits, copy=True) if donated else logits
        return x.block_until_ready()

    for _ in range(warmup):
        for fn in fns:
            jax.block_until_ready(fn(args(), labels))
    times = [[] for _ in fns]
    loads = [Load() for _ in fns]
    outs = [None] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            x = args()
            loads[i].start()
            outs[i] = jax.block_until_ready(fn(x, labels))
            times[i].append(loads[i].stop())
    return [(statistics.median(t), *ld.summary(), out) for t, ld, out in zip(times, loads, outs)]


def time_queued(fns, logits, labels, donated, rounds, depth):
    """Per function: the median over `rounds` of (seconds of `depth` calls issued back to back,
    the last one waited for, less the seconds of one call) / (depth - 1). Donated calls each get
    their own copy of the logits, made before the clock starts (depth + 1 copies at once)."""

    def run(fn, xs):
        jax.block_until_ready(xs)
        start = time.perf_counter()
        for x in xs:
            out = fn(x, labels)  # the call before's outputs are freed as this one is issued
        jax.block_until_ready(out)
        return time.perf_counter() - start

    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            if donated:
                xs = [jnp.array(logits, copy=True) for _ in range(depth + 1)]
            else:
                xs = [logits] * (depth + 1)
            # Every copy done first: the one call would otherwise queue behind the others' copies.
            jax.block_until_ready(xs)
            one = run(fn, xs[:1])
            times[i].append((run(fn, xs[1:]) - one) / (depth - 1))
            del xs
    return [statistics.median(t) for t in times]


def memory_plan(fn, logits, labels):
    """XLA's memory analysis of the compiled call: (temp bytes, bytes beyond the arguments)."""
    try:
        m = fn.lower(logits, labels).compile().memory_analysis()
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return None, None  # not every backend and version has it
    if m is None:
        return None, None
    temp = m.temp_size_in_bytes
    return temp, temp + m.output_size_in_bytes - m.alias_size_in_bytes


def probe_peak(args):
    """One call in this fresh process: the device's peak bytes in use during it, less before."""
    device = jax.devices(args.platform)[0]
    n, v = args.shape
    logits, labels = make_inputs(n, v, jnp.dtype(args.dtype), device)
    impl, kind, mode = args.probe.split(",")
    fn = make_call(impl, kind, mode == "donated")
    fn.lower(logits, labels).compile()
    x = jnp.array(logits, copy=True).block_until_ready() if mode == "donated" else logits
    stats = device.memory_stats()  # None where the platform keeps none (the CPU)
    before = stats["bytes_in_use"] if stats else None
    jax.block_until_ready(fn(x, labels))
    peak = device.memory_stats()["peak_bytes_in_use"] - before if stats else None
    print(json.dumps({"peak_bytes": peak}))


def measured_peak(args, impl, kind, mode):
    cmd = [sys.executable, __file__, "--platform", args.platform, "--dtype", args.dtype]
    cmd += ["--shape", f"{args.shape[0]},{args.shape[1]}", "--probe", f"{impl},{kind},{mode}"]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if run.returncode != 0:
        print(f"peak probe {impl} {kind} {mode} failed:\n{run.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])["peak_bytes"]  # None: no statistics


@jax.jit
def max_abs_diff(a, b):
    """Fused: no float32 copies of a GPU's bf16 16384 x 128256 gradients."""
    return jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))


def mib(b):
    return None if b is None else round(b / MIB, 1)


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", default=jax.default_backend())
    ap.add_argument("--shape", type=lambda s: tuple(int(t) for t in s.split(",")))
    ap.add_argument("--dtype")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--depth", type=int, default=5, help="calls queued per queued timing (>= 2)")
    ap.add_argument("--rounds", type=int, default=5, help="queued timings per line")
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # IMPL,KIND,MODE: one GPU peak, see above
    args = ap.parse_args()
    if args.depth < 2:
        ap.error("--depth must be at least 2 (queued timing is a difference of runs)")
    args.platform = "gpu" if args.platform in ("gpu", "cuda", "rocm") else "cpu"
    shape, dtype = DEFAULTS[args.platform]
    args.shape = args.shape or shape
    args.dtype = args.dtype or dtype
    if args.probe:
        return probe_peak(args)
    gpu = args.platform == "gpu"
    if gpu and not xj.with_cuda:
        print("xent.jax was built without its CUDA handlers (nvcc not found, or XENT_CUDA=0)")
        return 2
    reps = args.reps or (50 if gpu else 15)

    # The GPU's peaks first, while this process holds no device memory.
    peaks = {}
    if gpu:
        for kind, mode in LINES:
            for impl in impls_of(kind):
                peaks[impl, kind, mode] = measured_peak(args, impl, kind, mode)

    device = jax.devices(args.platform)[0]
    n, v = args.shape
    logits, labels = make_inputs(n, v, jnp.dtype(args.dtype), device)
    machine = {
        "device": device.device_kind,
        "platform": args.platform,
        "jax": jax.__version__,
        "optax": optax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "loadavg_before": os.getloadavg(),
        "host": platform.node(),
    }
    head = (
        f"# xent.jax against XLA (optax), {device.device_kind}, {args.dtype} {n} x {v}, "
        f"jax {jax.__version__}, {machine['usable_cpus']} CPUs usable, "
        f"load average {machine['loadavg_before'][0]:.2f} before"
    )
    cols = "| call | logits | impl | ms | xent / XLA | queued ms | queued xent / XLA "
    cols += "| cores | other cores | page faults "
    cols += "| XLA temp MiB "
    cols += "| extra MiB |" + (" peak MiB |" if gpu else "")
    lines = [head, "", cols, "|" + "---|" * (cols.count("|") - 1)]
    print("\n".join(lines), flush=True)

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    records = []
    for kind, mode in LINES:
        results, line_records = {}, {}
        impls = impls_of(kind)
        fns = [make_call(impl, kind, mode == "donated") for impl in impls]
        # The floor of the kept fused line, timed in turn with it: the copy of the logits that
        # XLA makes there, into a buffer as fresh as the call's own outputs.
        floor = (kind, mode) == ("fwd+bwd", "kept")
        copy = [lambda x, _: jnp.array(x, copy=True)] if floor else []
        timed = time_calls(fns + copy, logits, labels, mode == "donated", reps, args.warmup)
        queued = time_queued(fns + copy, logits, labels, mode == "donated", args.rounds, args.depth)
        base, queued_base = timed[0][0], queued[0]
        for impl, fn, (sec, cores, other, faults, out), q in zip(impls, fns, timed, queued):
            temp, extra = memory_plan(fn, logits, labels)
            results[impl] = out
            rec = {
                "call": kind,
                "logits": mode,
                "impl": impl,
                "n": n,
                "v": v,
                "dtype": args.dtype,
                "ms": sec * 1e3,
                "ratio_to_xla": sec / base,
                "queued_ms": q * 1e3,
                "queued_ratio_to_xla": q / queued_base,
                "queue_depth": args.depth,
                "cores": cores,
                "other_cores": other,
                "page_faults": faults,
                "reps": reps,
                "xla_temp_mib": mib(temp),
                "extra_mib": mib(extra),
            }
            if gpu:
                rec["peak_mib"] = mib(peaks[impl, kind, mode])
            records.append(rec)
            line_records[impl] = rec
            row = (
                f"| {kind} | {mode} | {impl} | {sec * 1e3:.2f} | {sec / base:.3f} "
                f"| {q * 1e3:.2f} | {q / queued_base:.3f} | {cores:.2f} | {other:.2f} "
                f"| {faults:.0f} | {fmt(rec['xla_temp_mib'], '.1f')} "
                f"| {fmt(rec['extra_mib'], '.1f')} |"
            )
            if gpu:
                row += f" {fmt(rec['peak_mib'], '.1f')} |"
            lines.append(row)
            print(row, flush=True)
        # They must agree, or the times compare different work.
        a = jax.tree.leaves(results["xla"])
        for impl in impls[1:]:
            b = jax.tree.leaves(results[impl])
            diffs = [float(max_abs_diff(p, q)) for p, q in zip(a, b)]
            line_records[impl]["max_abs_diff_to_xla"] = diffs
        line_records["xla"]["max_abs_diff_to_xla"] = line_records["xent"]["max_abs_diff_to_xla"]
        del results
        if floor:
            sec, cores, other, faults, _ = timed[-1]
            records.append(
                {
                    "call": "copy",
                    "logits": "kept",
                    "impl": "copy",
                    "n": n,
                    "v": v,
                    "dtype": args.dtype,
                    "ms": sec * 1e3,
                    "queued_ms": queued[-1] * 1e3,
                    "queue_depth": args.depth,
                    "cores": cores,
                    "other_cores": other,
                    "page_faults": faults,
                    "reps": reps,
                }
            )
            row = f"| copy of the logits | kept | jnp.array(copy=True) | {sec * 1e3:.2f} | "
            row += (
                f"| {queued[-1] * 1e3:.2f} | | {cores:.2f} | {other:.2f} | {faults:.0f} | | |"
                + (" |" if gpu else "")
            )
            lines.append(row)
            print(row, flush=True)

    machine["loadavg_after"] = os.getloadavg()
    machine["xla_pool_threads"] = xla_pool_threads()
    machine["max_rss_mib"] = mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    tail = (
        f"\nthreads: XLA's CPU pool {machine['xla_pool_threads']}, xent's workers "
        f"{os.cpu_count()}; load average {machine['loadavg_after'][0]:.2f} after; "
        "largest |xent - XLA| "
        f"(loss, gradient): "
        + "; ".join(
            f"{r['call']} {r['logits']} {r['impl']} "
            f"{', '.join(f'{d:.2e}' for d in r['max_abs_diff_to_xla'])}"
            for r in records
            if r["impl"].startswith("xent")
        )
    )
    lines.append(tail)
    print(tail, flush=True)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "jax_cross_entropy.jsonl", "a") as f:
            f.writelines(json.dumps({**r, **machine}) + "\n" for r in records)
        (out_dir / "jax_cross_entropy.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
