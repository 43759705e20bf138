#!/usr/bin/env bash
# Runs bench/compare.py on a GPU machine: makes Liger-Kernel, quack and Cut Cross-Entropy importable
# from the wheels carried in .whl/ (downloaded elsewhere: the GPU machine has no network; a wheel
# that fails to install leaves its library's column "n/a" with the reason), installs the xent
# package (pip install ./python) with its CUDA kernels, and writes compare.md, compare.png and
# compare.jsonl to $OUT. Then, where the cross-entropy part ran, the native lines
# (bench/compare_native.py): xent's C++ kernels by CUDA events (xent_bench_cuda, built here in
# build/compare-native for this GPU, or XENT_BENCH_CUDA's; cuda.json) and xent.jax against XLA on
# the large shapes (jax/N-V.jsonl, when jax with a GPU is importable); XENT_COMPARE_NATIVE=0 leaves
# them out.
#   bash bench/compare.sh [ce] [lce] [--quick]
# Fetching the wheels, once, on a machine with network, for the GPU machine's Python (--no-deps:
# torch, triton and cuda-bindings come from its own environment). quack's `cutlass` package is
# spread over four wheels: nvidia-cutlass-dsl (a .pth), -libs-core (the Python DSL, with
# cutlass.cutlass_dsl), -libs-base (the MLIR bindings) and -libs-cu13 (the IR module and runtime
# for CUDA 13 drivers; -libs-cu12 for older ones):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 -d .whl liger-kernel cut-cross-entropy quack-kernels \
#     nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-base \
#     nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit
python=${PYTHON:-python3}
export OUT=${OUT:-$root/build/compare}
mkdir -p "$OUT"

shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
  site=${XENT_COMPARE_SITE:-/tmp/xent-compare-site}
  # One at a time, so one failure does not stop the others; each into a folder of its own, then
  # merged: pip --target replaces a top-level folder that is already there, and the CUTLASS DSL
  # wheels all ship parts of nvidia_cutlass_dsl/.
  stage=$(mktemp -d)
  for w in "${wheels[@]}"; do
    d=$stage/$(basename "$w")
    if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$d" "$w" >/dev/null 2>&1; then
      mkdir -p "$site" && cp -a "$d"/. "$site"/
    else
      echo "could not install $w (its column will be n/a)"
    fi
  done
  rm -rf "$stage"
  dsl=$site/nvidia_cutlass_dsl/dsl_packages/cutlass
  [[ ! -d $dsl || -d $dsl/cutlass_dsl ]] ||
    echo "no nvidia-cutlass-dsl-libs-core in .whl/: quack will not find cutlass.cutlass_dsl"
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
# XENT_COMPARE_INSTALL=0 takes the xent already importable instead: built from this checkout on
# another machine and put on PYTHONPATH, so a shared GPU's time is not spent compiling.
if [[ ${XENT_COMPARE_INSTALL:-1} == 1 ]]; then
  XENT_CUDA=1 "$python" -m pip install --quiet --no-build-isolation --no-deps "$root/python" ||
    echo "the xent package did not build with CUDA: its column will be n/a"
fi
PYTHONUNBUFFERED=1 "$python" bench/compare.py "$@" || exit
[[ ${XENT_COMPARE_NATIVE:-1} == 1 ]] && grep -q '"kind": "ce"' "$OUT/compare.jsonl" || exit 0

# XENT_BENCH_CUDA: an xent_bench_cuda built elsewhere from this checkout, for this GPU.
bench=${XENT_BENCH_CUDA:-build/compare-native/bench/xent_bench_cuda}
build_bench() {
  [[ -n ${XENT_BENCH_CUDA:-} ]] && return
  local arch build=build/compare-native
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d .)
  [[ $arch == 90 ]] && arch=90a
  cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DXENT_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DXENT_BUILD_EXAMPLES=OFF >"$OUT/native-build.log" 2>&1 &&
    cmake --build $build --target xent_bench_cuda >>"$OUT/native-build.log" 2>&1
}
if build_bench; then
  # The shapes compare.py ran (N/V|...), each pass, three repetitions (their median).
  ran=$("$python" bench/compare_native.py --shapes filter)
  passes='op::(forward|forward_backward|backward)'
  "$bench" --benchmark_repetitions=3 --benchmark_out="$OUT/cuda.json" \
    --benchmark_out_format=json \
    --benchmark_filter="BM_copy_roof|BM_cross_entropy<(float|__nv_bfloat16), $passes>/($ran)/" \
    >"$OUT/cuda.log" 2>&1 || echo "xent_bench_cuda failed: $OUT/cuda.log"
else
  echo "xent_bench_cuda did not build: $OUT/native-build.log"
fi
jax=()
if "$python" -c "import jax; assert jax.devices('gpu')" >/dev/null 2>&1; then
  # The training shapes among them (N,V,dtype: a thousand rows or more).
  large=$("$python" bench/compare_native.py --shapes large)
  for shape in $large; do
    IFS=, read -r n v dtype <<<"$shape"
    OUT="$OUT/jax/$n-$v" "$python" bench/jax_cross_entropy.py --platform gpu --shape "$n,$v" \
      --dtype "$dtype" --reps 20 >"$OUT/jax-$n-$v.log" 2>&1 &&
      jax+=("$OUT/jax/$n-$v/jax_cross_entropy.jsonl") ||
      echo "jax_cross_entropy.py failed: $OUT/jax-$n-$v.log"
  done
fi
[[ -e $OUT/cuda.json ]] && "$python" bench/compare_native.py "$OUT/cuda.json" "${jax[@]}"
