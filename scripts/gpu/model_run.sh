#!/bin/bash
# k3rs: the GPU model on the device machine: parity suites, k3-nano, benches of the model recipes
# of scripts/gpu/lib.sh (k3r4bf, k3r4mx, k31r4mx, k3r4par; made in /tmp once, then reused),
# Nsight traces, and an A/B of two builds.
# Staging (docs/gpu.md), carried with the run tool as .dev/model/: `k3` (stripped release
# binary), the stripped release test executables the suites name (cuda_model_ops, cuda_model,
# cuda_kda, cuda_mla, cuda_moe, cuda_gemv, cuda_ops), the example `cuda_bench` for `gemv`, and
# golden/ (the three model fixtures + manifest.json) for the model suites.
# Usage: bash scripts/gpu/model_run.sh SUITE [ARGS]; logs in $OUT (or /tmp).
#   parity                      cuda_model_ops (K3_CUDA_SYNC=1) and cuda_model
#   nano                        k3 run on k3-nano, GPU then CPU (the same greedy text)
#   nano-logits                 k3-nano, 96 tokens: GPU f32 (full and decode), bf16, and bf16 with FP8
#                               caches (full and decode) logits vs CPU
#   kernel-cache                k3 run on k3-nano twice in fresh processes with K3_KERNEL_CACHE:
#                               the first compiles with NVRTC and stores the cubins, the second reads them
#   tests SUITE...              the staged test executables one after another (--nocapture, all
#                               output in $OUT/tests.log), then their test lines
#   gemv                        cuda_bench gemv-suite (k3rs's GEMV against cuBLASLt)
#   bench [RECIPE [BATCHES [K3-BENCH-FLAGS...]]]
#                               k3 bench --device cuda; default k3r4mx, batches 1,16,64, flags
#                               $BENCH (default "--prompt-len 4096 --context 512 --warmup 5 --repeats 30")
#                               plus the extra ones (e.g. --profile); K3_MOE_DECODE etc. pass through
#   bench-bf16                  bench k3r4bf
#   dsa [RECIPE]                DSA decode at contexts 16384, 131072, 524288 (default k31r4mx)
#   ncu RECIPE                  per-kernel GPU times of one batch-1 step (ncu gpu__time_duration.sum,
#                               CSV in $OUT/ncu_RECIPE.csv, summed per kernel name by ncu_sum.py);
#                               NCU_PROMPT=4096 also covers the bench's four prefills of that length
#   nsys RECIPE                 an nsys trace of a short batch-1 bench (kernel summary and trace CSVs in $OUT);
#                               NSYS_PROMPT=4096 traces prefills of that length instead of 64 tokens
#   ab RECIPE OLD NEW [ROUNDS]  prefill T=4096 and decode B=1 of two staged binaries .dev/model/OLD and
#                               .dev/model/NEW, alternated for ROUNDS rounds (default 2), on one machine
set -o pipefail
D=.dev/model
L=${OUT:-/tmp}
. "$(dirname "$0")/lib.sh"
export K3_REQUIRE_CUDA=1 K3_GOLDEN_DIR=$D/golden
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
suite=${1:-parity}
shift
# one_step RECIPE: the `k3 bench` arguments of a single batch-1 step (for the profilers).
one_step() { echo "bench --device cuda --model /tmp/$1 --prompt-len ${NCU_PROMPT:-1} --batches 1 --context 1 --warmup 0 --repeats 1"; }
case $suite in
parity)
  echo "=== cuda_model_ops ==="; K3_CUDA_SYNC=1 timeout 120 $D/cuda_model_ops --test-threads=1 2>&1 | grep -vE "^\s*$" | tail -25
  echo "=== cuda_model ==="; timeout 300 $D/cuda_model --test-threads=1 2>&1 | grep -vE "^\s*$" | tail -60 ;;
nano)
  echo "=== k3 run on k3-nano, GPU ==="; timeout 60 $D/k3 run --model models/k3-nano --device cuda --temperature 0 -n 48 "ROMEO." 2>&1 | tail -5
  echo "=== k3 run on k3-nano, CPU ==="; timeout 60 $D/k3 run --model models/k3-nano --temperature 0 -n 48 "ROMEO." 2>&1 | tail -5 ;;
nano-logits)
  N=models/k3-nano; IDS=$(python3 -c "print(','.join(str((i*7919+13)%1024) for i in range(96)))")
  $D/k3 logits --model $N --ids $IDS --out $L/cpu.npy 2>&1 | tail -1
  $D/k3 logits --model $N --ids $IDS --out $L/g32.npy --device cuda --precision f32 2>&1 | tail -1
  $D/k3 logits --model $N --ids $IDS --out $L/g32d.npy --device cuda --precision f32 --mode decode 2>&1 | tail -1
  $D/k3 logits --model $N --ids $IDS --out $L/gbf.npy --device cuda 2>&1 | tail -1
  $D/k3 logits --model $N --ids $IDS --out $L/gfp8.npy --device cuda --kv-cache-dtype fp8 2>&1 | tail -1
  $D/k3 logits --model $N --ids $IDS --out $L/gfp8d.npy --device cuda --kv-cache-dtype fp8 --mode decode 2>&1 | tail -1
  python3 - "$L" <<'PY'
