#!/bin/bash
# k3rs: the MoE prefill's batched mode (K3_MOE_PREFILL=batched, units of K3_MOE_PREFILL_GROUP
# MXFP4 experts in one strided-batched GEMM each) against the loop, in one device call (issue 20):
# `cuda_moe` (batched = the CPU reference; stalled = unstalled), then `k3 bench --device cuda
# --prompt-len 4096 --profile` on k3r4mx (lib.sh) alternating loop / batched 2 / batched 4, two
# rounds. Staging: k3 and the cuda_moe test executable in .dev/moe/ (stripped), packed as
# .dev/moe.tar.xz and carried.
set -o pipefail
. "$(dirname "$0")/lib.sh"
D=.dev/moe
[ -x $D/k3 ] || { mkdir -p $D && tar -C $D -xJf .dev/moe.tar.xz; }
export K3_REQUIRE_CUDA=1
FAILS=0
echo "=== cuda_moe ==="
$D/cuda_moe --test-threads=1 --nocapture 2>&1 | grep -E "batched|overlapped|test result|panicked|FAILED" || FAILS=$((FAILS + 1))
k3_model k3r4mx $D/k3 || exit 1
for r in 1 2; do
  for m in loop batched:2 batched:4; do
    mode=${m%%:*}; g=${m#*:}; [ "$g" = "$m" ] && g=2
    echo "=== round $r K3_MOE_PREFILL=$mode K3_MOE_PREFILL_GROUP=$g ==="
    K3_MOE_PREFILL=$mode K3_MOE_PREFILL_GROUP=$g timeout 120 $D/k3 bench --device cuda --model /tmp/k3r4mx --prompt-len 4096 --batches 1 --context 512 --profile 2>&1 | grep -E "^prefill|ffn.out|kda.out|mla.out" || FAILS=$((FAILS + 1))
  done
done
echo "failures: $FAILS"
[ $FAILS -eq 0 ]
