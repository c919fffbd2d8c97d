#!/bin/bash
# KDA device run (issue 12): parity suite, compute-sanitizer over the prefill cases, then the
# timings of the baseline build (kda_bench_old, the commit named in $D/BASE) and of this build
# in the same invocation, twice each, with fla 0.6.0 (wheels carried in .whl/) in between.
# Staged: .dev/kda/{cuda_kda, kda_bench, kda_bench_old, BASE}; carry .dev/kda and .whl.
D=.dev/kda
export K3_REQUIRE_CUDA=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
echo "base: $(cat $D/BASE)"
(pip install --no-index --no-deps -q --target /tmp/fla .whl/*.whl > $OUT/pip.log 2>&1) &
timeout 200 $D/cuda_kda --test-threads=1 --nocapture > $OUT/parity.log 2>&1; echo "parity rc=$?"
grep -E "test result|panicked|FAILED" $OUT/parity.log | head
grep -E "H=.*lens" $OUT/parity.log | awk '{print $(NF-2)}' | sort -g | tail -1 | sed 's/^/worst rel L2: /'
timeout 120 compute-sanitizer --tool memcheck $D/cuda_kda --test-threads=1 prefill_parity 2>&1 | grep -E "ERROR SUMMARY|test result" | head -3
wait
for r in 1 2; do
  echo "=== round $r: base ==="; timeout 60 $D/kda_bench_old 2>&1 | grep -E "copy|ours"
  echo "=== round $r: new ==="; timeout 60 $D/kda_bench 2>&1 | grep -E "copy|ours"
  echo "=== round $r: fla ==="; PYTHONPATH=/tmp/fla timeout 120 python3 scripts/gpu/kda_fla_bench.py 2>&1 | grep -E "fla|rel L2|Error" | head -8
done
