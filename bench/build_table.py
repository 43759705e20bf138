"""Google Benchmark JSON of several builds, side by side: the `table.txt` of an A/B run.

    python3 bench/build_table.py DIR NAME[,NAME...]

DIR holds NAME-ROUND.json files (what bench/gpu/run.sh writes for each build of an A/B and
round). One line per benchmark in the order first seen, one column per
build with that build's rounds separated by " / " (real_time in each line's own time_unit:
microseconds for the CUDA benchmarks). Repetition aggregates are left out.
"""

import collections
import glob
import json
import os
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    folder, names = sys.argv[1], sys.argv[2].split(",")
    lines = collections.OrderedDict()
    for name in names:
        files = sorted(glob.glob(os.path.join(folder, f"{name}-*.json")))
        if not files:
            sys.exit(f"no {name}-*.json in {folder}")
        for path in files:
            with open(path) as f:
                for b in json.load(f)["benchmarks"]:
                    if b.get("run_type") == "aggregate" or b["name"].startswith("BM_copy_kernel"):
                        continue
                    line = b["name"].replace("/manual_time", "")
                    lines.setdefault(line, {}).setdefault(name, []).append(b["real_time"])
    width = max(len(line) for line in lines) + 2
    cells = {
        line: [" / ".join(f"{t:.4g}" for t in times.get(n, [])) for n in names]
        for line, times in lines.items()
    }
    col = max([len(n) for n in names] + [len(c) for row in cells.values() for c in row]) + 2
    print("line".ljust(width) + "".join(n.rjust(col) for n in names))
    for line, row in cells.items():
        print(line.ljust(width) + "".join(c.rjust(col) for c in row))


if __name__ == "__main__":
    main()
