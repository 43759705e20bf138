#!/usr/bin/env bash
# Runs bench/compare.py on a GPU machine: makes Liger-Kernel and Cut Cross-Entropy importable from
# the wheels carried in .whl/ (downloaded elsewhere: the GPU machine has no network; a wheel that
# fails to install leaves its library's column "n/a" with the reason), installs the xent package
# (pip install ./python) with its CUDA kernels, and writes compare.md, compare.png and
# compare.jsonl to $OUT.
#   bash bench/compare.sh [ce] [lce] [--quick]
# Fetching the wheels, once, on a machine with network (pure-Python; --no-deps: torch and triton
# come from the GPU machine's own environment):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl liger-kernel cut-cross-entropy
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
export OUT=${OUT:-$root/build/compare}
mkdir -p "$OUT"

shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
  site=${XENT_COMPARE_SITE:-/tmp/xent-compare-site}
  for w in "${wheels[@]}"; do  # one at a time, so one failure does not stop the others
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$w" >/dev/null 2>&1 || echo "could not install $w (its column will be n/a)"
  done
  # PYTHONPATH skips a folder's .pth files, and quack's CUTLASS DSL is found through one
  # (nvidia_cutlass_dsl_packages.pth): site.addsitedir runs them, and what they add joins too.
  pth_paths=$("$python" -c 'import site, sys
before = set(sys.path)
site.addsitedir(sys.argv[1])
print(":".join(p for p in sys.path if p not in before))' "$site")
  export PYTHONPATH=$pth_paths${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no wheels in .whl/: Liger-Kernel and Cut Cross-Entropy are used only if already installed"
fi

# The package with its CUDA kernels (a build error is shown here, not buried in a traceback).
XENT_CUDA=1 "$python" -m pip install --quiet --no-build-isolation --no-deps "$root/python" ||
  echo "the xent package did not build with CUDA: its column will be n/a"
PYTHONUNBUFFERED=1 exec "$python" bench/compare.py "$@"
