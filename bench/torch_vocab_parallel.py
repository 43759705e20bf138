"""Vocab-parallel cross-entropy across GPUs, one process per GPU, as tensor-parallel training runs
it: xent.torch.distributed against Megatron-core's vocab_parallel_cross_entropy (when installed)
and against xent's single-GPU call on the whole vocabulary, in one run.

    torchrun --nproc-per-node R bench/torch_vocab_parallel.py [--rows N] [--vocab V]
        [--dtype bf16|fp16|fp32] [--reps K]

Every rank times the same calls a fixed number of times (a count decided up front: a timing loop
that sizes itself per rank would leave ranks in different collectives), each repetition after a
256 MiB write that evicts L2, between CUDA events; a row reports the slowest rank's median.
  single    xent.torch.cross_entropy on the whole N x V logits (each rank on its own GPU: the
            one-GPU time of the same run)
  xent      xent.torch.distributed.vocab_parallel_cross_entropy, reduction mean
  megatron  megatron.core's vocab_parallel_cross_entropy(...).mean() (its tensor-parallel group set
            to this run's world)
fwd runs under torch.no_grad(); fwd+bwd is loss.backward() from the logits (a leaf, .grad reset
between repetitions). Bytes on the wire per row and rank: xent's all-gather sends a 40-byte record
per row (and a 32-byte header per call); Megatron's three all-reduces carry 12 bytes per row.
Writes $OUT/torch_vocab_parallel.jsonl (rank 0) and prints a table.
"""

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import xent.torch
import xent.torch.distributed as xd
from common.cuda_events import event_times

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, reps, flush):
    """Median ms of fn over `reps` repetitions after 3 warm-ups, the same count on every rank."""
    for _ in range(3):
        fn()
    return statistics.median(event_times(fn, reps, before=flush.zero_))


def slowest(ms):
    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def one_gpu(logits, target, reps, flush):
    """xent.torch.cross_entropy on the whole logits: the slowest rank's median ms per mode."""
    whole = logits.detach().requires_grad_()

    def fwd():
        with torch.no_grad():
            xent.torch.cross_entropy(whole, target)

    def fwd_bwd():
        whole.grad = None
        xent.torch.cross_entropy(whole, target).backward()

    return {
        mode: slowest(timed(fn, reps, flush)) for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd))
    }


def megatron_loss(group):
    """Megatron-core's function with its tensor-parallel group set to `group`, or the reason it
    cannot run."""
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except Exception as e:  # noqa: BLE001 - any import failure makes its rows n/a
        return None, f"megatron.core: {type(e).__name__}: {e}"
    ps._TENSOR_MODEL_PARALLEL_GROUP = group
    ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = dist.get_world_size(group)
    ps._MPU_TENSOR_MODEL_PARALLEL_RANK = dist.get_rank(group)
    return (lambda logits, target: vocab_parallel_cross_entropy(logits, target).mean()), None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    dtype = DTYPES[args.dtype]
    n, v = args.rows, args.vocab
    per = v // ranks
    start = rank * per
    cols = v - start if rank == ranks - 1 else per

    g = torch.Generator(device="cuda").manual_seed(1)
    full = torch.randn(n, v, device="cuda", dtype=dtype, generator=g)
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    shard = full[:, start : start + cols].contiguous().requires_grad_()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []

    def row(impl, mode, ms, **extra):
        rows.append(
            {
                "impl": impl,
                "mode": mode,
                "ms": ms,
                "rows": n,
                "vocab": v,
                "dtype": args.dtype,
                "ranks": ranks,
                **extra,
            }
        )

    # The one-GPU baseline (its N x V logits and gradient freed on return), then the sharded calls.
    for mode, ms in one_gpu(full, target, args.reps, flush).items():
        row("single", mode, ms)
    del full
    torch.cuda.empty_cache()

    impls = {"xent": lambda x, t: xd.vocab_parallel_cross_entropy(x, t, group, reduction="mean")}
    mega, why = megatron_loss(group)
    if mega is not None:
        impls["megatron"] = mega
    elif rank == 0:
        rows.append({"impl": "megatron", "error": why})
    for impl, fn in impls.items():
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd":

                def call(fn=fn):
                    with torch.no_grad():
                        fn(shard, target)
            else:

                def call(fn=fn):
                    shard.grad = None
                    fn(shard, target).backward()

            row(
                impl,
                mode,
                slowest(timed(call, args.reps, flush)),
                wire_bytes_per_row=40 if impl == "xent" else 12,
            )

    if rank == 0:
        base = {r["mode"]: r["ms"] for r in rows if r.get("impl") == "single"}
        out = Path(os.environ.get("OUT", "build/torch_vocab_parallel"))
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "torch_vocab_parallel.jsonl", "w") as f:
            for r in rows:
                if "ms" in r:
                    r["vs_single"] = r["ms"] / base[r["mode"]]
                f.write(json.dumps(r) + "\n")
        print(f"| impl | mode | ms | x one GPU | ({ranks} ranks, {n} x {v} {args.dtype}) |")
        print("|---|---|---|---|---|")
        for r in rows:
            if "ms" in r:
                print(f"| {r['impl']} | {r['mode']} | {r['ms']:.3f} | {r['vs_single']:.3f} | |")
            else:
                print(f"| {r['impl']} | n/a: {r['error']} | | | |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
