#!/bin/bash
# session run C: split AttnRes, rank router, wide gathers, GEMV row threshold; parity + benches + ncu.
D=.dev/model
export K3_REQUIRE_CUDA=1 K3_GOLDEN_DIR=$D/golden
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
(M=/tmp/k3r4bf; $D/k3 init --config k3 --num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0 --experts bf16 --out $M > $OUT/init_bf.log 2>&1) &
IB=$!
for t in cuda_model_ops cuda_moe cuda_gemv; do echo "=== $t ==="; timeout 120 $D/$t --test-threads=1 > $OUT/$t.log 2>&1; echo rc=$?; grep -E "^test |test result|panicked" $OUT/$t.log | cut -c1-140; done
K3_CUDA_SYNC=1 timeout 60 $D/cuda_model_ops --test-threads=1 > $OUT/ops_sync.log 2>&1; echo "ops under K3_CUDA_SYNC rc=$?"
echo "=== cuda_model ==="; timeout 200 $D/cuda_model --test-threads=1 > $OUT/model.log 2>&1; echo rc=$?; grep -E "^test |test result|panicked" $OUT/model.log | cut -c1-160
echo "=== gemv-suite ==="; timeout 120 $D/cuda_bench --warmup 20 --repeats 100 gemv-suite 2>&1 > $OUT/gemv_bench.log; grep -oE "^(gemv|gemm)[^m]*M=[0-9]+ N=[0-9]+ K=[0-9]+ +median +[0-9.]+" $OUT/gemv_bench.log | awk '{print $1, $(NF-4), $(NF-3), $(NF-2), $NF}'
wait $IB; tail -1 $OUT/init_bf.log
(M=/tmp/k3r4mx; $D/k3 init --config k3 --num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0 --experts mxfp4 --out $M > $OUT/init_mx.log 2>&1) &
IM=$!
B="--prompt-len 4096 --context 512 --warmup 5 --repeats 30"
echo "=== bench bf16 ==="; timeout 150 $D/k3 bench --device cuda --model /tmp/k3r4bf $B --batches 1,2,4,8,16,64 2>&1 | tee $OUT/bench_bf.log | grep -E "prefill|decode"
echo "=== bench bf16, MoE mma at B=1 ==="; K3_MOE_DECODE=mma timeout 100 $D/k3 bench --device cuda --model /tmp/k3r4bf --prompt-len 64 --context 512 --batches 1 --warmup 5 --repeats 30 2>&1 | grep -E "decode"
echo "=== ncu bf16 B=1 ==="; timeout 120 ncu --metrics gpu__time_duration.sum --csv --clock-control none --cache-control none --log-file $OUT/ncu_bf.csv $D/k3 bench --device cuda --model /tmp/k3r4bf --prompt-len 1 --batches 1 --context 1 --warmup 0 --repeats 1 > /dev/null 2>&1; echo rc=$?
wait $IM; tail -1 $OUT/init_mx.log
echo "=== bench mxfp4 ==="; timeout 150 $D/k3 bench --device cuda --model /tmp/k3r4mx $B --batches 1,2,4,8,16,64 2>&1 | tee $OUT/bench_mx.log | grep -E "prefill|decode"
echo "=== bench mxfp4, MoE mma at B=1 ==="; K3_MOE_DECODE=mma timeout 100 $D/k3 bench --device cuda --model /tmp/k3r4mx --prompt-len 64 --context 512 --batches 1 --warmup 5 --repeats 30 2>&1 | grep -E "decode"
echo "=== ncu mxfp4 B=1 ==="; timeout 100 ncu --metrics gpu__time_duration.sum --csv --clock-control none --cache-control none --log-file $OUT/ncu_mx.csv $D/k3 bench --device cuda --model /tmp/k3r4mx --prompt-len 1 --batches 1 --context 1 --warmup 0 --repeats 1 > /dev/null 2>&1; echo rc=$?
