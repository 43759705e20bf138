"""Per-call time of xent's PyTorch binding next to torch eager, for shapes small enough that the
host's work per call (Python, the dispatcher, autograd) decides the time rather than the kernels.

    python3 bench/torch_overhead.py [--device cuda|cpu] [--reps N]

Each row is the wall-clock time of one call in a loop of N calls (median of 7 loops; CUDA is
synchronised before and after each loop, so a row is max(host time, device time) per call, what
a training loop of small steps sees):
  fwd           loss = f(logits, target) under torch.no_grad()
  fwd+bwd       f(logits, target).backward() from a leaf, its .grad reset each call
  impl "xent ops" calls the ops that xent.torch.cross_entropy runs, directly, without autograd or
  the Python wrapper: torch.ops.xent.cross_entropy_fwd (fwd), cross_entropy_fwd_bwd then
  scale_grad_ (fwd+bwd: the fused training path); the floor under "xent" (the gap between them is
  what autograd and the wrapper cost).
  impl "... graph" (CUDA): the same call captured once in a CUDA graph (torch.cuda.graph, as
  torch.compile's "reduce-overhead" mode does) and replayed: the host's cost per call is one
  replay, so the time is the kernels' own, set beside the C++ benchmark's kernel time.
Shapes: the issue's seed shapes on CUDA; on the CPU tiny ones (1 x 8, 4 x 8), where the arithmetic
is negligible, on one thread (a thread pool's wake-ups would swamp it). Writes the table to
$OUT/torch_overhead.md when OUT is set.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import xent.torch  # the installed package: pip install ./python

CUDA_SHAPES = [(32, 32000, torch.float32), (128, 32000, torch.float32), (32, 50257, torch.float32)]
CPU_SHAPES = [(1, 8, torch.float32), (4, 8, torch.float32)]


def per_call_us(fn, reps, sync):
    for _ in range(max(10, reps // 10)):  # warm-up: caches, allocator, lazy init
        fn()
    sync()
    loops = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        loops.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(loops)


def cuda_graph(step):
    """`step` captured in a CUDA graph after a few warm-up calls on a side stream (allocations
    and lazy initialisation happen outside the capture); returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=1000)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not xent.torch.cuda_built():
        print("xent was built without its CUDA kernels")
        return 2
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cpu":
        torch.set_num_threads(1)
    shapes = CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES
    fwd_op = torch.ops.xent.cross_entropy_fwd.default
    fused_op = torch.ops.xent.cross_entropy_fwd_bwd.default
    scale_op = torch.ops.xent.scale_grad_.default
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"# xent.torch per-call time, {name}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}\n",
        "| logits N x V | impl | fwd us | fwd+bwd us | fwd+bwd / torch's |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for n, v, dtype in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        x = (torch.randn(n, v, device=device, generator=g) * 2).to(dtype)
        t = torch.randint(0, v, (n,), device=device, generator=g)
        leaf = x.clone().requires_grad_()
        one = torch.ones((), device=device)

        def ops_fwd():
            fwd_op(x, t, None, -100, 1, 0.0, 0.0, 0.0, False, False, False)

        def ops_fwdbwd():
            grad = fused_op(x, t, None, -100, 1, 0.0, 0.0, 0.0, False, False)[3]
            scale_op(grad, one)

        impls = [("torch", F.cross_entropy), ("xent", xent.torch.cross_entropy)]
        rows = []
        for impl, fn in impls:

            def fwd(fn=fn):
                with torch.no_grad():
                    fn(x, t)

            def fwdbwd(fn=fn):
                fn(leaf, t).backward()
                leaf.grad = None

            rows.append(
                (impl, per_call_us(fwd, args.reps, sync), per_call_us(fwdbwd, args.reps, sync))
            )
            if device.type == "cuda":

                def graph_fwdbwd(fn=fn):
                    # As the eager line: no .grad to accumulate into (zero_grad's set_to_none), so
                    # autograd keeps the op's gradient; replays write the buffer of the capture.
                    leaf.grad = None
                    fn(leaf, t).backward()

                try:
                    timed = [
                        per_call_us(cuda_graph(f), args.reps, sync) for f in (fwd, graph_fwdbwd)
                    ]
                except RuntimeError as e:  # a capture refused: the row says why
                    timed = [f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]})"] * 2
                leaf.grad = None
                rows.append((f"{impl} graph", *timed))
        rows.append(
            (
                "xent ops",
                per_call_us(ops_fwd, args.reps, sync),
                per_call_us(ops_fwdbwd, args.reps, sync),
            )
        )
        for impl, f_us, fb_us in rows:
            shape = f"{n} x {v} {str(dtype).split('.')[-1]}"
            if isinstance(fb_us, str):
                line = f"| {shape} | {impl} | {f_us} | | |"
            else:
                ratio = fb_us / rows[0][2]  # the target: xent within 1.5x of torch
                line = f"| {shape} | {impl} | {f_us:.1f} | {fb_us:.1f} | {ratio:.2f} |"
            lines.append(line)
            print(line, flush=True)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "torch_overhead.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
