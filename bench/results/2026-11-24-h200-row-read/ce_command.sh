C="-G Ninja -DCMAKE_BUILD_TYPE=Release -DXENT_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DXENT_BUILD_EXAMPLES=OFF"
cmake -S . -B build/device $C > $OUT/c.log 2>&1
cmake --build build/device -j16 --target xent_bench_cuda xent_bench_row_read_probe > $OUT/b.log 2>&1 || { grep -E 'error' $OUT/b.log | head; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
timeout 300 build/device/bench/xent_bench_cuda --benchmark_filter='BM_copy_roof|BM_cross_entropy<.*>/(8192/32000|16384/128256|4096/262144|8192/128256|32/32000|128/32000|32/50257)/' --benchmark_out=$OUT/ce.json --benchmark_out_format=json > $OUT/ce.txt 2>&1
grep -E '^BM_' $OUT/ce.txt | sed -E 's/manual_time//; s/bytes_per_second=[^ ]+ //; s/items_per_second=[^ ]+ //' | awk '{$3=$4=$5=$6=""; print}' | cut -c1-170
