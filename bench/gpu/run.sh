#!/usr/bin/env bash
# xent on a CUDA machine: build for its own GPU, run the CPU and CUDA tests, compute-sanitizer,
# the benchmarks and the PyTorch-side comparison, writing everything under OUTDIR.
#
#   bash bench/gpu/run.sh OUTDIR [PART...]
#     tests     configure + build (build/gpu), ctest over the CPU and CUDA tests
#               (OUTDIR/ctest-cpu.xml, ctest-cuda.xml: JUnit)
#     sanitize  compute-sanitizer memcheck over the CUDA tests' sanitizer cases (this build), and
#               racecheck over them in a second build (build/gpu-sanitize) whose tuning makes the
#               row hand-offs full barriers (racecheck does not model bar.arrive) and turns the
#               small-batch kernel off; that build's full CUDA tests run too (the row kernel alone
#               and, built without the arch-specific "a" features, the non-wgmma paths)
#     bench     the CUDA, fused linear and CPU benchmarks (Google Benchmark JSON, repetitions and
#               their medians), the linear forward's GEMM against cuBLAS, and the vocab-parallel
#               benchmark when two or more GPUs are visible
#     compare   the PyTorch binding's tests (python/tests but jax/), its per-call overhead, the
#               fused linear errors against float64 beside torch eager's (bench/linear_accuracy.py)
#               and bench/compare.sh (xent against torch eager, torch.compile, Liger-Kernel,
#               quack, Cut Cross-Entropy)
#     jax       the xent.jax tests on this GPU and the CPU (python/tests/jax) and
#               bench/jax_cross_entropy.py against XLA's own cross-entropy (OUTDIR/jax/)
#     all       all of the above (the default)
#   OUTDIR/machine.json: GPUs, driver, nvcc, CPU, commit; a summary table is printed last.
#
# Needs: an NVIDIA driver and nvidia-smi; the CUDA toolkit (nvcc, cuBLAS, compute-sanitizer; NCCL
# for the multi-GPU tests and benchmark); CMake >= 3.25, Ninja, a C++17 compiler, Eigen 3,
# GoogleTest and Google Benchmark (on Debian / Ubuntu: bash .ci/install-deps); python3 for
# machine.json; torch for the compare part, jax with its CUDA plugin for the jax part (each says
# SKIPPED without). Nothing is downloaded.
#
# Environment:
#   XENT_CUDA_ARCH       CMAKE_CUDA_ARCHITECTURES (default: GPU 0's compute capability, e.g. 80;
#                        90a on Hopper, whose wgmma kernels need the "a" target)
#   XENT_CUDA_TUNING     tuning overrides of the main build, NAME=VALUE;... (CMake's
#                        XENT_CUDA_TUNING, see docs/tuning.md)
#   XENT_AB_TUNING       a second build (build/gpu-ab) with these overrides: its CUDA and linear
#                        benchmarks run alternately with the main build's, two rounds (an A/B;
#                        OUTDIR/table-ab-*.txt side by side)
#   XENT_BENCH_FILTER    --benchmark_filter of the CUDA and linear benchmarks (default: all)
#   XENT_BENCH_REPS      Google Benchmark repetitions (default 5)
#   XENT_NCU             a benchmark filter: Nsight Compute sections of xent_bench_cuda's row
#                        kernels on those lines (OUTDIR/ncu.txt), optional
#   XENT_LINEAR_NCU      a benchmark filter: every kernel's time in those fused linear lines,
#                        summed per kernel (OUTDIR/ncu-linear.csv), optional
#   XENT_COMMIT          the commit to record where the tree has no .git
#   JOBS                 build parallelism (default: nproc)
# NCCL's own environment (e.g. NCCL_NVLS_ENABLE) reaches the multi-GPU tests unchanged.
set -uo pipefail

