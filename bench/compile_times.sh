#!/usr/bin/env bash
# CPU seconds (user + sys, not wall: the machine may be shared) of what a CUDA call costs to
# compile, phase by phase, and how many kernels it instantiates.
#
#   bash bench/compile_times.sh [PROBE...]      the probes below (default: all of them)
#   bash bench/compile_times.sh --ninja DIR OBJ...   each object's own compile command from the
#                                                    build tree DIR (ninja), timed whole
#
# The probes, each one translation unit of one entry-point call (written to a temporary folder):
#   cuda       xent::forward_backward(xent::cuda{...}) on bf16 logits with int64 class ids, for
#              sm_90 alone, then for CMake's default pair (80-virtual;90-real);
#   precompiled  the same call with XENT_CUDA_PRECOMPILED (what a target that links
#              xent::cuda_kernels sees: the library compiled its kernels), sm_90;
#   precompiled-static  the same call on logits of static extents 32 x 32000 (views.hpp) with
#              XENT_CUDA_PRECOMPILED: the small-batch kernel's compile-time plan, which the library
#              does not hold, compiled by the call's own unit, sm_90;
#   cpu        xent::forward_backward(xent::cpu{}) on float logits, g++ -O3.
# Each nvcc probe runs nvcc's own steps (nvcc -dryrun) one by one and reports each step's CPU
# time: preprocessing, cudafe++ (the host/device split), cicc (device front end and NVVM, per
# virtual architecture), ptxas (per real one), fatbinary, the host compile. Kernels: the SASS
# functions of each real architecture and the PTX entries of each virtual one.
# NVCC, CXX, EIGEN (the Eigen include folder) and XENT_NVCC_FLAGS (more flags) may be set.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
cxx=${CXX:-g++}
eigen=${EIGEN:-/usr/include/eigen3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The flags of a Release build of xent's own CUDA targets (cmake/XentHelpers.cmake), less
# -march=native.
# shellcheck disable=SC2054,SC2206  # -diag-suppress takes a comma list; the extra flags split
cuda_flags=(-std=c++17 -O3 -DNDEBUG -I"$root/include" -isystem "$eigen"
  -diag-suppress=20012,20015 ${XENT_NVCC_FLAGS:-})

# mark VAR: VAR = the CPU seconds (user + sys) of this shell's finished children so far, from
# bash's `times` (its second line), which must run in this shell, not in a $(...) subshell.
mark() {
  times >"$work/times"
  printf -v "$1" '%s' "$(awk 'END {
    s = 0
    for (i = 1; i <= 2; i++) { split($i, p, /[ms]/); s += p[1] * 60 + p[2] }
    print s
  }' "$work/times")"
}

since() {  # since A B: B - A, two decimals
  awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'
}

run_step() {  # run_step NAME ARCH COMMAND...: runs COMMAND, prints NAME ARCH CPU-seconds
  local before after
  mark before
  "${@:3}"
  mark after
  echo "$1 $2 $(since "$before" "$after")"
}

