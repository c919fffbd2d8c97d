#!/bin/bash
# session run F (final): every parity suite after the clean-ups (shared KDA decode prologue, the
# pipelined attend as the only tensor-core attend, one MoE grouping helper, one AttnRes softmax,
# cuBLAS GEMM as the batch-1 strided case); benches and DSA contexts.
D=.dev/model
export K3_REQUIRE_CUDA=1 K3_GOLDEN_DIR=$D/golden
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
I="--num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0"
($D/k3 init --config k3 $I --experts bf16 --out /tmp/k3r4bf > $OUT/init.log 2>&1; $D/k3 init --config k3 $I --experts mxfp4 --out /tmp/k3r4mx >> $OUT/init.log 2>&1; $D/k3 init --config k3_1_pro $I --experts mxfp4 --out /tmp/k31r4mx >> $OUT/init.log 2>&1) &
IB=$!
for t in cuda_model cuda_kda cuda_mla cuda_moe cuda_model_ops cuda_ops; do echo "=== $t ===" >> $OUT/tests.log; timeout 200 $D/$t --test-threads=1 --nocapture >> $OUT/tests.log 2>&1; echo "$t rc=$?"; done
grep -E "test result|panicked|FAILED" $OUT/tests.log | head -20
wait $IB; grep wrote $OUT/init.log
B="--prompt-len 4096 --context 512 --warmup 3 --repeats 20 --batches 1,16,64"
echo "=== bench bf16 ==="; timeout 120 $D/k3 bench --device cuda --model /tmp/k3r4bf $B 2>&1 | tee $OUT/bench_bf.log | grep -E "copy|prefill|decode"
echo "=== bench mxfp4 ==="; timeout 120 $D/k3 bench --device cuda --model /tmp/k3r4mx $B 2>&1 | tee $OUT/bench_mx.log | grep -E "prefill|decode"
echo "=== dsa ==="; timeout 150 $D/k3 bench --device cuda --model /tmp/k31r4mx --op dsa 16384 131072 524288 --warmup 3 --repeats 20 2>&1 | tee $OUT/dsa.log | tail -4
