#!/bin/bash
# session run A: merged moe2 + mla-pipe kernel suites, model parity, benches with profile, nsys.
D=.dev/model
export K3_REQUIRE_CUDA=1 K3_GOLDEN_DIR=$D/golden
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
which nsys ncu; ls /usr/local/cuda*/bin 2>/dev/null | grep -E "nsys|ncu"; ls /opt/nvidia 2>/dev/null
(M=/tmp/k3r4bf; $D/k3 init --config k3 --num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0 --experts bf16 --out $M > $OUT/init_bf.log 2>&1) &
IB=$!
echo "=== cuda_moe ==="; timeout 120 $D/cuda_moe --test-threads=1 > $OUT/moe.log 2>&1; echo rc=$?; grep -E "^test |test result|panicked" $OUT/moe.log | cut -c1-160
echo "=== cuda_mla ==="; timeout 120 $D/cuda_mla --test-threads=1 > $OUT/mla.log 2>&1; echo rc=$?; grep -E "^test |test result|panicked" $OUT/mla.log | cut -c1-160
echo "=== cuda_model ==="; timeout 200 $D/cuda_model --test-threads=1 > $OUT/model.log 2>&1; echo rc=$?; grep -E "^test |test result|panicked" $OUT/model.log | cut -c1-160
wait $IB; tail -1 $OUT/init_bf.log
(M=/tmp/k3r4mx; $D/k3 init --config k3 --num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0 --experts mxfp4 --out $M > $OUT/init_mx.log 2>&1) &
IM=$!
echo "=== bench bf16 ==="; timeout 150 $D/k3 bench --device cuda --model /tmp/k3r4bf --prompt-len 4096 --batches 1,16,64 --context 512 --warmup 5 --repeats 30 --profile 2>&1 | tee $OUT/bench_bf.log | tail -60
NS=$(which nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [ -n "$NS" ]; then echo "=== nsys bf16 B=1 ==="; timeout 120 $NS profile --cuda-graph-trace=node -o $OUT/bf1 -f true $D/k3 bench --device cuda --model /tmp/k3r4bf --prompt-len 64 --batches 1 --context 512 --warmup 2 --repeats 5 > $OUT/nsys_run.log 2>&1; timeout 60 $NS stats --report cuda_gpu_kern_sum,cuda_gpu_trace --format csv -o $OUT/bf1 $OUT/bf1.nsys-rep > /dev/null 2>&1; ls $OUT; rm -f $OUT/bf1.sqlite $OUT/bf1.nsys-rep; fi
wait $IM; tail -1 $OUT/init_mx.log
echo "=== bench mxfp4 ==="; timeout 150 $D/k3 bench --device cuda --model /tmp/k3r4mx --prompt-len 4096 --batches 1,16,64 --context 512 --warmup 5 --repeats 30 --profile 2>&1 | tee $OUT/bench_mx.log | tail -60
