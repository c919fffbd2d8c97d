#!/bin/bash
# k3rs: one device call that runs the GPU checks and figures the CPU-only sessions left behind:
# issue 23's offload suite and bench (scripts/gpu/offload_run.sh: `offload`), any staged test
# executable (`cuda_NAME`: e.g. issue 22's cuda_spec with its plain control), issue 20's T = 4096
# prefill with its per-kind profile (`prefill`), and Moonshot's official code beside it (`hf`).
# k3r2x896 (offload, 34.5 GB) and k3r4bf + k3r4mx (prefill) do not fit the 64 GB disk together:
# give them separate calls.
# Staging (build here, no CUDA needed):
#   cargo build --release -p k3-cli --features cuda
#   cargo test --release --features cuda -p k3-model --test cuda_offload --no-run
#   cargo test --release --features cuda -p k3-engine --test cuda_spec --no-run   (and any other
#   cuda_* suite a run names)
#   copy k3 and the test executables (under their stems) to .dev/s42/, strip them, and pack them:
#   tar -C .dev/s42 -cJf .dev/s42.tar.xz .
# then `bash scripts/gpu/validate_run.sh [offload] [cuda_NAME...] [prefill] [vision] [hf]` on the
# device with .dev/s42.tar.xz carried (and .whl for `hf`). Logs go to $OUT.
set -o pipefail
export K3_DIR=${K3_DIR:-.dev/s42}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export K3_REQUIRE_CUDA=1
L=${OUT:-/tmp}
HERE=$(dirname "$0")
. "$HERE/lib.sh"
if [ ! -d "$K3_DIR" ] && [ -f "$K3_DIR.tar.xz" ]; then mkdir -p "$K3_DIR" && tar -C "$K3_DIR" -xJf "$K3_DIR.tar.xz"; fi
# The test executables find models/k3-nano through the path they were built in.
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
FAILS=0
for what in "${@:-offload cuda_spec}"; do
  for w in $what; do
    case $w in
    offload)
      timeout 420 bash "$HERE/offload_run.sh" all 2>&1 | tee "$L/offload.log" | grep -v "^test .* ok$" || FAILS=$((FAILS + 1)) ;;
    cuda_*)
      # A staged test executable (cuda_moe, cuda_kda, cuda_offload, ...); TESTS_cuda_x=FILTER
      # runs only the tests whose names contain FILTER.
      f=TESTS_$w
      echo "=== $w ${!f} ==="
      timeout 240 /usr/bin/time -f "$w %e s" "$K3_DIR/$w" ${!f} --test-threads=1 --nocapture 2>&1 | tee "$L/$w.log" | grep -v "^test .* ok$" | grep -v "^$" || FAILS=$((FAILS + 1)) ;;
    prefill)
      # Issue 20's prefill T = 4096 on each recipe (k3r4bf, k3r4mx), with the per-kind profile,
      # the MoE prefill path in each of PREFILL_MODES (K3_MOE_PREFILL: loop = MXFP4 dequant
      # overlapped on a side stream, loop-serial, grouped; A/B in one call), and
      # with NCU=1 one prefill's kernels timed by Nsight Compute and summed by name.
      for R in ${RECIPES:-k3r4bf k3r4mx}; do
        k3_model $R "$K3_DIR/k3" || exit 1
        for M in ${PREFILL_MODES:-loop grouped}; do
          echo "=== prefill $R K3_MOE_PREFILL=$M ==="
          K3_MOE_PREFILL=$M timeout 120 "$K3_DIR/k3" bench --device cuda --model /tmp/$R --prompt-len 4096 --batches 1 --context 512 --profile 2>&1 | grep -v "^  blk\." | tee "$L/profile_${R}_$M.log" || FAILS=$((FAILS + 1))
        done
        if [ "${NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
          # One prefill's kernels (the first NCU_COUNT launches), GPU time summed by kernel name.
          timeout 240 ncu --metrics gpu__time_duration.sum --csv -c ${NCU_COUNT:-2600} "$K3_DIR/k3" bench --device cuda --model /tmp/$R --prompt-len 4096 --batches 1 --context 512 > /tmp/ncu_$R.csv 2> /dev/null
          python3 "$HERE/ncu_sum.py" /tmp/ncu_$R.csv 2>&1 | tee "$L/ncu_$R.txt" | head -30
        fi
      done ;;
    vision)
      # Issue 24: the GPU tower's images/s at real widths (27 layers, 1024x1024, batch 1 and 8)
      # beside its arithmetic floor, and a 32-frame 448x448 clip end to end (the bench_tower
      # example, staged as $K3_DIR/bench_tower).
      for B in 8 1; do
        V=""; [ $B = 1 ] && V="--video-frames 32"
        echo "=== bench_tower --cuda --layers 27 --batch $B $V ==="
        timeout 200 "$K3_DIR/bench_tower" --cuda --layers 27 --batch $B --iters 5 $V 2>&1 | tee "$L/bench_tower_b$B.log" | tail -9 || FAILS=$((FAILS + 1))
      done ;;
    hf)
      # Moonshot's official code (../shared/tools/bench_hf.py, carried in .whl/k3hf with the two
      # vendored files and k3-configs.json; fla 0.6.0 wheels in .whl): prefill T = 4096 only.
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || { FAILS=$((FAILS + 1)); continue; }
      echo "=== bench_hf.py (official code), prefill ==="
      (cd .whl/k3hf && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 240 python3 bench_hf.py --k3-hf-dir . --spec k3-configs.json --out "$L" --skip decode,graph,moe896,profile 2>&1 | tee "$L/hf.log" | grep -v "^ *$" | tail -25) || FAILS=$((FAILS + 1)) ;;
    *) echo "unknown part '$w' (offload, cuda_NAME, prefill, vision, hf)" >&2; FAILS=$((FAILS + 1)) ;;
    esac
  done
done
echo "validate_run failures: $FAILS"
[ $FAILS -eq 0 ]