# time_nvcc NAME FILE FLAGS...: runs nvcc's steps for FILE one at a time, one line per step:
#   NAME  STEP  ARCH  CPU-seconds
# then the total and the kernel counts.
time_nvcc() {
  local name=$1 file=$2
  shift 2
  local keep="$work/$name.keep" obj="$work/$name.o" steps="$work/$name.steps.sh"
  mkdir -p "$keep"
  # Each step of nvcc's plan (nvcc -dryrun) prefixed by run_step with its name and architecture;
  # the variables nvcc sets for its steps exported (a line with two quoted words is not one).
  "$nvcc" "${cuda_flags[@]}" "$@" -dryrun -keep -keep-dir "$keep" -c "$file" -o "$obj" 2>&1 |
    sed -n 's/^#\$ //p' | awk '
      /^[A-Za-z_]+=/ { if ($0 !~ /" "/) print "export " $0; next }
      {
        step = $1
        gsub(/"/, "", step)
        sub(/.*\//, "", step)
        if (step == "gcc" || step == "g++" || step == "c++")
          step = ($0 ~ / -E /) ? "preprocess" : "host-compile"
        arch = "host"
        if (step == "host-compile" || step == "fatbinary") {
        } else if (match($0, /-arch[ =](compute|sm)_[0-9a]+/)) {
          arch = substr($0, RSTART + 6, RLENGTH - 6)
        } else if (match($0, /-D__CUDA_ARCH__=[0-9]+/)) {
          arch = "compute_" int(substr($0, RSTART + 16, RLENGTH - 16) / 10)
        }
        print "run_step " step " " arch " " $0
      }' >"$steps"
  local out
  out=$(cd "$work" && work=$work bash -c "$(declare -f mark since run_step); source $steps")
  awk -v n="$name" '{ printf "%-12s %-13s %-11s %7.2f\n", n, $1, $2, $3; t += $3 }
    END { printf "%-12s %-13s %-11s %7.2f\n", n, "total", "", t }' <<<"$out"
  local sass ptx
  # A toolkit without cuobjdump (some CUDA 13 installs) leaves the counts out, not the run.
  command -v cuobjdump >/dev/null || {
    printf '%-12s kernels: no cuobjdump\n' "$name"
    return 0
  }
  sass=$(cuobjdump -sass "$obj" 2>/dev/null | awk '/^arch = /{a=$3} /Function :/{c[a]++}
    END{for (k in c) printf "%s %d  ", k, c[k]}')
  ptx=$(cuobjdump -ptx "$obj" 2>/dev/null | awk '/^arch = /{a=$3} /\.entry /{c[a]++}
    END{for (k in c) printf "%s %d  ", k, c[k]}')
  printf '%-12s kernels: SASS %s PTX %s\n' "$name" "${sass:-none}" "${ptx:-none}"
}

if [[ ${1:-} == --ninja ]]; then
  dir=$2
  shift 2
  for obj in "$@"; do
    cmd=$(ninja -C "$dir" -t commands "$obj" | tail -n 1)
    rm -f "$dir/$obj"
    mark before
    (cd "$dir" && eval "$cmd")
    mark after
    printf '%-70s %8s\n' "$obj" "$(since "$before" "$after")"
  done
  exit 0
fi

cat >"$work/cuda_call.cu" <<'EOF'
#include <cstdint>
#include <xent/xent.hpp>

void step(const xent::cuda& exec, xent::matrix_view<__nv_bfloat16> logits,
          xent::vector_view<const std::int64_t> targets, float* loss) {
  xent::forward_outputs out;
  out.loss = loss;
  xent::forward_backward(exec, logits, targets, xent::options{}, xent::upstream{}, out, logits);
}
EOF
cat >"$work/static_call.cu" <<'EOF'
#include <cstdint>
#include <xent/xent.hpp>

using shape = xent::extents<32, 32000>;

void step(const xent::cuda& exec, xent::matrix_view<__nv_bfloat16, shape> logits,
          xent::vector_view<const std::int64_t, xent::extent<32>> targets, float* loss) {
  xent::forward_outputs out;
  out.loss = loss;
  xent::forward_backward(exec, logits, targets, xent::options{}, xent::upstream{}, out, logits);
}
EOF
cat >"$work/cpu_call.cpp" <<'EOF'
#include <cstdint>
#include <xent/xent.hpp>

void step(xent::matrix_view<float> logits, xent::vector_view<const std::int64_t> targets,
          float* loss) {
  xent::forward_outputs out;
  out.loss = loss;
  xent::forward_backward(xent::cpu{}, logits, targets, xent::options{}, xent::upstream{}, out,
                         logits);
}
EOF

echo "nvcc: $("$nvcc" --version | tail -n 1); $cxx: $("$cxx" --version | head -n 1)"
probes=("$@")
((${#probes[@]})) || probes=(cuda-sm90 cuda-80v90 precompiled precompiled-static cpu)
printf '%-12s %-13s %-11s %7s\n' probe step arch cpu-s
for probe in "${probes[@]}"; do
  case $probe in
    cuda-sm90) time_nvcc "$probe" "$work/cuda_call.cu" -gencode=arch=compute_90,code=sm_90 ;;
    cuda-80v90)
      time_nvcc "$probe" "$work/cuda_call.cu" -gencode=arch=compute_80,code=compute_80 \
        -gencode=arch=compute_90,code=sm_90
      ;;
    precompiled)
      time_nvcc "$probe" "$work/cuda_call.cu" -gencode=arch=compute_90,code=sm_90 \
        -DXENT_CUDA_PRECOMPILED
      ;;
    precompiled-static)
      time_nvcc "$probe" "$work/static_call.cu" -gencode=arch=compute_90,code=sm_90 \
        -DXENT_CUDA_PRECOMPILED
      ;;
    cpu)
      mark before
      "$cxx" -std=c++17 -O3 -DNDEBUG -I"$root/include" -isystem "$eigen" \
        -c "$work/cpu_call.cpp" -o "$work/cpu_call.o"
      mark after
      printf '%-12s %-13s %-11s %7s\n' cpu total "" "$(since "$before" "$after")"
      ;;
    *)
      echo "unknown probe '$probe' (cuda-sm90, cuda-80v90, precompiled, precompiled-static, cpu)" >&2
      exit 2
      ;;
  esac
done
