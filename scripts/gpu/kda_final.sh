#!/bin/bash
# The closing KDA device run of a session (issue 12), staged like kda_run.sh in .dev/kda:
# parity of every cuda_kda_* build, memcheck / racecheck where $CHECKS says (lines "build tool
# filter"), every kda_bench_* ($ROUNDS rounds; kda_bench_O once), the model suites, then fla
# 0.6.0 once in full and once more for decode. Everything lands in $OUT.
D=.dev/kda
export K3_REQUIRE_CUDA=1
cat $D/VARIANTS; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(pip install --no-index --no-deps -q --target /tmp/fla .whl/*.whl > $OUT/pip.log 2>&1) &
for t in $D/cuda_kda_*; do
  v=${t##*/cuda_kda_}
  timeout 100 $t --test-threads=1 --nocapture > $OUT/parity_$v.log 2>&1; echo "parity $v rc=$?"
  grep -E "test result|panicked|FAIL" $OUT/parity_$v.log | head -5
  grep -E "rel L2" $OUT/parity_$v.log | awk '{print $(NF-2)}' | sort -g | tail -1 | sed "s/^/$v worst rel L2: /"
done
echo "$CHECKS" | while read v tool f; do
  [ -z "$v" ] && continue
  timeout ${CHECK_TIMEOUT:-120} compute-sanitizer --tool $tool $D/cuda_kda_$v --test-threads=1 $f > $OUT/${tool}_${v}_$f.log 2>&1
  echo "$v $tool $f rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/${tool}_${v}_$f.log | head -2 | tr '\n' ' ')"
done
wait
for r in $(seq ${ROUNDS:-2}); do for b in $D/kda_bench_*; do
  [ "$r" -gt 1 ] && [ "${b##*_}" = O ] && continue
  echo "=== round $r: ${b##*/} ==="; timeout 40 $b > $OUT/bench.log 2>&1; cat $OUT/bench.log >> $OUT/bench_all.log
  grep -E "copy 1|ours (prefill|decode)|copy of" $OUT/bench.log | sed 's/ ms (.*floors:.*achieved/ ms, achieved/; s/eager.*us;//; s/state+io.*->//'
done; done
for t in $D/cuda_model_*; do
  echo "model ${t##*_}"; K3_GOLDEN_DIR=.dev/model/golden timeout 90 $t --test-threads=1 2>&1 | grep -E "test result|panicked|FAIL" | cut -c1-160
done
PYTHONPATH=/tmp/fla timeout 200 python3 scripts/gpu/kda_fla_bench.py > $OUT/fla.log 2>&1; echo "fla rc=$?"; grep -E "fla|Error" $OUT/fla.log | head -6
FLA_DECODE_ONLY=1 PYTHONPATH=/tmp/fla timeout 60 python3 scripts/gpu/kda_fla_bench.py 2>&1 | grep -E "fla|Error" | tee -a $OUT/fla.log
