# Sourced by .ci/device and .ci/device-prebuilt: the fused linear benchmark's lines and their
# per-kernel profile, given the binary. Both write under $OUT and set status=1 on a failure.

# linear_lines BINARY JSON_NAME: the lines of XENT_DEVICE_LINEAR_FILTER (default all), a short
# table (time, ratios to the GEMM floor, chunk rows) on stdout and Google Benchmark's JSON.
linear_lines() {
  "$1" --benchmark_filter="${XENT_DEVICE_LINEAR_FILTER:-.}" --benchmark_out="$OUT/$2.json" \
    --benchmark_out_format=json 2>&1 |
    grep -E "^(gemm_floor|linear_)" | awk '{printf "%-62s %s %s", $1, $2, $3;
      for (i = 4; i <= NF; i++) if ($i ~ /ratio|chunk_rows/) printf " %s", $i; print ""}'
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
}

# linear_kernel_times BINARY: with XENT_DEVICE_LINEAR_NCU=<filter>, Nsight Compute's duration of
# every kernel of that line's first calls, summed per kernel name (bench/ncu_kernel_times.py).
# One metric, so one replay per kernel; the first 400 kernels: a few calls of any line.
linear_kernel_times() {
  [[ -n ${XENT_DEVICE_LINEAR_NCU:-} ]] || return 0
  echo "=== ncu: every kernel of ${XENT_DEVICE_LINEAR_NCU}'s first calls ($(date -u +%T))"
  timeout 240 ncu --clock-control none -c 400 --metrics gpu__time_duration.sum --csv \
    --print-units base "$1" --benchmark_filter="$XENT_DEVICE_LINEAR_NCU" \
    >"$OUT/ncu-linear.csv" 2>"$OUT/ncu-linear.log" || status=1
  python3 bench/ncu_kernel_times.py "$OUT/ncu-linear.csv" || status=1
}
