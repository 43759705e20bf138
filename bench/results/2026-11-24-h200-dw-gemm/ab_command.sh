C="-G Ninja -DCMAKE_BUILD_TYPE=Release -DXENT_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DXENT_BUILD_EXAMPLES=OFF"
cmake -S . -B build/device $C > $OUT/c1.log 2>&1; cmake -S . -B build/dev-ex $C -DCMAKE_CUDA_FLAGS=-DXENT_CUDA_ACCUMULATE_BY_LT=0 > $OUT/c2.log 2>&1
cmake --build build/dev-ex -j6 --target xent_bench_cuda_linear > $OUT/bex.log 2>&1 & P=$!
cmake --build build/device -j10 --target xent_cuda_linear_tests xent_bench_cuda_linear > $OUT/b.log 2>&1 || grep -E 'error' $OUT/b.log | head
wait $P || grep error $OUT/bex.log | head
date; timeout 120 build/device/tests/cuda/xent_cuda_linear_tests > $OUT/lt.log 2>&1; grep -E 'PASSED|FAILED' $OUT/lt.log
F='training/16384x2304x256000/iter|forward_backward/16384x2304x256000/iter'
for r in 1 2; do for v in device dev-ex; do echo "== $v"; timeout 100 build/$v/bench/xent_bench_cuda_linear --benchmark_filter="$F" 2>&1 | grep -E '^(gemm|linear)' | cut -c1-60,100-190; done; done
for v in device dev-ex; do echo "== $v 8192"; timeout 100 build/$v/bench/xent_bench_cuda_linear --benchmark_filter='training/8192x4096x128256/iter|forward_backward/8192x4096x128256/iter' 2>&1 | grep -E '^(gemm|linear)' | cut -c1-60,100-190; done