if (($# < 1)) || [[ $1 == -h || $1 == --help ]]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
outdir=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
shift
parts=("$@")
((${#parts[@]})) || parts=(all)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
jobs=${JOBS:-$(nproc)}
reps=${XENT_BENCH_REPS:-5}

want() { [[ " ${parts[*]} " == *" $1 "* || " ${parts[*]} " == *" all "* ]]; }

# The summary: one row per step, with its status, seconds and where its output went.
summary=()
status=0
step_start=0
begin() {
  step_name=$1
  step_start=$SECONDS
  echo
  echo "=== $1"
}
end() {  # end RC [WHERE]
  local result=ok
  [[ $1 == 0 ]] || { result="FAILED ($1)"; status=1; }
  summary+=("$(printf '%-44s %-12s %6s s  %s' "$step_name" "$result" "$((SECONDS - step_start))" "${2:-}")")
}
skip() {  # skip WHY
  echo "SKIPPED: $1"
  summary+=("$(printf '%-44s %-12s %6s    %s' "$step_name" skipped - "$1")")
}

gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if ((gpus == 0)); then
  echo "bench/gpu/run.sh: nvidia-smi lists no GPU" >&2
  exit 1
fi

# ---------------------------------------------------------------------------------------------
# machine.json
# ---------------------------------------------------------------------------------------------
commit=${XENT_COMMIT:-$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)}
if [[ -z ${XENT_COMMIT:-} ]] && ! git -C "$root" diff --quiet HEAD 2>/dev/null; then
  commit="$commit+dirty"
fi
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' ')
arch=${XENT_CUDA_ARCH:-$([[ $cap == 9.0 ]] && echo 90a || echo "${cap/./}")}
# The sanitizer build leaves out the arch-specific features, so it runs the portable paths.
sanitize_arch=${arch%a}
XENT_OUTDIR=$outdir XENT_RECORD_COMMIT=$commit XENT_RECORD_ARCH=$arch python3 - <<'PY'
import json, os, platform, subprocess

def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None

query = "name,memory.total,driver_version,clocks.max.sm,compute_cap"
rows = run("nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader") or ""
gpus = [dict(zip(query.split(","), (f.strip() for f in r.split(",")))) for r in rows.splitlines()]
cpu = None
for line in (run("lscpu") or "").splitlines():
    if line.startswith("Model name:"):
        cpu = line.split(":", 1)[1].strip()
nvcc = run("nvcc", "--version")
cmake = run("cmake", "--version")
machine = {
    "gpus": gpus,
    "driver": gpus[0]["driver_version"] if gpus else None,
    "nvcc": nvcc.splitlines()[-1] if nvcc else None,
    "cmake": cmake.splitlines()[0] if cmake else None,
    "cpu": cpu,
    "cpu_cores": os.cpu_count(),
    "os": platform.platform(),
    "commit": os.environ["XENT_RECORD_COMMIT"],
    "cuda_architectures": os.environ["XENT_RECORD_ARCH"],
    "cuda_tuning": os.environ.get("XENT_CUDA_TUNING", ""),
    "ab_tuning": os.environ.get("XENT_AB_TUNING", ""),
}
path = os.path.join(os.environ["XENT_OUTDIR"], "machine.json")
with open(path, "w") as f:
    json.dump(machine, f, indent=2)
print(json.dumps(machine, indent=2))
PY

# configure_build DIR ARCH TUNING LOG TARGET...: a Release build with CUDA in DIR.
configure_build() {
  local dir=$1 a=$2 tuning=$3 log=$4
  shift 4
  { cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DXENT_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$a" "-DXENT_CUDA_TUNING=$tuning" -DXENT_BUILD_EXAMPLES=ON \
    "${cmake_extra[@]}" &&
    cmake --build "$dir" -j "$jobs" --target "$@"; } >"$log" 2>&1
  local rc=$?
  ((rc == 0)) || grep -E "error|Error" "$log" | head -40
  return $rc
}
cmake_extra=()
build=build/gpu

# The main build: the tests, the sanitizer's memcheck and the benchmarks all run from it; the
# benchmarks and examples only when the bench part is asked for.
if want tests || want sanitize || want bench; then
  begin "build ($arch${XENT_CUDA_TUNING:+, tuning $XENT_CUDA_TUNING})"
  # Named either way: the cache keeps an earlier call's choice (a tests-only run's OFF).
  cmake_extra=(-DXENT_BUILD_BENCHMARKS=ON -DXENT_BUILD_EXAMPLES=ON)
  want bench || cmake_extra=(-DXENT_BUILD_BENCHMARKS=OFF -DXENT_BUILD_EXAMPLES=OFF)
  configure_build "$build" "$arch" "${XENT_CUDA_TUNING:-}" "$outdir/build.log" all
  rc=$?
  cmake_extra=()
  end $rc "build.log"
  if ((rc != 0)); then
    printf '%s\n' "" "=== summary" "${summary[@]}"
    exit 1
  fi
  grep -E "^-- xent:" "$outdir/build.log"
fi

# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
if want tests; then
  # The CPU tests side by side; the CUDA test binaries one at a time, each with the GPU(s) to
  # itself. A rank that fails leaves the others waiting in their collective: every test has a
  # time limit.
  begin "tests: ctest, CPU"
  ctest --test-dir "$build" -E '^cuda[.]' -j "$jobs" --timeout 900 --output-on-failure \
    --output-junit "$outdir/ctest-cpu.xml" >"$outdir/ctest-cpu.log" 2>&1
  end $? "ctest-cpu.xml"
  tail -n 3 "$outdir/ctest-cpu.log"
  begin "tests: ctest, CUDA ($gpus GPU(s))"
  ctest --test-dir "$build" -R '^cuda[.]' -j 1 --timeout 900 --output-on-failure \
    --output-junit "$outdir/ctest-cuda.xml" >"$outdir/ctest-cuda.log" 2>&1
  end $? "ctest-cuda.xml"
  tail -n 6 "$outdir/ctest-cuda.log"
  grep -E "^\[  (FAILED|SKIPPED) " "$outdir/ctest-cuda.log" | sort | uniq | head -20
fi

# ---------------------------------------------------------------------------------------------
# sanitize
# ---------------------------------------------------------------------------------------------
# sanitizer TOOL BINARY FILTER LOG [FLAGS...]: compute-sanitizer over a test binary's cases.
sanitizer() {
  local tool=$1 bin=$2 filter=$3 log=$4
  shift 4
  [[ -x $bin ]] || { echo "$tool: $bin not built"; return 0; }
  begin "sanitize: $tool $(basename "$bin") ($filter)"
  compute-sanitizer --tool "$tool" --error-exitcode 3 "$@" "$bin" --gtest_filter="$filter" \
    >"$outdir/$log" 2>&1
  local rc=$?
  echo "clean summaries: $(grep -cE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' \
    "$outdir/$log")"
  grep -E "^========= .* in [a-z_]+\.cuh:[0-9]+" "$outdir/$log" | sort | uniq -c | head -10
  end $rc "$log"
}
if want sanitize; then
  if ! command -v compute-sanitizer >/dev/null; then
    begin "sanitize"
    skip "compute-sanitizer is not on PATH"
  else
    san=build/gpu-sanitize
    begin "sanitize: build ($sanitize_arch, SPLIT_BARRIERS=0;SMALL_REGS=0, -lineinfo)"
    cmake_extra=(-DCMAKE_CUDA_FLAGS=-lineinfo -DXENT_BUILD_BENCHMARKS=OFF -DXENT_BUILD_EXAMPLES=OFF)
    configure_build "$san" "$sanitize_arch" "SPLIT_BARRIERS=0;SMALL_REGS=0" \
      "$outdir/build-sanitize.log" xent_cuda_tests xent_cuda_linear_tests
    rc=$?
    cmake_extra=()
    end $rc "build-sanitize.log"
    if ((rc == 0)); then
      begin "sanitize: that build's CUDA tests (row kernel alone, portable paths)"
      ctest --test-dir "$san" -R '^cuda\.(backend|linear)$' --timeout 900 --output-on-failure \
        --output-junit "$outdir/ctest-sanitize-build.xml" >"$outdir/ctest-sanitize-build.log" 2>&1
      rc=$?
      tail -n 3 "$outdir/ctest-sanitize-build.log"
      end $rc "ctest-sanitize-build.xml"
    fi
    for t in xent_cuda_tests xent_cuda_linear_tests; do
      # memcheck over the main build, the Hopper GEMM's forward (ForwardWithoutArgmax) included.
      sanitizer memcheck "$build/tests/cuda/$t" '*Sanitizer*:*ForwardWithoutArgmax*' \
        "sanitizer-memcheck-$t.log"
      # racecheck leaves out the long batch: it does not follow the mbarrier hand-offs after which
      # a CTA refills a shared-memory stage it has read, and reports each refill as a hazard.
      sanitizer racecheck "$san/tests/cuda/$t" '*Sanitizer*:-*SanitizerLongBatch*' \
        "sanitizer-racecheck-$t.log"
    done
    # The Hopper GEMM's staging tile: written by one warpgroup and read by another, ordered by
    # mbarriers (only in a build with the "a" features).
    [[ $arch == *a ]] && sanitizer racecheck "$build/tests/cuda/xent_cuda_linear_tests" \
      '*ForwardWithoutArgmax*' sanitizer-racecheck-stats-gemm.log
    if ((gpus >= 2)); then
      # The vocab-parallel argument errors and one-rank NCCL groups; NCCL's own CUDA API errors
      # (its probes of peer access) are not xent's.
      sanitizer memcheck "$build/tests/cuda/xent_cuda_vocab_parallel_tests" \
        'CudaVocabParallelErrors.*:NcclVocabParallel.OneRank*' sanitizer-memcheck-vp.log \
        --report-api-errors no
      sanitizer memcheck "$build/tests/cuda/xent_cuda_vocab_parallel_linear_tests" \
        'CudaVocabParallelLinearErrors.*:NcclVocabParallelLinear.OneRank*' \
        sanitizer-memcheck-vp-linear.log --report-api-errors no
    fi
  fi
fi

# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------
# gbench NAME BINARY [ARGS...]: a Google Benchmark run into OUTDIR/NAME.json (every repetition,
# then their median, mean and spread), its table of the aggregates into NAME.txt.
gbench() {
  local name=$1 bin=$2
  shift 2
  [[ -x $bin ]] || { echo "$name: $bin not built"; return 0; }
  begin "bench: $name"
  "$bin" --benchmark_out="$outdir/$name.json" --benchmark_out_format=json \
    --benchmark_repetitions="$reps" --benchmark_display_aggregates_only=true \
    --benchmark_counters_tabular=true "$@" >"$outdir/$name.txt" 2>&1
  local rc=$?
  grep -E "_median" "$outdir/$name.txt" | cut -c1-150 | head -40
  end $rc "$name.json"
}
if want bench; then
  filter=${XENT_BENCH_FILTER:-.}
  if [[ -n ${XENT_AB_TUNING:-} ]]; then
    begin "bench: A/B build (tuning $XENT_AB_TUNING)"
    configure_build build/gpu-ab "$arch" "$XENT_AB_TUNING" "$outdir/build-ab.log" \
      xent_bench_cuda xent_bench_cuda_linear
    end $? "build-ab.log"
    # Alternating the two builds, twice, so that a drift of the GPU's clocks hits both; the
    # tables put each line's times side by side (bench/build_table.py).
    for round in 1 2; do
      for b in main ab; do
        dir=$build
        [[ $b == ab ]] && dir=build/gpu-ab
        gbench "bench_cuda-$b-$round" "$dir/bench/xent_bench_cuda" --benchmark_filter="$filter"
        gbench "bench_cuda_linear-$b-$round" "$dir/bench/xent_bench_cuda_linear" \
          --benchmark_filter="$filter"
      done
    done
    for t in bench_cuda bench_cuda_linear; do
      python3 bench/build_table.py "$outdir" "$t-main,$t-ab" >"$outdir/table-ab-$t.txt"
    done
  else
    gbench bench_cuda "$build/bench/xent_bench_cuda" --benchmark_filter="$filter"
    gbench bench_cuda_linear "$build/bench/xent_bench_cuda_linear" --benchmark_filter="$filter"
  fi
  if [[ -x $build/bench/xent_bench_lse_gemm ]]; then
    begin "bench: the linear forward's Hopper GEMM against cuBLAS"
    "$build/bench/xent_bench_lse_gemm" >"$outdir/lse_gemm.txt" 2>&1
    rc=$?
    grep '^{' "$outdir/lse_gemm.txt" >"$outdir/lse_gemm.jsonl"
    tail -n 5 "$outdir/lse_gemm.txt"
    end $rc "lse_gemm.jsonl"
  fi
  if [[ -x $build/bench/xent_bench_dw_gemm ]]; then
    begin "bench: a training chunk's GEMMs, cublasGemmEx and cuBLASLt"
    "$build/bench/xent_bench_dw_gemm" >"$outdir/dw_gemm.txt" 2>&1
    rc=$?
    grep '^{' "$outdir/dw_gemm.txt" >"$outdir/dw_gemm.jsonl"
    end $rc "dw_gemm.jsonl"
  fi
  if ((gpus >= 2)); then
    gbench bench_vocab_parallel "$build/bench/xent_bench_cuda_vocab_parallel"
  fi
  # The CPU benchmarks at this machine's core count and at 2 threads.
  gbench bench_cpu "$build/bench/xent_bench_cpu" --benchmark_min_time=0.2 \
    --benchmark_filter="threads:($jobs|2)/"
  gbench bench_cpu_linear "$build/bench/xent_bench_cpu_linear" --benchmark_min_time=0.2
  if [[ -n ${XENT_NCU:-} ]]; then
    begin "bench: Nsight Compute, xent_bench_cuda ($XENT_NCU)"
    # The benchmark's own clocks (--clock-control none), the row kernels' first two launches,
    # with the sections that say whether memory, issue or barriers bound them.
    ncu --clock-control none -c 2 -k 'regex:row_kernel|rows_kernel|forward_kernel|backward_kernel' \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
      "$build/bench/xent_bench_cuda" --benchmark_filter="$XENT_NCU" --benchmark_min_time=1x \
      >"$outdir/ncu.txt" 2>&1
    end $? "ncu.txt"
  fi
  if [[ -n ${XENT_LINEAR_NCU:-} ]]; then
    begin "bench: every kernel of the fused linear lines ($XENT_LINEAR_NCU)"
    ncu --clock-control none -c 400 --metrics gpu__time_duration.sum --csv --print-units base \
      "$build/bench/xent_bench_cuda_linear" --benchmark_filter="$XENT_LINEAR_NCU" \
      >"$outdir/ncu-linear.csv" 2>"$outdir/ncu-linear.log" &&
      python3 bench/ncu_kernel_times.py "$outdir/ncu-linear.csv"
    end $? "ncu-linear.csv"
  fi
fi

# ---------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------
if want compare; then
  begin "compare: PyTorch binding tests (CPU + CUDA)"
  if ! python3 -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    skip "torch with CUDA is not importable"
  else
    # The CUDA kernels or an error, never a silent CPU-only build of the package, built with
    # every core (run_tests.sh's default of 2 suits CI). The JAX tests are the jax part's.
    export XENT_CUDA=1 CMAKE_BUILD_PARALLEL_LEVEL=$jobs
    PYTHON=${PYTHON:-python3} bash python/run_tests.sh -rs --ignore=python/tests/jax \
      >"$outdir/torch-tests.log" 2>&1
    rc=$?
    grep -E "passed|failed|error" "$outdir/torch-tests.log" | tail -n 3
    end $rc "torch-tests.log"
    begin "compare: per-call overhead (bench/torch_overhead.py)"
    OUT="$outdir" python3 bench/torch_overhead.py >"$outdir/torch-overhead.log" 2>&1
    rc=$?
    grep '^|' "$outdir/torch-overhead.log"
    end $rc "torch-overhead.log"
    begin "compare: fused linear errors against float64 (bench/linear_accuracy.py)"
    OUT="$outdir" python3 bench/linear_accuracy.py >"$outdir/linear-accuracy.log" 2>&1
    rc=$?
    grep '^|' "$outdir/linear-accuracy.log" | tail -n 30
    end $rc "linear_accuracy.json"
    begin "compare: bench/compare.sh"
    OUT="$outdir/compare" bash bench/compare.sh >"$outdir/compare.log" 2>&1
    rc=$?
    grep -vE '^\{' "$outdir/compare.log" | tail -n 30
    end $rc "compare/"
  fi
fi

# ---------------------------------------------------------------------------------------------
# jax
# ---------------------------------------------------------------------------------------------
if want jax; then
  begin "jax: xent.jax tests (GPU + CPU)"
  if ! python3 -c "import jax; assert jax.devices('gpu')" >/dev/null 2>&1; then
    skip "jax with a GPU is not importable"
  else
    # The package's JAX handlers against the jax here (no build isolation: the registry is out of
    # reach); the build folder of an earlier install makes this incremental. JAX takes its GPU
    # memory as needed, so the tests' torch and XLA allocators do not fight over it.
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    XENT_CUDA=1 CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip install --quiet \
      --no-build-isolation --no-deps "$root/python" >"$outdir/jax-install.log" 2>&1 &&
      XENT_REQUIRE_JAX=1 python3 -m pytest -q -p no:cacheprovider -rs python/tests/jax \
        --junitxml="$outdir/jax-tests.xml" >"$outdir/jax-tests.log" 2>&1
    rc=$?
    tail -n 1 "$outdir/jax-tests.log"
    end $rc "jax-tests.xml"
    begin "jax: bench/jax_cross_entropy.py (xent.jax against XLA)"
    OUT="$outdir/jax" python3 bench/jax_cross_entropy.py --platform gpu >"$outdir/jax-bench.log" 2>&1
    rc=$?
    grep '^|' "$outdir/jax-bench.log"
    end $rc "jax/"
  fi
fi

echo
echo "=== summary ($(basename "$outdir"): commit $commit, $gpus GPU(s), arch $arch)"
printf '%s\n' "${summary[@]}"
exit $status
