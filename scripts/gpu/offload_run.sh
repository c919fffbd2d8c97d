#!/bin/bash
# k3rs: routed experts off the GPU on one H200 host (issue 23).
# Staging: build here (no CUDA needed) —
#   cargo build --release -p k3-cli --features cuda
#   cargo test --release -p k3-model --features cuda --test cuda_offload --no-run
#   mkdir -p .dev/offload && cp target/release/k3 .dev/offload/ && cp <the cuda_offload test executable> .dev/offload/cuda_offload && strip .dev/offload/*
# then `bash scripts/gpu/offload_run.sh [test|bench|all]` on the device with .dev/offload carried
# (the test executable finds models/k3-nano through the path it was built in: link the checkout
# there first, e.g. `mkdir -p /work && ln -s $PWD /work/main`).
#   test:  crates/k3-model/tests/cuda_offload.rs (host and disk tiers vs the GPU's experts on a
#          random MXFP4 model; k3-nano's greedy tokens; decode graphs refused).
#   bench: on k3r2x896 (2 real-width layers, both MoE with 896 MXFP4 experts, lib.sh):
#          `k3 bench --op experts` (the CPU tiers alone: host memory and disk, each beside its
#          floor measured in the same process) and `k3 bench --device cuda --offload gpu,cpu,disk`
#          (parity against the GPU's experts, eager decode steps beside the serial and overlapped
#          floors, the expert cache's reads and hit rate).
set -o pipefail
D=${K3_DIR:-.dev/offload}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export K3_REQUIRE_CUDA=1
. "$(dirname "$0")/lib.sh"
what=${1:-all}
FAILS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc; grep -E "MemTotal|MemAvailable" /proc/meminfo; lscpu | grep -E "Model name|Flags" | cut -c1-200; df -h /tmp
if [ "$what" = test ] || [ "$what" = all ]; then
  echo "=== cuda_offload ==="
  /usr/bin/time -f "cuda_offload %e s" $D/cuda_offload --test-threads=1 --nocapture 2>&1 || FAILS=$((FAILS + 1))
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  k3_model k3r2x896 $D/k3 || exit 1
  echo "=== k3 bench --op experts (CPU tiers) ==="
  $D/k3 bench --op experts 1 4 16 --model /tmp/k3r2x896 2>&1 || FAILS=$((FAILS + 1))
  # The host tier's thread scaling (2026-12-05: 2.9 GB/s per thread with 16 threads against
  # 10.4 GB/s with 1 on the 2-core machine): batch 1 at 1, 2, 4, 8, 16 threads, with the machine's
  # core and thread layout.
  lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))"
  for th in 1 2 4 8 16; do
    echo "--- --threads $th"
    $D/k3 bench --op experts 1 --threads $th --model /tmp/k3r2x896 2>&1 | grep -E "^ +1 " || FAILS=$((FAILS + 1))
  done
  echo "=== k3 bench --device cuda --offload gpu,cpu,disk ==="
  $D/k3 bench --device cuda --model /tmp/k3r2x896 --offload gpu,cpu,disk --batches 1,4 --context 256 \
    --expert-cache-mem ${CACHE:-8GiB} 2>&1 || FAILS=$((FAILS + 1))
fi
echo "failures: $FAILS"
[ $FAILS -eq 0 ]
