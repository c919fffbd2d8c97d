#!/bin/bash
# k3rs: speculative decoding on one H200 (issue 22), and the GPU suites the same session's kernel
# fixes touch (DSA top-k, KDA decode, the prefix cache's DSA case that hit them).
# Staging: build here (no CUDA needed) —
#   cargo build --release -p k3-cli --features cuda
#   cargo test --release -p k3-model --features cuda --test cuda_verify --no-run   (and k3-engine's
#   cuda_spec, cuda_prefix; k3-core's cuda_dsa, cuda_kda)
#   copy them to .dev/spec/ under their stems, strip them, and pack them:
#   tar -C .dev/spec -cJf .dev/spec.tar.xz .
# then `bash scripts/gpu/spec_run.sh [test|bench|all]` on the device with .dev/spec.tar.xz carried
# (the test executables find models/k3-nano through the path they were built in: link the
# checkout there first, e.g. `mkdir -p /work && ln -s $PWD /work/cuda-src`).
#   test:  cuda_verify (verify rows vs decode steps, rollback vs a cold prefill, mutant; a verify
#          graph's replay = the same step run eagerly, bit for bit), cuda_spec (greedy
#          speculative = plain greedy through the engine, verify graphs on and off), cuda_moe and
#          cuda_model (the MoE's path cut moved), cuda_dsa, cuda_kda (incl. the capturable prefill),
#          and cuda_prefix ${PREFIX_RUNS:-3} times (its DSA case failed 2 of 3 runs before the
#          top-k fix).
#   bench: `k3 bench --device cuda --speculative ngram,suffix` on the embedded k3-nano (workloads,
#          verify costs at batch 1 and 16), then the verify costs on the real-width 4-layer
#          k3r4mx (`scripts/gpu/lib.sh`) at batch 1 and 16 with the per-sublayer profile, and
#          its prefill of 256, 512 and 4096 tokens.
#   cut:   the MoE's crossover from the tensor-core grouped path to the per-expert cuBLAS path
#          (`K3_MOE_MMA_MAX_TOKENS`): cuda_moe, then on k3r4mx the verify costs and prefills of
#          256, 512 and 1024 tokens with the cut at 64 and at 4096, and one --profile run.
set -o pipefail
D=${K3_DIR:-.dev/spec}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export K3_REQUIRE_CUDA=1
. "$(dirname "$0")/lib.sh"
if [ ! -d "$D" ] && [ -f .dev/spec.tar.xz ]; then mkdir -p "$D" && tar -C "$D" -xJf .dev/spec.tar.xz; fi
what=${1:-all}
FAILS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t() {
  echo "=== $1 ==="
  /usr/bin/time -f "$1 %e s" "$D/$1" --test-threads=1 --nocapture 2>&1 | grep -v "^test .* ok$" || FAILS=$((FAILS + 1))
}
if [ "$what" = test ] || [ "$what" = all ]; then
  t cuda_verify
  t cuda_spec
  t cuda_moe
  t cuda_model
  t cuda_dsa
  t cuda_kda
  for i in $(seq "${PREFIX_RUNS:-3}"); do t cuda_prefix; done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "=== k3 bench --device cuda --speculative ngram,suffix (k3-nano) ==="
  $D/k3 bench --device cuda --speculative ngram,suffix --num-speculative-tokens 4 --gen-len 128 --batches 1,16 --context 256 2>&1 || FAILS=$((FAILS + 1))
  echo "=== verify step costs, k3r4mx ==="
  k3_model k3r4mx $D/k3 || exit 1
  $D/k3 bench --device cuda --speculative ngram --model /tmp/k3r4mx --batches 1,16 --context 512 --profile 2>&1 || FAILS=$((FAILS + 1))
  for p in 256 512 4096; do
    echo "=== prefill $p, k3r4mx ==="
    $D/k3 bench --device cuda --model /tmp/k3r4mx --prompt-len $p --batches 1 --context 512 2>&1 | grep "prefill" || FAILS=$((FAILS + 1))
  done
fi
if [ "$what" = cut ]; then
  t cuda_moe
  k3_model k3r4mx $D/k3 || exit 1
  for c in 64 4096; do
    echo "=== K3_MOE_MMA_MAX_TOKENS=$c: verify costs, k3r4mx ==="
    K3_MOE_MMA_MAX_TOKENS=$c $D/k3 bench --device cuda --speculative ngram --model /tmp/k3r4mx --batches 1,16 --context 512 2>&1 | grep -v "^workloads" || FAILS=$((FAILS + 1))
    for p in 256 512 1024; do
      echo "=== K3_MOE_MMA_MAX_TOKENS=$c: prefill $p, k3r4mx ==="
      K3_MOE_MMA_MAX_TOKENS=$c $D/k3 bench --device cuda --model /tmp/k3r4mx --prompt-len $p --batches 1 --context 512 2>&1 | grep "prefill" || FAILS=$((FAILS + 1))
    done
  done
  echo "=== verify profile (default cut), k3r4mx ==="
  $D/k3 bench --device cuda --speculative ngram --model /tmp/k3r4mx --batches 1 --context 512 --profile 2>&1 | grep -v "^workloads" || FAILS=$((FAILS + 1))
fi
echo "failures: $FAILS"
[ $FAILS -eq 0 ]
