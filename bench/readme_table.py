"""The README's performance section, made from a bench/compare.sh results folder.

    python3 bench/readme_table.py bench/results/h200-compare              # prints the section
    python3 bench/readme_table.py bench/results/h200-compare --write README.md

Reads FOLDER/compare.jsonl (bench/compare.py's JSON lines: the machine first, then one line per
shape and implementation) and writes the section: the run (GPU, commit, date, library versions),
the plot, one table of forward+backward times over the large logits and the two LM heads, and
what the table does not show (xent's share of the copy roof, the GEMM floor, the low-memory
order's memory, and where bench/compare_native.py added its rows, the C++ kernel's and xent.jax's
times beside the torch binding's). With --write the section replaces the README's text between
the lines `<!-- performance -->` and `<!-- /performance -->`, so the README's figures are always
a run's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BEGIN, END = "<!-- performance -->", "<!-- /performance -->"
# The rows: cross-entropy over logits (N, V, dtype), then the LM heads (N, D, V, bf16).
CE_ROWS = [(8192, 32000, "bfloat16"), (16384, 128256, "bfloat16"), (4096, 262144, "bfloat16")]
CE_ROWS += [(8192, 128256, "float32")]
LCE_ROWS = [(8192, 4096, 128256), (16384, 2304, 256000)]
COLUMNS = ["torch", "torch.compile", "Liger", "quack", "CCE", "xent"]
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
# A column's library: its name in the text and the machine line's key for its version.
LIBRARIES = {
    "Liger": ("Liger-Kernel", "liger_kernel"),
    "quack": ("quack", "quack_kernels"),
    "CCE": ("Cut Cross-Entropy", "cut_cross_entropy"),
}
MIB = 1 << 20


def load(folder: Path):
    machine, rows = None, []
    for line in (folder / "compare.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "machine":
            machine = rec
        else:
            rows.append(rec)
    if machine is None:
        raise SystemExit(f"{folder / 'compare.jsonl'}: no machine line")
    return machine, rows


def find(rows, kind, impl=None, **shape):
    for r in rows:
        if r["kind"] == kind and (impl is None or r.get("impl") == impl):
            if all(r.get(k) == v for k, v in shape.items()):
                return r
    return None


def ms(rec, digits):
    """A row's forward+backward time, or blank where the library has no such entry or none ran."""
    if rec is None or "fwdbwd_ms" not in rec:
        return ""
    return f"{rec['fwdbwd_ms']:.{digits}f}"


