#!/usr/bin/env python3
"""Where a small-batch launch's time goes, from the stamps of a benchmark built with
-DXENT_CUDA_SMALL_TIMELINE=1 and run with XENT_TIMELINE_DIR set (cuda/small_timeline.cuh): one
CSV per line, a row per CTA.

    python3 bench/small_timeline.py DIR/*.csv [--ghz 1.96]

For each file: when the CTAs started and ended (global timer, from the first start), how long
each step took per CTA by its SM's clock (quantiles 0/10/50/90/100%; the exchange also split at
warp 0's send and receive), and per row how long after its last rank had its statistics the
first rank knew the row's total (the exchange's own latency, apart from waiting on a slower
rank)."""
import argparse
import csv
from collections import Counter, defaultdict

STEPS = [(0, 1, "load and statistics"), (1, 2, "cluster ready"), (2, 3, "exchange"),
         (2, 6, "  send"), (6, 7, "  receive"), (7, 3, "  barrier"),
         (3, 4, "outputs and gradient"), (4, 5, "poll / end")]


def quantiles(values):
    v = sorted(values)
    if not v:
        return "-"
    return " ".join(f"{v[int(p * (len(v) - 1))]:.2f}" for p in (0, 0.1, 0.5, 0.9, 1))


def report(path, ghz):
    ctas = [{k: int(v) for k, v in r.items()} for r in csv.DictReader(open(path))]
    if not ctas:
        print(f"{path}: no stamps")
        return
    g0 = min(c["global_start"] for c in ctas)
    per_us = ghz * 1e3  # clock cycles per microsecond

    def at(c, k):  # step k of CTA c, in us from the first start
        return (c["global_start"] - g0) / 1e3 + (c[f"c{k}"] - c["c0"]) / per_us

    sms = Counter(c["sm"] for c in ctas)
    print(f"{path}: {len(ctas)} CTAs on {len(sms)} SMs "
          f"(CTAs per SM: {dict(sorted(Counter(sms.values()).items()))})")
    print(f"  started (us)            {quantiles([(c['global_start'] - g0) / 1e3 for c in ctas])}")
    print(f"  ended (us)              {quantiles([(c['global_end'] - g0) / 1e3 for c in ctas])}")
    for a, b, name in STEPS:
        # c6 and c7 (warp 0's send and receive) exist in stamps taken after 3160668.
        d = [(c[f"c{b}"] - c[f"c{a}"]) / per_us for c in ctas
             if c.get(f"c{a}") and c.get(f"c{b}")]
        print(f"  {name:<23} {quantiles(d)}")
    rows = defaultdict(list)
    for c in ctas:
        if c["c3"]:
            rows[c["row"]].append(c)
    latency = [min(at(c, 3) for c in r) - max(at(c, 1) for c in r) for r in rows.values()]
    spread = [max(at(c, 1) for c in r) - min(at(c, 1) for c in r) for r in rows.values()]
    print(f"  row total after its last rank's statistics {quantiles(latency)}")
    print(f"  spread of a row's ranks' statistics        {quantiles(spread)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--ghz", type=float, default=1.96, help="SM clock (ncu: SM Frequency)")
    args = parser.parse_args()
    for path in args.files:
        report(path, args.ghz)


if __name__ == "__main__":
    main()
