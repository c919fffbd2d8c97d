#!/bin/bash
# k3rs: the GPU checks that gate what is built but off by default or not yet run on a GPU, in one
# device call (issues 20–22): the rollback graphs (K3_ROLLBACK_GRAPHS=1), the prefix cache on
# multi-process GPU layouts (K3_DIST_PREFIX), the device sampler's logit_bias and the GPU
# runner's prompt logprobs (echo).
# Staging: build here (no CUDA needed) —
#   cargo build --release -p k3-cli --features cuda
#   cargo test --release --features cuda -p k3-engine --test cuda_sample --test cuda_spec --test cuda_prompt_logprobs --no-run
#   cargo test --release --features cuda -p k3-model --test cuda_verify --no-run
#   cargo test --release --features cuda -p k3-core --test cuda_ops --test cuda_kda --no-run
#   copy k3 and the test executables to .dev/pend/ under their stems, strip them, and pack them:
#   tar -C .dev/pend -cJf .dev/pend.tar.xz .
# then `bash scripts/gpu/pending_run.sh [test|bench|dist|all]` on the device with .dev/pend.tar.xz
# carried (the test executables find models/k3-nano through the path they were built in: link the
# checkout there first, e.g. `mkdir -p /work && ln -s $PWD /work/main`).
#   test:  cuda_sample (greedy, masked, penalised and logit-biased rows = the host sampler),
#          cuda_prompt_logprobs (echo's prompt logprobs on the GPU runner = the CPU engine's),
#          cuda_ops scatter_rows, cuda_kda (prefill within caps), cuda_verify (the rollback graph
#          = the eager rollback; a replay without one refused) and cuda_spec (which compares
#          rollback graphs on and off itself).
#   bench: `k3 bench --device cuda --speculative ngram,suffix` on k3-nano with rollback graphs
#          off, on, off, on (the rollback's time is printed both ways in each run).
#   dist:  `parallel_serve.sh prefix` (k3 serve --tp 2 as two processes on the one GPU, the prefix
#          cache on: each warm answer = the cold one).
# All passed on an H100 on 2026-12-06 (docs/gpu-runs/2026-12-06/): K3_ROLLBACK_GRAPHS and
# K3_DIST_PREFIX default to on since (=0 turns either off).
set -o pipefail
D=${K3_DIR:-.dev/pend}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export K3_REQUIRE_CUDA=1
if [ ! -d "$D" ] && [ -f .dev/pend.tar.xz ]; then mkdir -p "$D" && tar -C "$D" -xJf .dev/pend.tar.xz; fi
what=${1:-all}
FAILS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t() {
  local name=$1
  shift
  echo "=== $name $* ==="
  /usr/bin/time -f "$name %e s" "$D/$name" --test-threads=1 --nocapture "$@" 2>&1 | grep -v "^test .* ok$" || FAILS=$((FAILS + 1))
}
if [ "$what" = test ] || [ "$what" = all ]; then
  t cuda_sample
  t cuda_prompt_logprobs
  t cuda_ops scatter_rows
  t cuda_kda within
  t cuda_verify
  t cuda_spec # sets rollback graphs on and off itself
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for g in 0 1 0 1; do
    echo "=== K3_ROLLBACK_GRAPHS=$g k3 bench --device cuda --speculative ngram,suffix (k3-nano) ==="
    K3_ROLLBACK_GRAPHS=$g "$D/k3" bench --device cuda --speculative ngram,suffix --num-speculative-tokens 4 --gen-len 128 --batches 1,16 --context 256 2>&1 || FAILS=$((FAILS + 1))
  done
fi
if [ "$what" = dist ] || [ "$what" = all ]; then
  K3_DIR=$D bash "$(dirname "$0")/parallel_serve.sh" prefix || FAILS=$((FAILS + 1))
fi
echo "failures: $FAILS"
[ $FAILS -eq 0 ]
