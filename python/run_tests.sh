#!/usr/bin/env bash
# Installs the xent Python package as a user would (pip install ./python, which compiles the ops)
# and runs its whole pytest suite. Nothing is skipped for want of a dependency: torch, pytest,
# transformers and the build tools come from the package registry when missing, and a missing
# torch, a failed build or a failing test exits non-zero (CUDA cases skip without a GPU).
#
# Python: $PYTHON when set (its environment gets the packages); otherwise a virtual environment
# at build/python-venv, created on first use and reused.
# Environment: XENT_CUDA (0: CPU kernels only; 1: CUDA kernels required; see pyproject.toml),
#              TORCH_CUDA_ARCH_LIST, CMAKE_BUILD_PARALLEL_LEVEL (default 2).
# Usage: python/run_tests.sh [pytest args...]
#        python/run_tests.sh --env   only the environment: prints the interpreter's path last
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")

if [[ -n "${PYTHON:-}" ]]; then
  python=$PYTHON
else
  venv="$root/build/python-venv"
  [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
  python="$venv/bin/python"
fi

start=$SECONDS
# torch before the package: the build links the torch it finds (--no-build-isolation). Only what
# is missing is installed, so a prepared environment needs no registry.
missing=()
for req in torch pytest "transformers:transformers>=5" scikit_build_core:scikit-build-core ninja; do
  "$python" -c "import ${req%%:*}" >/dev/null 2>&1 || missing+=("${req#*:}")
done
if ((${#missing[@]})); then
  echo "installing ${missing[*]} with $python -m pip"
  "$python" -m pip install --quiet "${missing[@]}"
fi
echo "torch $("$python" -c 'import torch; print(torch.__version__)') ($((SECONDS - start)) s)"
if [[ ${1:-} == --env ]]; then
  echo "$python"
  exit 0
fi

start=$SECONDS
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
  "$python" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall "$here"
"$python" -c 'import xent.torch as x; print("xent installed, CUDA kernels:", x.cuda_built())'
echo "package built and installed ($((SECONDS - start)) s)"

# torch.compile's compiled-graph caches (inductor's, /tmp/torchinductor_$USER by default) key a
# graph by its code, which names the xent ops but not their schemas: a graph compiled against an
# earlier build of the ops would be reused with the wrong arguments. The tests compile into a
# cache of their own, removed afterwards. They run from the repository root, so `import xent`
# finds the installed package, not the source folder.
cache=$(mktemp -d)
status=0
cd "$root"
TORCHINDUCTOR_CACHE_DIR="$cache" "$python" -m pytest -q -p no:cacheprovider python/tests "$@" ||
  status=$?
rm -rf "$cache"
exit $status
