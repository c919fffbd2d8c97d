#!/bin/bash
# k3rs: every CUDA test executable of the workspace in one device call (a regression run of the
# whole GPU suite), then, unless SUITE_SERVE=0, `parallel_serve.sh prefix` (the prefix cache on
# `k3 serve --tp 2` as two processes, on by default).
# Staging (here, no CUDA needed):
#   cargo test --release --features cuda -p k3-core -p k3-model -p k3-engine -p k3-vision --no-run --test 'cuda_*'
#   copy each test executable to .dev/suite/<test name> (k3-core's and k3-vision's cuda_vision as
#   cuda_vision_core / cuda_vision_vision) and `k3` beside them, strip, tar -C .dev/suite -cJf
#   .dev/suite.tar.xz .; the golden fixtures the repository does not carry (k3_small_f32,
#   k31_small_dsa_f32) in .dev/gold.tar.xz. Carry both; link the checkout at the path the
#   executables were built in (they find models/ and tests/golden/ there).
# Logs in $SUITE_LOGS (default /tmp/k3suite), one per executable; a summary line each here.
# SUITE_TIMEOUT (default 480 s) bounds each executable; the whole run took ~250 s on an H100
# (2026-12-06) before cuda_prefix's real-width case (~3 min more): mind the device call's limit.
set -o pipefail
D=.dev/suite
L=${SUITE_LOGS:-/tmp/k3suite}
mkdir -p $D $L
[ -x $D/k3 ] || tar -C $D -xJf .dev/suite.tar.xz
G=/tmp/k3golden
rm -rf $G && cp -r tests/golden $G && tar -C $G -xJf .dev/gold.tar.xz
export K3_REQUIRE_CUDA=1 K3_GOLDEN_DIR=$G
FAILS=0
for t in $(ls $D | grep '^cuda_' | sort); do
  start=$(date +%s%N)
  timeout ${SUITE_TIMEOUT:-480} $D/$t --test-threads=1 > $L/$t.log 2>&1
  rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  printf "%-22s rc %3d  %7d ms  %s\n" $t $rc $ms "$(grep -E '^test result' $L/$t.log | tail -1 | cut -c1-90)"
  [ $rc -eq 0 ] || { FAILS=$((FAILS + 1)); grep -E "panicked|FAILED|failures:" -A3 $L/$t.log | head -20; }
done
if [ "${SUITE_SERVE:-1}" = 1 ]; then
  K3_DIR=$D PAR_LOGS=$L/serve bash "$(dirname "$0")/parallel_serve.sh" prefix > $L/serve_prefix.log 2>&1 || FAILS=$((FAILS + 1))
  tail -16 $L/serve_prefix.log
fi
echo "failures: $FAILS"
[ $FAILS -eq 0 ]
