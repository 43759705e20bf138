#!/usr/bin/env bash
# Builds the xent_torch extension (CPU kernels; CUDA kernels too when torch has CUDA and nvcc is
# found, see xent_torch/_build.py) and runs its pytest suite (CUDA cases skip without a GPU).
# Skips, exiting 0 with a message, when PyTorch is not importable, or when pytest is missing and
# cannot be installed from the package registry. A build failure or a failing test exits non-zero.
# Usage: examples/pytorch/run_tests.sh [pytest args...]
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}

if ! "$python" -c "import torch" >/dev/null 2>&1; then
  echo "SKIPPED: '$python -c \"import torch\"' failed; the PyTorch binding was not built or tested."
  exit 0
fi
if ! "$python" -c "import pytest" >/dev/null 2>&1; then
  echo "pytest is missing; trying: $python -m pip install pytest"
  if ! "$python" -m pip install --quiet pytest || ! "$python" -c "import pytest" >/dev/null 2>&1; then
    echo "SKIPPED: pytest is not installed and could not be installed; the binding was not tested."
    exit 0
  fi
fi

echo "torch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
cd "$here"
start=$SECONDS
# Build first, on its own, so its time and any compiler error are reported apart from the tests.
"$python" -c "import xent_torch" 2>&1 | grep -v -e 'Failed to initialize NumPy' \
  -e '_conversion_method_template' -e 'No CUDA runtime is found' || true
"$python" -c "import xent_torch" >/dev/null 2>&1 || {
  echo "xent_torch failed to build or import:"
  XENT_TORCH_VERBOSE=1 "$python" -c "import xent_torch"
  exit 1
}
echo "extension ready ($((SECONDS - start)) s)"
# torch.compile's compiled-graph caches (inductor's, /tmp/torchinductor_$USER by default) key a
# graph by its code, which names the xent ops but not their schemas: a graph compiled against an
# earlier build of the ops (another checkout, an older commit) would be reused with the wrong
# arguments. The tests compile into a cache of their own, removed afterwards.
cache=$(mktemp -d)
status=0
TORCHINDUCTOR_CACHE_DIR="$cache" "$python" -m pytest -q -p no:cacheprovider tests "$@" || status=$?
rm -rf "$cache"
exit $status
