#!/bin/bash
# k3rs: the NCCL communicator on the GPU machine — the cuda_comm suite (world 1 + graph capture,
# 2/4/8 ranks on one GPU with one NCCL_HOSTID each, killed and hung ranks) and comm_bench.
# Staging: build here, no CUDA needed —
#   cargo test -p k3-core --features cuda --test cuda_comm --no-run
#   cargo build --release -p k3-core --features cuda --example comm_bench
#   mkdir -p .dev/comm && cp target/debug/deps/cuda_comm-<hash> .dev/comm/cuda_comm \
#     && cp target/release/examples/comm_bench .dev/comm/ && strip .dev/comm/*
# then run `bash scripts/gpu/comm_run.sh [test|bench|all]` there with .dev carried. Logs go to
# $OUT (or /tmp). No LD_LIBRARY_PATH is set: the loader finds libnccl.so.2 by itself.
set -o pipefail
D=.dev/comm
L=${OUT:-/tmp}
# Never NVLink multicast (kept off as the machines' own environment does); one GPU anyway.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Every rank gives up after 60 s instead of 180 (the fault tests set their own, shorter).
export K3_REQUIRE_CUDA=1 K3_NCCL_TIMEOUT_S=60
nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
ldconfig -p | grep -i nccl | head -3
case "${1:-all}" in
test | all)
  echo "=== cuda_comm (NCCL_DEBUG=WARN) ==="
  NCCL_DEBUG=WARN timeout 300 $D/cuda_comm --test-threads=1 --nocapture > $L/cuda_comm.log 2>&1
  echo "cuda_comm rc=$?"
  grep -vE '^\s*$' $L/cuda_comm.log | tail -50 ;;&
bench | all)
  echo "=== comm_bench ==="
  timeout 200 $D/comm_bench > $L/comm_bench.log 2>&1
  echo "comm_bench rc=$?"
  cat $L/comm_bench.log
  echo "=== transport check: NCCL_DEBUG=INFO, 2 ranks, 1 KB ==="
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET K3_COMM_BENCH_LOGS=1 timeout 40 $D/comm_bench --ranks 2 --sizes 1K --budget-ms 50 > $L/transport.log 2>&1
  grep -E 'NCCL version|NET/|via|Using network|all_reduce' $L/transport.log | head -12 ;;
esac
