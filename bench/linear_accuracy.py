"""Errors of fused linear cross-entropy in bf16 against a float64 reference, beside torch eager's on
the same bf16 inputs (the fused linear issue: xent's errors no larger than torch eager's, d_weight
included).

    python3 bench/linear_accuracy.py [--shapes N,D,V ...] [--sigma S] [--seeds K]

For each shape and seed: bf16 hidden ~ N(0, 1) and weight ~ N(0, S^2 / D) (logits ~ N(0, S^2)),
class ids uniform with every tenth row ignored, reduction mean. The reference widens those same
bf16 values to float64 and takes the logits, loss and gradients in float64 (torch autograd). Torch
eager is cross_entropy(F.linear(h, w), y) in bf16, as a training script writes it (bf16 logits, the
softmax in float inside, bf16 gradients); xent is xent.torch.linear_cross_entropy in bf16 (on an
sm_90a build the Hopper paths: no logits in the forward, scaled probabilities in training).
Each error is the relative norm ||got - ref|| / ||ref|| (for the loss, |got - ref| / |ref|), and
the largest absolute difference; `ratio` is xent's relative error over torch's. xent runs in each
of VARIANTS: the default, order="low_memory" (the vocabulary outer, d_weight summed over every
row in float) and accumulate="output" (the fast order rounding d_weight into bf16 once per row
chunk). Prints a table and writes JSON lines (one per shape, seed, variant and quantity) to
$OUT/linear_accuracy.json when OUT is set.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import xent.torch  # the installed package: pip install ./python


def inputs(n, d, v, sigma, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, device="cuda").bfloat16()
    weight = (torch.randn(v, d, generator=g, device="cuda") * (sigma / d**0.5)).bfloat16()
    target = torch.randint(0, v, (n,), generator=g, device="cuda")
    target[::10] = -100
    return hidden, weight, target


def loss_and_grads(fn, hidden, weight, target, dtype):
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    loss = fn(h, w, target)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach().double(), dh.double(), dw.double()


def errors(got, ref):
    out = {}
    for name, g, r in zip(("loss", "d_hidden", "d_weight"), got, ref):
        out[name] = {
            "rel": ((g - r).norm() / r.norm()).item(),
            "max_abs": (g - r).abs().max().item(),
        }
    return out


# xent's variants, each beside torch eager: the default, then the training memory choices
# (xent.torch.linear_cross_entropy's order and accumulate).
VARIANTS = [
    ("xent", {}),
    ("xent (low memory)", {"order": "low_memory"}),
    ("xent (accumulate=output)", {"accumulate": "output"}),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes", nargs="*", default=["4096,2048,32000", "2048,4096,128256", "8192,2304,65536"]
    )
    p.add_argument("--sigma", type=float, default=4.0)
    p.add_argument("--seeds", type=int, default=2)
    a = p.parse_args(argv)
    try:
        a.shapes = [tuple(int(x) for x in shape.split(",")) for shape in a.shapes]
    except ValueError:
        p.error(f"--shapes takes N,D,V triples of integers, got {a.shapes}")
    if any(len(shape) != 3 for shape in a.shapes):
        p.error(f"--shapes takes N,D,V triples, got {a.shapes}")
    return a


HEADER = [
    "| N x D x V | seed | impl | what | torch rel | xent rel | ratio | torch max | xent max |",
    "|---|---|---|---|---|---|---|---|---|",
]


def row(n, d, v, seed, sigma, impl, what, torch_err, xent_err):
    """One comparison: the JSON record and its table line."""
    ratio = xent_err["rel"] / torch_err["rel"] if torch_err["rel"] > 0 else float("inf")
    record = {
        "shape": [n, d, v],
        "seed": seed,
        "sigma": sigma,
        "impl": impl,
        "what": what,
        "torch": torch_err,
        "xent": xent_err,
        "ratio": ratio,
    }
    line = (
        f"| {n} x {d} x {v} | {seed} | {impl} | {what} | {torch_err['rel']:.3e} | "
        f"{xent_err['rel']:.3e} | {ratio:.3f} | {torch_err['max_abs']:.3e} | "
        f"{xent_err['max_abs']:.3e} |"
    )
    return record, line


def main(argv=None):
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_accuracy.py needs a CUDA device; none is visible to torch")
        return 2
    out = os.environ.get("OUT")
    rows = []
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, sigma {a.sigma}")
    print("\n".join(HEADER))
    for n, d, v in a.shapes:
        for seed in range(a.seeds):
            hidden, weight, target = inputs(n, d, v, a.sigma, seed)

            def eager(h, w, y):
                return F.cross_entropy(F.linear(h, w), y)

            ref = loss_and_grads(eager, hidden, weight, target, torch.float64)
            torch_err = errors(loss_and_grads(eager, hidden, weight, target, torch.bfloat16), ref)
            for impl, memory in VARIANTS:

                def fused(h, w, y, memory=memory):
                    return xent.torch.linear_cross_entropy(h, w, y, **memory)

                xent_err = errors(
                    loss_and_grads(fused, hidden, weight, target, torch.bfloat16), ref
                )
                for what in ("loss", "d_hidden", "d_weight"):
                    record, line = row(
                        n, d, v, seed, a.sigma, impl, what, torch_err[what], xent_err[what]
                    )
                    rows.append(record)
                    print(line)
            del ref
            torch.cuda.empty_cache()
    if out:
        with open(os.path.join(out, "linear_accuracy.json"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
