# k3-chat on the GPU: the held-out tool-call eval through k3 serve --device cuda (bf16 and f32), from
# the repository root on the GPU machine with the stripped k3 in .dev/par (carried); results in $OUT.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
for prec in bf16 f32; do
  port=$((21000 + RANDOM % 20000))
  ${K3:-.dev/par/k3} serve --model models/k3-chat --device cuda --precision $prec --port $port > $OUT/serve_$prec.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -sf localhost:$port/health > /dev/null && break; sleep 0.5; done
  python3 tools/k3chat/eval.py --server http://127.0.0.1:$port --mode constrained --required --per-kind 10 --out $OUT/eval_gpu_$prec.json 2>&1 | grep -E "==|rate|errors|leaks" | head -40
  kill $pid; wait $pid; echo "serve $prec exited $?"; tail -3 $OUT/serve_$prec.log
done
