#!/bin/bash
# KDA final device run (issue 12): parity + compute-sanitizer of the two candidates (A, B; see
# .dev/kda/VARIANTS), then all builds timed in one invocation, the model parity suite on
# candidate B, and fla 0.6.0 last. Carry: .dev/kda, .dev/model/golden, .whl.
D=.dev/kda
export K3_REQUIRE_CUDA=1
cat $D/VARIANTS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(pip install --no-index --no-deps -q --target /tmp/fla .whl/*.whl > $OUT/pip.log 2>&1) &
for v in A B; do
  timeout 100 $D/cuda_kda_$v --test-threads=1 --nocapture > $OUT/parity_$v.log 2>&1; echo "parity $v rc=$?"
  grep -E "^test |test result" $OUT/parity_$v.log | grep -v " ok$" | head -12
  grep -E "H=.*lens" $OUT/parity_$v.log | awk '{print $(NF-2)}' | sort -g | tail -1 | sed "s/^/$v worst rel L2: /"
done
timeout 60 compute-sanitizer --tool memcheck $D/cuda_kda_A --test-threads=1 decode 2>&1 | grep -E "ERROR SUMMARY|test result" | sed 's/^/A decode memcheck: /'
timeout 60 compute-sanitizer --tool memcheck $D/cuda_kda_B --test-threads=1 prefill_parity 2>&1 | grep -E "ERROR SUMMARY|test result" | sed 's/^/B prefill memcheck: /'
wait
for b in A B safe old B; do
  echo "=== $b ==="; timeout 40 $D/kda_bench_$b > $OUT/bench.log 2>&1; cat $OUT/bench.log >> $OUT/bench_all.log
  grep -E "copy|ours (prefill|decode)" $OUT/bench.log | sed 's/ ms (.*floors:.*achieved/ ms, achieved/; s/state+io.*->//'
done
K3_GOLDEN_DIR=.dev/model/golden timeout 90 $D/cuda_model_B --test-threads=1 2>&1 | grep -E "^test |test result|panicked" | cut -c1-120
PYTHONPATH=/tmp/fla timeout 180 python3 scripts/gpu/kda_fla_bench.py > $OUT/fla.log 2>&1; echo "fla rc=$?"; grep -E "fla|rel L2|Error" $OUT/fla.log | head -8
