#!/bin/bash
# k3rs: A/B of two builds of the GPU vision tower in one device call (issue 24): each build's
# cuda_vision tests (k3-core's kernels, k3-vision's tower = the CPU tower), then
# `bench_tower --cuda --bf16 --layers 27 --batch 8` alternating the builds, two rounds.
# Staging (here, no CUDA needed): for each build NAME in before/after —
#   cargo test --release --features cuda -p k3-core --test cuda_vision --test cuda_ops --no-run
#   cargo test --release --features cuda -p k3-vision --test cuda_vision --no-run
#   cargo build --release --features cuda -p k3-vision --example bench_tower
#   copy them to .dev/tower/NAME/{cuda_vision_core,cuda_vision_vis,cuda_ops,bench_tower}, strip,
#   tar -C .dev/tower -cJf .dev/tower.tar.xz .
# then `bash scripts/gpu/tower_ab.sh before after` on the device with .dev/tower.tar.xz carried
# (the tests find their fixtures through the path they were built in: link the checkout there).
set -o pipefail
[ $# -ge 1 ] || { echo "usage: tower_ab.sh BUILD... (folders under .dev/tower)" >&2; exit 2; }
D=.dev/tower
[ -d $D ] || { mkdir -p $D && tar -C $D -xJf .dev/tower.tar.xz; }
export K3_REQUIRE_CUDA=1
FAILS=0
for v in "$@"; do
  for t in cuda_vision_core cuda_vision_vis cuda_ops; do
    [ -x $D/$v/$t ] || { echo "($v has no $t)"; continue; }
    echo "=== $v $t ==="
    $D/$v/$t --test-threads=1 2>&1 | grep -v "^test .* ok$" | tail -30 || FAILS=$((FAILS + 1))
  done
done
for r in 1 2; do
  for v in "$@"; do
    echo "=== round $r: $v bench_tower --cuda --bf16 --layers 27 --batch 8 ==="
    timeout 200 $D/$v/bench_tower --cuda --bf16 --layers 27 --batch 8 --iters 5 2>&1 | tail -12 || FAILS=$((FAILS + 1))
  done
done
echo "failures: $FAILS"
[ $FAILS -eq 0 ]