def section(folder: Path, readme_dir: Path) -> str:
    machine, rows = load(folder)
    # Only the libraries that have a figure somewhere get a column.
    present = [c for c in COLUMNS if any(r.get("impl") == c and "fwdbwd_ms" in r for r in rows)]
    versions = [f"{LIBRARIES[c][0]} {machine[LIBRARIES[c][1]]}" for c in present if c in LIBRARIES]
    torch_version = machine["torch"].split("+")[0]
    rel = folder.resolve().relative_to(readme_dir.resolve())
    run = (
        f"One {machine['gpu']}, commit {machine['commit']}, {machine['date']}: forward+backward "
        f"against PyTorch {torch_version}, `torch.compile`, {', '.join(versions[:-1])} and "
        f"{versions[-1]} in one process on the same tensors, medians of `triton.testing.do_bench` "
        f"(`{rel.as_posix()}/`, whose `compare.md` has every row, the forwards and the memory; "
        "`bench/readme_table.py` writes this section from it)."
    )
    out = wrap(run, 100) + [
        "",
        f"![xent against {', '.join(present[:-2])} and {present[-2]}]"
        f"({rel.as_posix()}/compare.png)",
        "",
        "| forward+backward, ms | " + " | ".join(present) + " |",
        "|---|" + "---|" * len(present),
    ]
    for n, v, dtype in CE_ROWS:
        cells = [ms(find(rows, "ce", c, n=n, v=v, dtype=dtype), 3) for c in present]
        out.append(f"| {SHORT[dtype]} logits {n} × {v} | " + " | ".join(cells) + " |")
    for n, d, v in LCE_ROWS:
        cells = [ms(find(rows, "lce", c, n=n, d=d, v=v), 2) for c in present]
        out.append(f"| bf16 LM head {n} × {d} × {v} | " + " | ".join(cells) + " |")
    out.append("")
    roofs = [find(rows, "ce", "xent", n=n, v=v, dtype=t) for n, v, t in CE_ROWS]
    roofs = [r["fwdbwd_roof_pct"] for r in roofs if r and "fwdbwd_roof_pct" in r]
    floors = [find(rows, "lce_floor", n=n, d=d, v=v) for n, d, v in LCE_ROWS]
    notes = []
    if roofs:
        notes.append(
            f"Over logits xent runs at {min(roofs):.0f}-{max(roofs):.0f}% of the GPU's copy roof."
        )
    if all(floors):
        notes.append(
            "The LM head rows (hidden N × D, weight V × D) include the GEMMs; there the three "
            "cuBLAS GEMMs alone take "
            + " and ".join(f"{f['fwdbwd_ms']:.2f}" for f in floors)
            + " ms."
        )
    n, d, v = LCE_ROWS[0]
    low = find(rows, "lce", "xent (low memory)", n=n, d=d, v=v)
    cce = find(rows, "lce", "CCE", n=n, d=d, v=v)
    if low and "extra_MiB" in low:
        grads = 2 * (n * d + v * d) / MIB  # bf16 d_hidden and d_weight
        text = (
            f'With `order="low_memory"`, xent\'s LM-head step needs only the gradients plus '
            f"{low['extra_MiB'] - grads:.0f} MiB"
        )
        if cce and "extra_MiB" in cce:
            text += f" (CCE: the gradients plus {cce['extra_MiB'] - grads:.0f} MiB)"
        notes.append(text + f", in {low['fwdbwd_ms']:.2f} ms at the first shape.")
    notes += native_notes(rows)
    notes.append(
        "[docs/benchmarks.md](docs/benchmarks.md) has those rows, the C++ kernel figures, two "
        "GPUs, the CPU backend, JAX against XLA, and how each was measured."
    )
    out += wrap(" ".join(notes), 100)
    return "\n".join(out) + "\n"


def native_notes(rows) -> list[str]:
    """What the bindings add to the kernels, from compare_native.py's rows (none: no note)."""
    n, v, dtype = CE_ROWS[1]
    shape = {"n": n, "v": v, "dtype": dtype}
    cxx = find(rows, "ce-native", "xent C++", **shape)
    if not cxx or cxx.get("fwdbwd_ms") is None:
        return []
    text = (
        f"At {SHORT[dtype]} {n} × {v} xent's C++ kernel takes {cxx['fwdbwd_ms']:.3f} ms for "
        "forward+backward (CUDA events)"
    )
    binding = find(rows, "ce", "xent", **shape)
    if binding and "fwdbwd_ms" in binding:
        text += f", {binding['fwdbwd_ms']:.3f} through xent.torch"
    jax, xla = (find(rows, "ce-native", impl, **shape) for impl in ("xent.jax", "XLA"))
    if jax and xla and (jax.get("fwdbwd_ms") or 0) > 0 and (xla.get("fwdbwd_ms") or 0) > 0:
        text += (
            f" and {jax['fwdbwd_ms']:.3f} through xent.jax against XLA's {xla['fwdbwd_ms']:.3f} "
            "(JAX's queued time)"
        )
    bwd = [find(rows, "ce-native", "xent C++", n=a, v=b, dtype=t) for a, b, t in CE_ROWS]
    bwd = [r["bwd_roof_pct"] for r in bwd if r and r.get("bwd_roof_pct") is not None]
    if bwd:
        text += (
            f"; its backward from a saved LSE runs at {min(bwd):.0f}-{max(bwd):.0f}% of the "
            "copy roof"
        )
    return [text + "."]


def wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` characters, never broken inside "N × D"."""
    glue = "\0"
    lines, line = [], ""
    for word in text.replace(" × ", f"{glue}×{glue}").split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [x.replace(glue, " ") for x in lines + ([line] if line else [])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a bench/compare.sh results folder")
    ap.add_argument("--write", type=Path, metavar="README", help="replace the README's section")
    a = ap.parse_args(argv)
    readme = a.write or Path(__file__).resolve().parent.parent / "README.md"
    text = section(a.folder, readme.parent)
    if not a.write:
        sys.stdout.write(text)
        return 0
    old = a.write.read_text()
    if BEGIN not in old or END not in old:
        raise SystemExit(f"{a.write}: no {BEGIN} ... {END} lines to replace")
    head, rest = old.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    a.write.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
