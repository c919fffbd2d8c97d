#!/bin/bash
# session run H: the on-disk cubin cache — k3 run on k3-nano twice in fresh processes (the
# first compiles every module with NVRTC and stores the cubins, the second reads them).
D=.dev/model
export K3_KERNEL_CACHE=/tmp/k3-kernel-cache
for i in 1 2; do
  /usr/bin/time -f "run $i: %e s wall" $D/k3 run --model models/k3-nano --device cuda --temperature 0 -n 48 "ROMEO." 2>&1 | tail -2
done
ls /tmp/k3-kernel-cache | head -20; du -sh /tmp/k3-kernel-cache
