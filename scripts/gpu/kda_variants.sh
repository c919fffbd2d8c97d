#!/bin/bash
# KDA variants in one invocation: parity of the main build, then each staged kda_bench* binary
# twice (the file .dev/kda/VARIANTS says what each one changes), fla once warm.
D=.dev/kda
export K3_REQUIRE_CUDA=1
cat $D/VARIANTS
(pip install --no-index --no-deps -q --target /tmp/fla .whl/*.whl > $OUT/pip.log 2>&1) &
timeout 200 $D/cuda_kda --test-threads=1 --nocapture > $OUT/parity.log 2>&1; echo "parity rc=$?"
grep -E "test result|panicked|FAILED" $OUT/parity.log | head
grep -E "H=.*lens" $OUT/parity.log | awk '{print $(NF-2)}' | sort -g | tail -1 | sed 's/^/worst rel L2: /'
timeout 120 compute-sanitizer --tool memcheck $D/cuda_kda --test-threads=1 prefill_parity 2>&1 | grep -E "ERROR SUMMARY" | head -3
wait
for r in 1 2; do for b in $D/kda_bench*; do
  [ $r = 2 ] && [ $b = $D/kda_bench_prev ] && continue
  echo "=== round $r: $b ==="; timeout 60 $b > $OUT/bench.log 2>&1; cat $OUT/bench.log >> $OUT/bench_all.log
  grep -E "ours (prefill|decode)" $OUT/bench.log | sed 's/, floors.*//; s/state+io.*->//'
done; done
grep -E "copy|floors" $OUT/bench_all.log | tail -3
PYTHONPATH=/tmp/fla timeout 200 python3 scripts/gpu/kda_fla_bench.py > /dev/null 2>&1
PYTHONPATH=/tmp/fla timeout 120 python3 scripts/gpu/kda_fla_bench.py 2>&1 | grep -E "fla|Error" | head -8
