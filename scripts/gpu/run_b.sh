#!/bin/bash
# session run B: decode GEMV suite + bench vs cuBLASLt, model parity, model benches, ncu per-kernel times.
D=.dev/model
export K3_REQUIRE_CUDA=1 K3_GOLDEN_DIR=$D/golden
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
(M=/tmp/k3r4bf; $D/k3 init --config k3 --num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0 --experts bf16 --out $M > $OUT/init_bf.log 2>&1) &
IB=$!
echo "=== cuda_gemv ==="; timeout 120 $D/cuda_gemv --test-threads=1 --nocapture > $OUT/gemv.log 2>&1; echo rc=$?; grep -E "^test |test result|panicked|rel L2" $OUT/gemv.log | cut -c1-140 | tail -40
echo "=== gemv-suite ==="; timeout 120 $D/cuda_bench --warmup 20 --repeats 100 gemv-suite 2>&1 | tee $OUT/gemv_bench.log | cut -c1-150
echo "=== cuda_model ==="; timeout 200 $D/cuda_model --test-threads=1 > $OUT/model.log 2>&1; echo rc=$?; grep -E "^test |test result|panicked" $OUT/model.log | cut -c1-160
wait $IB; tail -1 $OUT/init_bf.log
(M=/tmp/k3r4mx; $D/k3 init --config k3 --num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0 --experts mxfp4 --out $M > $OUT/init_mx.log 2>&1) &
IM=$!
echo "=== bench bf16 ==="; timeout 150 $D/k3 bench --device cuda --model /tmp/k3r4bf --prompt-len 4096 --batches 1,4,16,64 --context 512 --warmup 5 --repeats 30 2>&1 | tee $OUT/bench_bf.log | tail -8
echo "=== ncu bf16 B=1 ==="; timeout 150 ncu --metrics gpu__time_duration.sum --csv --clock-control none --cache-control none --log-file $OUT/ncu_bf.csv $D/k3 bench --device cuda --model /tmp/k3r4bf --prompt-len 1 --batches 1 --context 1 --warmup 0 --repeats 1 > $OUT/ncu_run.log 2>&1; echo rc=$?; tail -3 $OUT/ncu_run.log; wc -l $OUT/ncu_bf.csv; head -c 600 $OUT/ncu_bf.csv
wait $IM; tail -1 $OUT/init_mx.log
echo "=== bench mxfp4 ==="; timeout 150 $D/k3 bench --device cuda --model /tmp/k3r4mx --prompt-len 4096 --batches 1,4,16,64 --context 512 --warmup 5 --repeats 30 2>&1 | tee $OUT/bench_mx.log | tail -8
echo "=== ncu mxfp4 B=1 ==="; timeout 100 ncu --metrics gpu__time_duration.sum --csv --clock-control none --cache-control none --log-file $OUT/ncu_mx.csv $D/k3 bench --device cuda --model /tmp/k3r4mx --prompt-len 1 --batches 1 --context 1 --warmup 0 --repeats 1 > $OUT/ncu_run_mx.log 2>&1; echo rc=$?
