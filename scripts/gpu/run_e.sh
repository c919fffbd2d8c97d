#!/bin/bash
# session run E: prefill A/B against the build before this session's decode work (k3_old =
# 9df0711), k3-nano GPU (bf16 and f32) vs CPU through the CLI.
D=.dev/model
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
I="--num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0"
$D/k3 init --config k3 $I --experts bf16 --out /tmp/k3r4bf 2>&1 | tail -1 &
IB=$!
N=models/k3-nano; IDS=$(python3 -c "print(','.join(str((i*7919+13)%1024) for i in range(96)))")
$D/k3 logits --model $N --ids $IDS --out /tmp/cpu.npy 2>&1 | tail -1
$D/k3 logits --model $N --ids $IDS --out /tmp/g32.npy --device cuda --precision f32 2>&1 | tail -1
$D/k3 logits --model $N --ids $IDS --out /tmp/g32d.npy --device cuda --precision f32 --mode decode 2>&1 | tail -1
$D/k3 logits --model $N --ids $IDS --out /tmp/gbf.npy --device cuda 2>&1 | tail -1
python3 - <<'PY'
import numpy as np
c=np.load('/tmp/cpu.npy').astype(np.float64)
for n in ['g32','g32d','gbf']:
    g=np.load(f'/tmp/{n}.npy').astype(np.float64)
    rel=np.sqrt(((g-c)**2).sum(1)/(c**2).sum(1))
    print(f"k3-nano 96 tokens, {n} vs CPU: max abs {np.abs(g-c).max():.3e}, per-position rel L2 max {rel.max():.3e} median {np.median(rel):.3e}, top-1 {(g.argmax(1)==c.argmax(1)).mean():.3f}")
PY
bash scripts/gpu/model_run.sh nano 2>&1 | tail -6
wait $IB
B="--prompt-len 4096 --context 512 --warmup 3 --repeats 10 --batches 1"
for r in 1 2; do
  for b in k3_old k3; do echo "== $b round $r"; timeout 100 $D/$b bench --device cuda --model /tmp/k3r4bf $B 2>&1 | grep -E "prefill|decode"; done
done
