#!/bin/bash
# k3rs issue 10 device run 2: parity suite, our bench and PyTorch's, alternating GEMM rounds.
# Staging (see docs/gpu.md): copy this script, torch_ref.py, the cuda_ops test executable
# (target/release/deps/cuda_ops-*) as `cuda_ops` and target/release/examples/cuda_bench into
# one folder on the GPU machine; set OUT to a folder for the logs; run `bash device_run.sh`.
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,power.limit --format=csv,noheader
echo "=== parity (K3_REQUIRE_CUDA=1 K3_CUDA_SYNC=1) ==="
K3_REQUIRE_CUDA=1 K3_CUDA_SYNC=1 timeout 240 ./cuda_ops --test-threads=1 > $OUT/parity.log 2>&1; echo "parity rc=$?"
grep -E "^test |test result|panicked" $OUT/parity.log | cut -c1-150 | head -30
nvidia-smi dmon -s pc -o T > $OUT/dmon.log 2>&1 & DM=$!
W="--warmup 100 --repeats 200"
echo "=== ours, full suite ($W) ==="
timeout 150 ./cuda_bench $W > $OUT/bench.log 2>&1; echo "bench rc=$?"; tail -n +3 $OUT/bench.log
echo "=== torch, full ==="
PYTHONUNBUFFERED=1 timeout 150 python3 torch_ref.py $W > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.log
for r in 2 3; do
 echo "=== round $r: ours gemm-suite, torch gemm ==="
 timeout 60 ./cuda_bench $W gemm-suite 2>&1 | tail -n +3 | tee -a $OUT/rounds.log
 PYTHONUNBUFFERED=1 timeout 90 python3 torch_ref.py $W --gemm-only 2>&1 | tail -n +2 | tee -a $OUT/rounds.log
done
kill $DM