import sys
import numpy as np
d = sys.argv[1]
c = np.load(f'{d}/cpu.npy').astype(np.float64)
for n in ['g32', 'g32d', 'gbf', 'gfp8', 'gfp8d']:
    g = np.load(f'{d}/{n}.npy').astype(np.float64)
    rel = np.sqrt(((g - c)**2).sum(1) / (c**2).sum(1))
    print(f"k3-nano 96 tokens, {n} vs CPU: max abs {np.abs(g-c).max():.3e}, per-position rel L2 max {rel.max():.3e} median {np.median(rel):.3e}, top-1 {(g.argmax(1)==c.argmax(1)).mean():.3f}")
PY
  ;;
kernel-cache)
  export K3_KERNEL_CACHE=/tmp/k3-kernel-cache
  for i in 1 2; do
    /usr/bin/time -f "run $i: %e s wall" $D/k3 run --model models/k3-nano --device cuda --temperature 0 -n 48 "ROMEO." 2>&1 | tail -2
  done
  ls $K3_KERNEL_CACHE | head -20; du -sh $K3_KERNEL_CACHE ;;
tests)
  [ $# -gt 0 ] || set -- cuda_model cuda_kda cuda_mla cuda_moe cuda_model_ops cuda_ops
  : > $L/tests.log
  for t in "$@"; do
    echo "=== $t ===" >> $L/tests.log
    timeout ${TIMEOUT:-200} $D/$t --test-threads=1 --nocapture >> $L/tests.log 2>&1; echo "$t rc=$?"
  done
  grep -E "^=== |^test |test result|panicked|FAILED" $L/tests.log | cut -c1-200 ;;
gemv)
  timeout 120 $D/cuda_bench --warmup 20 --repeats 100 gemv-suite 2>&1 | tee $L/gemv_bench.log | cut -c1-150 ;;
bench | bench-bf16)
  if [ $suite = bench-bf16 ]; then R=k3r4bf TAIL=${TAIL:-8}; else R=${1:-k3r4mx}; shift; fi
  BATCHES=${1:-1,16,64}; shift
  k3_model $R $D/k3 || exit 1
  # shellcheck disable=SC2086 # $BENCH is a word list
  timeout ${TIMEOUT:-300} $D/k3 bench --device cuda --model /tmp/$R ${BENCH:---prompt-len 4096 --context 512 --warmup 5 --repeats 30} --batches $BATCHES "$@" 2>&1 | tee $L/bench_$R.log | tail -${TAIL:-12} ;;
dsa)
  R=${1:-k31r4mx}
  k3_model $R $D/k3 || exit 1
  timeout 300 $D/k3 bench --device cuda --model /tmp/$R --op dsa 16384 131072 524288 --warmup 5 --repeats 30 2>&1 | tee $L/dsa.log | tail -8 ;;
ncu)
  R=${1:?ncu RECIPE}
  k3_model $R $D/k3 || exit 1
  # shellcheck disable=SC2046
  timeout 150 ncu --metrics gpu__time_duration.sum --csv --clock-control none --cache-control none --log-file $L/ncu_$R.csv $D/k3 $(one_step $R) > $L/ncu_run_$R.log 2>&1
  echo "ncu rc=$?"; tail -3 $L/ncu_run_$R.log; wc -l $L/ncu_$R.csv
  python3 "$(dirname "$0")/ncu_sum.py" $L/ncu_$R.csv | head -${NCU_TOP:-30} ;;
nsys)
  R=${1:?nsys RECIPE}
  k3_model $R $D/k3 || exit 1
  NS=$(which nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2> /dev/null | head -1)
  [ -n "$NS" ] || { echo "no nsys on this machine"; exit 1; }
  timeout 120 $NS profile --cuda-graph-trace=node -o $L/$R -f true $D/k3 bench --device cuda --model /tmp/$R --prompt-len ${NSYS_PROMPT:-64} --batches 1 --context 512 --warmup 2 --repeats 5 > $L/nsys_run_$R.log 2>&1
  echo "nsys rc=$?"
  timeout 60 $NS stats --report cuda_gpu_kern_sum,cuda_gpu_trace --format csv -o $L/$R $L/$R.nsys-rep > /dev/null 2>&1
  rm -f $L/$R.sqlite $L/$R.nsys-rep; ls $L | grep "^$R" ;;
ab)
  R=${1:?ab RECIPE OLD NEW}; OLD=${2:?ab RECIPE OLD NEW}; NEW=${3:?ab RECIPE OLD NEW}
  k3_model $R $D/k3 || exit 1
  for r in $(seq ${4:-2}); do
    for b in $OLD $NEW; do
      echo "== $b round $r"
      timeout 100 $D/$b bench --device cuda --model /tmp/$R --prompt-len 4096 --context 512 --warmup 3 --repeats 10 --batches 1 2>&1 | grep -E "prefill|decode"
    done
  done ;;
*)
  echo "unknown suite '$suite' (see the header of $0)" >&2
  exit 2 ;;
esac
