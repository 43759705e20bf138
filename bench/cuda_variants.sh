#!/usr/bin/env bash
# Builds the CUDA benchmark once per set of tunables and times each on the same shapes, back to
# back on one GPU: how the numbers of include/xent/cuda/tuning/policy.cuh were measured. FLAGS
# -DXENT_CUDA_<NAME>=VALUE replace single numbers of the tuning row (bench/tuning/override.cuh).
#   bash bench/cuda_variants.sh [--build-only|--run-only] FILTER NAME=FLAGS...
#   e.g. bash bench/cuda_variants.sh 'bfloat16.*16384/128256' base= mb2=-DXENT_CUDA_MIN_BLOCKS=2
# FLAGS of the form @DIR build that variant from DIR/include instead of include/: a change to the
# code against its parent, e.g. (the device tool carries the ignored build/base):
#   git archive HEAD include | tar -x -C build/base      # here, before the change is committed
#   bash bench/cuda_variants.sh 'forward_backward' new= old=@build/base
# Writes $OUT/variant-NAME.json (Google Benchmark JSON) and prints time and % of roof per line.
set -uo pipefail
OUT=${OUT:-$PWD/build/variants-out}
mkdir -p "$OUT" build/variants
step=both
[[ ${1:-} == --build-only ]] && { step=build; shift; }
[[ ${1:-} == --run-only ]] && { step=run; shift; }
filter=$1
shift
arch=${XENT_VARIANT_ARCH:-90}
major=${arch%a}
major=${major%?}  # the tuning row the variants start from: 90 -> 9, 100a -> 10
for spec in "$@"; do
  [[ $step == run ]] && break
  name=${spec%%=*}
  flags=${spec#*=}
  include=include
  [[ $flags == @* ]] && { include=${flags#@}/include; flags=; }
  # shellcheck disable=SC2086
  nvcc -std=c++17 -O3 -arch=sm_$arch -DNDEBUG -I"$include" -Ibench -I/usr/include/eigen3 \
    -diag-suppress=20012,20013,20015 -DXENT_CUDA_TUNING_OVERRIDE="\"$PWD/bench/tuning/override.cuh\"" \
    -DXENT_CUDA_TUNED_MAJOR="$major" $flags \
    bench/cuda_cross_entropy.cu -o "build/variants/$name" \
    -lbenchmark -lpthread >"$OUT/build-$name.log" 2>&1 &
done
wait
[[ $step == build ]] && exit 0
for spec in "$@"; do
  name=${spec%%=*}
  if [[ ! -x build/variants/$name ]]; then
    echo "$name: build failed"; tail -5 "$OUT/build-$name.log"; continue
  fi
  "build/variants/$name" --benchmark_filter="copy_roof|$filter" --benchmark_out="$OUT/variant-$name.json" \
    --benchmark_out_format=json --benchmark_min_time="${XENT_VARIANT_MIN_TIME:-0.3}" \
    >"$OUT/variant-$name.txt" 2>&1
  # A line's name may hold spaces (template arguments): it ends at the field "*manual_time".
  awk -v n="$name" '/manual_time/ && !/copy_roof/ {l = ""; r = ""; t = 0
    for (i = 1; i <= NF; i++) {
      if ($i ~ /^loss=/) l = $i
      if ($i ~ /^roof_pct=/) r = $i
      if (!t && $i ~ /manual_time$/) { t = i; name = $1; for (j = 2; j <= i; j++) name = name $j }
    }
    printf "%-8s %-90s %10s %s %s %s\n", n, name, $(t + 1), $(t + 2), r, l}' \
    "$OUT/variant-$name.txt"
done
