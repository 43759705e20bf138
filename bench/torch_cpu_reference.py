"""PyTorch's CPU cross-entropy, timed the way xent_bench_cpu times xent: the reference figure for
the foundation issue's CPU target (4096 x 32000 fp32, forward + backward, 2 and N threads).

Run beside xent_bench_cpu on the same machine (bench/gpu/run.sh does): python3 bench/torch_cpu_reference.py
Prints one JSON line per thread count.
"""

import json
import os
import time

import torch
import torch.nn.functional as F


def time_fwd_bwd(rows, cols, threads, repeats=10):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, cols, generator=gen, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, cols, (rows,), generator=gen)
    times = []
    for i in range(repeats + 2):
        logits.grad = None
        start = time.perf_counter()
        loss = F.cross_entropy(logits, targets)
        loss.backward()
        elapsed = time.perf_counter() - start
        if i >= 2:  # warm-up
            times.append(elapsed)
    times.sort()
    return times[len(times) // 2]


if __name__ == "__main__":
    for threads in sorted({2, os.cpu_count() or 2}):
        median = time_fwd_bwd(4096, 32000, threads)
        print(
            json.dumps(
                {
                    "impl": "torch",
                    "shape": "4096x32000",
                    "dtype": "f32",
                    "threads": threads,
                    "fwd_bwd_ms": round(median * 1e3, 2),
                    "torch": torch.__version__,
                }
            )
        )
