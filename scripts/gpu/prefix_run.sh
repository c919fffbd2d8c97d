#!/bin/bash
# k3rs: the prefix cache on one H200 (issue 21).
# Staging: build here (no CUDA needed) —
#   cargo build --release -p k3-cli --features cuda
#   cargo test --release -p k3-engine --features cuda --test cuda_prefix --no-run
#   mkdir -p .dev/prefix && cp target/release/k3 .dev/prefix/ && cp <the cuda_prefix test executable> .dev/prefix/cuda_prefix && strip .dev/prefix/*
# then `bash scripts/gpu/prefix_run.sh [test|bench|all]` on the device with .dev/prefix carried
# (the test executable finds models/k3-nano through the path it was built in: link the
# checkout there first, e.g. `mkdir -p /work && ln -s $PWD /work/cuda-src`).
#   test:  crates/k3-engine/tests/cuda_prefix.rs (warm = cold against the run-to-run noise,
#          mutants caught, concurrent and served requests).
#   bench: tools/prefix_bench.py on the real-width 4-layer k3r4mx (K3 widths, 64 MXFP4
#          experts, `scripts/gpu/lib.sh`) with `k3 serve --device cuda`, cache off then on,
#          8 conversations x 8 turns behind a long shared system prompt.
set -o pipefail
D=${K3_DIR:-.dev/prefix}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export K3_REQUIRE_CUDA=1
. "$(dirname "$0")/lib.sh"
what=${1:-all}
FAILS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "$what" = test ] || [ "$what" = all ]; then
  echo "=== cuda_prefix ==="
  /usr/bin/time -f "cuda_prefix %e s" $D/cuda_prefix --test-threads=1 --nocapture 2>&1 || FAILS=$((FAILS + 1))
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "=== prefix_bench.py, k3r4mx, k3 serve --device cuda ==="
  k3_model k3r4mx $D/k3 || exit 1
  python3 tools/prefix_bench.py --k3 $D/k3 --model /tmp/k3r4mx --tokenizer models/k3-nano \
    --system-repeat ${REPEAT:-40} --turns 8 --convs 8 \
    --serve-arg=--device --serve-arg=cuda --serve-arg=--max-batch=8 \
    --serve-arg=--max-cache-tokens=131072 --serve-arg=--prefill-chunk=2048 \
    --control --json ${OUT:-/tmp}/prefix_bench.json 2>&1 || FAILS=$((FAILS + 1))
fi
echo "failures: $FAILS"
[ $FAILS -eq 0 ]
