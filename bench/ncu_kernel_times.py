"""Sums Nsight Compute's per-kernel durations by kernel name: where a call's time goes.

    ncu --metrics gpu__time_duration.sum --csv --print-units base APP ... > FILE.csv
    python3 bench/ncu_kernel_times.py FILE.csv

Prints one line per kernel name (no return type, namespaces or template arguments), the largest
total first: total milliseconds and the number of launches. bench/gpu/run.sh uses it for
XENT_LINEAR_NCU.
"""

import collections
import csv
import re
import sys


def main(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]  # ncu's own lines have fewer fields
    if not rows:
        sys.exit(f"{path}: no kernel rows (did ncu run?)")
    head, body = rows[0], rows[1:]
    name, value = head.index("Kernel Name"), head.index("Metric Value")
    total = collections.defaultdict(lambda: [0, 0.0])
    for r in body:
        kernel = re.split(r"[<(]", r[name].removeprefix("void "))[0].split("::")[-1]
        total[kernel][0] += 1
        total[kernel][1] += float(r[value].replace(",", "")) / 1e6  # ns -> ms
    for kernel, (count, ms) in sorted(total.items(), key=lambda kv: -kv[1][1]):
        print(f"{ms:10.3f} ms {count:5d}x  {kernel}")
    print(f"{sum(ms for _, ms in total.values()):10.3f} ms {len(body):5d}x  (all)")


if __name__ == "__main__":
    main(sys.argv[1])
