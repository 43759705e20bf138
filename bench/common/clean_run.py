#!/usr/bin/env python3
r"""Runs a Google Benchmark binary of xent one line at a time on a shared machine, keeping for each
line the attempt that other processes disturbed least, and writes one JSON in Google Benchmark's
format (context of the first attempt; each line's benchmarks, its roofs' lines included).

Each attempt is a separate process whose filter holds the line and the roof lines of its thread
count, so roof_pct still divides by a roof measured by the same process moments before. Before an
attempt the script waits for the CPUs to be idle; an attempt is accepted when every run in it
reports other_cores <= --max-other (the counter host_load.hpp fills), else it is retried.

  bench/common/clean_run.py build/bench-dev/bench/xent_bench_cpu \
      -o bench/results/cpu-HOST-DATE.json \
      [--filter REGEX] [--attempts 4] [-- flags for the binary]
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time


def cpu_idle_fraction(seconds=1.0):
    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v), v[3] + v[4]

    t0, i0 = read()
    time.sleep(seconds)
    t1, i1 = read()
    return (i1 - i0) / max(1, t1 - t0)


def wait_idle(max_wait, need=3, threshold=0.9):
    ok, start = 0, time.time()
    while time.time() - start < max_wait:
        ok = ok + 1 if cpu_idle_fraction() >= threshold else 0
        if ok >= need:
            return True
    return False


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("binary")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--filter", default=".", help="regex over line names (default: all)")
    ap.add_argument("--attempts", type=int, default=4)
    ap.add_argument("--max-other", type=float, default=0.25)
    ap.add_argument("--max-wait", type=float, default=300, help="seconds to wait for idle CPUs")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    # Flags after "--" go to the binary; without any, these.
    extra = argv[cut + 1 :] or ["--benchmark_min_time=0.2", "--benchmark_repetitions=3"]

    # The binary's own flags (--xent_threads, --xent_chunks) change the set of lines.
    own = [a for a in extra if a.startswith("--xent_")]
    names = subprocess.run(
        [args.binary, "--benchmark_list_tests=true", *own],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    lines = [n for n in names if "_roof/" not in n and re.search(args.filter, n)]
    merged, log = None, []
    for name in lines:
        threads = re.search(r"/threads:(\d+)", name).group(1)
        flt = rf"^[a-z]+_roof/threads:{threads}/|^{re.escape(name)}$"
        best = None
        for attempt in range(1, args.attempts + 1):
            idle = wait_idle(args.max_wait)
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                proc = subprocess.run(
                    [
                        args.binary,
                        f"--benchmark_filter={flt}",
                        f"--benchmark_out={tmp.name}",
                        "--benchmark_out_format=json",
                        *extra,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                if proc.returncode != 0:
                    sys.exit(f"{args.binary} failed ({proc.returncode}):\n{proc.stderr}")
                data = json.load(open(tmp.name))
            runs = [b for b in data["benchmarks"] if b.get("run_type") == "iteration"]
            worst = max((b.get("other_cores", 0.0) for b in runs), default=0.0)
            if best is None or worst < best[0]:
                best = (worst, attempt, data)
            print(
                f"{name}: attempt {attempt}, waited-for-idle={idle}, worst other_cores {worst:.2f}",
                file=sys.stderr,
                flush=True,
            )
            if worst <= args.max_other:
                break
        worst, attempt, data = best
        log.append(
            {
                "name": name,
                "attempt": attempt,
                "worst_other_cores": worst,
                "clean": worst <= args.max_other,
            }
        )
        if merged is None:
            merged = {"context": data["context"], "benchmarks": []}
        merged["benchmarks"].extend(data["benchmarks"])
    merged["context"]["xent_clean_run"] = log
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main()
