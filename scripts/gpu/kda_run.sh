#!/bin/bash
# KDA device run (issue 12). Stage in .dev/kda (carry .dev/kda and .whl; .dev/model/golden too
# for the model suite):
#   cuda_kda_<build>   the parity-suite executable of each build (target/release/deps/cuda_kda-*)
#   kda_bench_<build>  the timing example of each build (target/release/examples/kda_bench)
#   cuda_model_<build> optional: the model parity suite of one build
#   VARIANTS           one line per build saying what it changes
# Runs every parity suite (worst relative L2 printed), compute-sanitizer memcheck over each
# build's prefill and decode tests, every kda_bench_* in one invocation ($ROUNDS rounds, default
# 2; all output in $OUT/bench_all.log), the model suites, then fla 0.6.0 from the wheels in .whl/
# (its first call per shape autotunes, so it gets one long timeout). $MEMCHECK lists the test
# filters run under memcheck (default "prefill decode"); SKIP_FLA=1 skips fla.
D=.dev/kda
export K3_REQUIRE_CUDA=1
cat $D/VARIANTS 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(pip install --no-index --no-deps -q --target /tmp/fla .whl/*.whl > $OUT/pip.log 2>&1) &
for t in $D/cuda_kda_*; do
  v=${t##*/cuda_kda_}
  timeout 100 $t --test-threads=1 --nocapture > $OUT/parity_$v.log 2>&1; echo "parity $v rc=$?"
  grep -E "^test |test result" $OUT/parity_$v.log | grep -v " ok$" | head -12
  grep -E "H=.*lens" $OUT/parity_$v.log | awk '{print $(NF-2)}' | sort -g | tail -1 | sed "s/^/$v worst rel L2: /"
  for f in ${MEMCHECK:-prefill decode}; do
    timeout 60 compute-sanitizer --tool memcheck $t --test-threads=1 $f 2>&1 | grep -E "ERROR SUMMARY" | sed "s/^/$v $f memcheck: /"
  done
done
wait
for r in $(seq ${ROUNDS:-2}); do for b in $D/kda_bench_*; do
  echo "=== round $r: ${b##*/} ==="; timeout 40 $b > $OUT/bench.log 2>&1; cat $OUT/bench.log >> $OUT/bench_all.log
  grep -E "copy|ours (prefill|decode)" $OUT/bench.log | sed 's/ ms (.*floors:.*achieved/ ms, achieved/; s/state+io.*->//'
done; done
for t in $D/cuda_model_*; do
  [ -e "$t" ] && K3_GOLDEN_DIR=.dev/model/golden timeout 90 $t --test-threads=1 2>&1 | grep -E "^test |test result|panicked" | cut -c1-120
done
[ -n "$SKIP_FLA" ] && exit 0
PYTHONPATH=/tmp/fla timeout 180 python3 scripts/gpu/kda_fla_bench.py > $OUT/fla.log 2>&1; echo "fla rc=$?"; grep -E "fla|rel L2|Error" $OUT/fla.log | head -8
