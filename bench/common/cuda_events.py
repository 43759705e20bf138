"""Timing between CUDA events, for the Python benchmarks (bench/compare.py,
bench/torch_vocab_parallel.py; each puts bench/ on sys.path by being run from it)."""

import torch


def event_times(fn, reps, before=None):
    """fn's time in ms for each of `reps` calls, between two CUDA events recorded around fn alone;
    `before` (an L2 flush, a reset of .grad) runs ahead of each call, outside the measurement."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times
