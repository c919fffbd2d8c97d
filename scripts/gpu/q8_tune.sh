#!/bin/bash
# k3rs: tuning the CPU experts' MXFP4 × int8 kernel on the device's host (issue 23: 1.72–2.2× its
# memory floor at 16 threads on the H100 hosts, target 1.5×). Runs no GPU work.
# Staging (here): cargo build --release -p k3-cli --features cuda; cargo test --release -p k3-core
# --lib --no-run; copy `k3` and the k3-core unit-test executable to .dev/q8/{k3,k3_core_lib},
# strip, `tar -C .dev/q8 -cJf .dev/q8.tar.xz .`; then `bash scripts/gpu/q8_tune.sh` with
# .dev/q8.tar.xz carried.
#   1. the kernel's unit tests on this CPU (AVX-512 VNNI here), with each prefetch hint;
#   2. `k3 bench --op experts 1 16 --tiers host` on k3r1x256 (lib.sh) for each setting of
#      K3_Q8_PREFETCH_HINT / K3_Q8_PREFETCH / K3_Q8_ROWS / K3_NO_AVX512 (Q8_CONFIGS: hint,bytes,rows[,avx2]
#      each), Q8_ROUNDS rounds (default 4), alternating. The first setting is the default.
set -o pipefail
. "$(dirname "$0")/lib.sh"
D=.dev/q8
[ -d $D ] || { mkdir -p $D && tar -C $D -xJf .dev/q8.tar.xz; }
FAILS=0
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L3" 
for h in t0 t1 t1+t0 nta; do
  echo "=== k3-core mxfp4_q8 tests, K3_Q8_PREFETCH_HINT=$h ==="
  K3_Q8_PREFETCH_HINT=$h $D/k3_core_lib mxfp4_q8 2>&1 | grep -E "test result|FAIL|panicked" || FAILS=$((FAILS + 1))
done
k3_model k3r1x256 $D/k3 || exit 1
CONFIGS=${Q8_CONFIGS:-"t1,4096,128 t0,2048,64 t1,2048,64 t0,2048,256 t1+t0,2048,256 t0,2048,64,avx2"}
for r in $(seq "${Q8_ROUNDS:-4}"); do
  for c in $CONFIGS; do
    IFS=, read -r h pf rows isa <<<"$c"
    noavx=""; [ "$isa" = avx2 ] && noavx=1
    printf "round %s hint %-6s pf %-5s rows %-4s %-6s" $r $h $pf $rows "${isa:-avx512}"
    env ${noavx:+K3_NO_AVX512=1} K3_Q8_PREFETCH_HINT=$h K3_Q8_PREFETCH=$pf K3_Q8_ROWS=$rows \
      $D/k3 bench --op experts 1 16 --tiers host --model /tmp/k3r1x256 2>&1 | grep -E "memory read|^ +(1|16) " | tr -s ' ' | tr '\n' '|' || FAILS=$((FAILS + 1))
    echo
  done
done
echo "failures: $FAILS"
[ $FAILS -eq 0 ]
