#!/usr/bin/env bash
# Train k3-chat on one GPU, from the repository root, with no network:
#   bash tools/k3chat/train_gpu.sh            (the device tool's $OUT receives the results)
# Needs python3 with torch and numpy (nothing else: the data is generated here by the standard
# library). Wall time: data ~0.5 min + training MINUTES (default 7, including its final
# evaluations) + start-up. Results under $OUT/k3chat/:
#   best.N.pt (bf16 checkpoint parts <= 15 MiB; export with tools/k3chat/export.py --ckpt .../best),
#   last.N.pt, log.jsonl, summary.json (held-out loss), data.json (data counts), train.log
# Environment: OUT (default runs/gpu), MINUTES (7), TRAIN (conversations, 80000), BATCH (64),
# VAL (held-out conversations, 1000), CTX (512: BATCH*CTX tokens per step), LR (2e-3), WORKERS (16).
set -euo pipefail
cd "$(dirname "$0")"
OUT="${OUT:-runs/gpu}"
RUN="$OUT/k3chat"
DATA="${DATA:-work/data}"
mkdir -p "$RUN"
python3 -c 'import torch, numpy; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
t0=$(date +%s)
python3 gen_data.py --tok tok --out "$DATA" --train "${TRAIN:-80000}" --val "${VAL:-1000}" --episodes 40 \
    --workers "${WORKERS:-16}" 2>&1 | tee "$RUN/data.log"
cp "$DATA/data.json" "$RUN/data.json"
echo "data generated in $(( $(date +%s) - t0 ))s"
python3 ../k3nano/train.py --data "$DATA" --out "$RUN" --cfg config.json --minutes "${MINUTES:-7}" \
    --batch "${BATCH:-64}" --ctx "${CTX:-512}" --lr "${LR:-2e-3}" --warmup 150 --dropout 0.0 \
    --eval_every_s 30 --save_every_s 90 2>&1 | tee "$RUN/train.log" | grep -v '"event": "start"'
python3 - "$RUN/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print("HELD-OUT LOSS (assistant tokens, nats/token): best %.4f (fp32 %.4f, step %d of %d), last %.4f; %.0f s on %s"
      % (s["best_val_loss_bf16"], s["best_val_loss_fp32"], s["best_step"], s["steps"], s["last_val_loss"],
         s["train_seconds"], s["device"]))
EOF
ls -la "$RUN"
echo "total $(( $(date +%s) - t0 ))s"
