#!/bin/bash
# k3rs: `k3 run` and `k3 serve` with --device cuda --tp/--pp as one process per GPU rank, on ONE
# H200 — the processes share the GPU, each with its own NCCL_HOSTID (NCCL then treats them as
# separate hosts and talks over sockets: slow, but the same collectives) — against the one-GPU
# run of the same checkpoint (the real-width 4-layer K3 of parallel_run.sh: dense layer 0, then
# MoE with 64 MXFP4 experts; its vocabulary of 32768 splits evenly).
# Staging: build here (no CUDA needed) —
#   cargo build --release -p k3-cli --features cuda && mkdir -p .dev/par && cp target/release/k3 .dev/par/ && strip .dev/par/k3
# then `bash scripts/gpu/parallel_serve.sh [run|serve|fault|load|prefix|all]` on the device with .dev carried.
# Ranks are started as a launcher would (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT); ranks ≠ 0
# print nothing and must exit 0 once rank 0 is done. Logs in $PAR_LOGS (default /tmp/k3serve).
#   run:   k3 run --temperature 0 -n 24: --tp 2, --pp 2 and --tp 2 --pp 2 (4 processes) print the ids of
#          --tp 1; exact in --precision f32; in bf16 (noisy on this random checkpoint: near-tied
#          expert choices flip) the number of matching leading ids is reported, not failed.
#   serve: k3 serve --tp 2, --pp 2 (pipelined steps) and --pp 2 --pipeline-depth 1 (f32) answer
#          two concurrent /v1/completions (temperature 0) with the text and logprobs of --tp 1;
#          SIGTERM to rank 0 stops it and both ranks exit 0.
#   load:  one GPU, bf16: `k3 bench serve` at concurrency 64 against `k3 serve`, beside the
#          captured decode step of `k3 bench --device cuda` at batch 64 (issue 20's baseline).
#   fault: k3 serve --tp 2, rank 1 killed with SIGKILL: the next request fails (an error, or
#          rank 0 exiting 70 when NCCL cannot abort its GPU work; both name rank 1)
#          naming rank 1 within a bound (no hang), and rank 0 stops with a non-zero status.
#   prefix: the prefix cache on k3 serve --tp 2 (issue 21, `dist::kept`: each rank keeps its own
#          device pages and KDA slots), k3-nano, f32, grid 32: the same requests one after the
#          other, to a server with the cache on and to one with --no-prefix-cache; each warm
#          answer has the cold one's text and logprobs (within PREFIX_TOL, default 2e-2: a
#          warm run's prefill is cut elsewhere) and the cached tokens expected (hits at a grid
#          point and past it, an exact re-send, a branch point); then a cache of 512 tokens,
#          where admissions evict cells (forgotten on rank 1 too), against the cold answers.
#          Needs no `k3 init` (`bash scripts/gpu/parallel_serve.sh prefix`).
set -o pipefail
case "${1:-all}" in
run | serve | fault | load | prefix | all) ;;
*)
  echo "unknown mode '$1' (run, serve, fault, load, prefix, all)" >&2
  exit 2
  ;;
esac
D=${K3_DIR:-.dev/par} # the staged binary (K3_DIR to use another folder)
L=${PAR_LOGS:-/tmp/k3serve}; mkdir -p $L
# Never NVLink multicast (kept off as the machines' own environment does); one GPU anyway.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export K3_REQUIRE_CUDA=1 K3_NCCL_TIMEOUT_S=60 K3_RENDEZVOUS_TIMEOUT_S=120
export K3_TRACE=${K3_TRACE:-1} # stage lines of start and shutdown on stderr (the logs), for hangs
HANG_S=${HANG_S:-120}
. "$(dirname "$0")/lib.sh"
M=/tmp/k3r4par
TOK=models/k3-nano # the checkpoint has no tokenizer; served text is decoded with k3-nano's (ids in)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "${1:-all}" != prefix ]; then
  k3_model k3r4par $D/k3 || exit 1 # scripts/gpu/lib.sh: made once, then reused
  du -sh $M
fi
IDS=$(python3 -c "import random; random.seed(7); print(','.join(str(random.randrange(32768)) for _ in range(40)))")
FAILS=0
fail() { echo "FAIL $*"; FAILS=$((FAILS + 1)); }

# world N TP PP TAG CMD...: N processes of `k3 CMD... --tp TP --pp PP`; rank 0's stdout to
# $L/TAG.out; waits for every rank and checks each exit status.
world() {
  local n=$1 tp=$2 pp=$3 tag=$4; shift 4
  local port=$((20000 + RANDOM % 20000)) pids=() i q
  local t0=$(date +%s%N)
  for ((i = 1; i < n; i++)); do
    RANK=$i WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port NCCL_HOSTID=k3host$i timeout 300 $D/k3 "$@" --tp $tp --pp $pp > $L/$tag.rank$i.out 2> $L/$tag.rank$i.log &
    pids+=($!)
  done
  RANK=0 WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port NCCL_HOSTID=k3host0 timeout 300 $D/k3 "$@" --tp $tp --pp $pp > $L/$tag.out 2> $L/$tag.rank0.log &
  local p0=$! rc rcs=""
  # A hang: after $HANG_S s every rank's threads are dumped (scripts/gpu/lib.sh stacks), then killed.
  for ((i = 0; i < HANG_S * 5; i++)); do kill -0 $p0 2>/dev/null || break; sleep 0.2; done
  if kill -0 $p0 2>/dev/null; then
    fail "$tag: rank 0 still running after $HANG_S s (stacks follow; then killed)"
    for q in $p0 "${pids[@]}"; do stacks $q; done
    kill -9 $p0 "${pids[@]}" 2>/dev/null
    echo "--- $tag rank 0 stderr (K3_TRACE) ---"; tail -40 $L/$tag.rank0.log
    for ((i = 1; i < n; i++)); do echo "--- $tag rank $i stderr ---"; tail -15 $L/$tag.rank$i.log; done
  fi
  wait $p0; rc=$?
  for q in "${pids[@]}"; do wait $q; rcs="$rcs $?"; done
  printf "%-28s ranks %d  rc0 %d  others:%s  %d ms\n" "$tag" $n $rc "$rcs" $((($(date +%s%N) - t0) / 1000000))
  [ $rc -eq 0 ] || { fail "$tag: rank 0 exited with $rc"; tail -5 $L/$tag.rank0.log; }
  for r in $rcs; do [ $r -eq 0 ] || { fail "$tag: a worker exited with $r"; tail -3 $L/$tag.rank1.log; break; }; done
  for ((i = 1; i < n; i++)); do [ -s $L/$tag.rank$i.out ] && fail "$tag: rank $i printed to stdout"; done
}
# ids FILE: the "ids" of a `k3 run --json` output, comma separated.
ids() { python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['ids'])))" "$1" 2>/dev/null; }
# same REF TAG EXACT: compares the ids; EXACT=1 fails on any difference, else reports the prefix.
same() {
  python3 - "$L/$1.out" "$L/$2.out" "$3" "$2 vs $1" <<'EOF' || FAILS=$((FAILS + 1))
import json, sys
try:
    a, b = (json.load(open(p))["ids"] for p in sys.argv[1:3])
except Exception as e:
    print(f"FAIL {sys.argv[4]}: no ids ({e})"); sys.exit(1)
n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
ok = a == b
print(f"{sys.argv[4]}: {n}/{len(a)} leading ids match{'' if ok else f' (first difference at {n}: {a[n:n+3]} vs {b[n:n+3]})'}")
sys.exit(0 if ok or sys.argv[3] != "1" else 1)
EOF
}

# serve_up TAG N TP [extra serve flags]: starts N processes of k3 serve (ranks ≠ 0 in the
# background), waits for rank 0's "listening" line; sets ADDR and PIDS (rank 0 first).
serve_up() {
  local tag=$1 n=$2 tp=$3; shift 3
  local port=$((20000 + RANDOM % 20000)) i
  local args=(serve --model $M --tokenizer $TOK --device cuda --port 0 --max-batch ${MAXB:-4} --max-cache-tokens ${MAXC:-8192} --tp $tp "$@")
  PIDS=()
  if [ $n -eq 1 ]; then
    $D/k3 "${args[@]}" > $L/$tag.rank0.out 2> $L/$tag.rank0.log &
    PIDS=($!)
  else
    RANK=0 WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port NCCL_HOSTID=s0 $D/k3 "${args[@]}" > $L/$tag.rank0.out 2> $L/$tag.rank0.log &
    PIDS=($!)
    for ((i = 1; i < n; i++)); do
      RANK=$i WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port NCCL_HOSTID=s$i $D/k3 "${args[@]}" > $L/$tag.rank$i.out 2> $L/$tag.rank$i.log &
      PIDS+=($!)
    done
  fi
  ADDR=""
  for ((i = 0; i < 600; i++)); do
    ADDR=$(grep -o 'http://[0-9.:]*' $L/$tag.rank0.out 2>/dev/null | head -1)
    [ -n "$ADDR" ] && break
    kill -0 ${PIDS[0]} 2>/dev/null || break
    sleep 0.5
  done
  [ -n "$ADDR" ] || { fail "$tag: rank 0 never listened"; tail -5 $L/$tag.rank0.log; }
  echo "$tag: $n process(es), listening on $ADDR"
}
# complete TAG NAME PROMPT_IDS: one /v1/completions (temperature 0, 24 tokens, logprobs) to $L/TAG.NAME.json.
complete() {
  curl -s -m 150 -o $L/$1.$2.json -w "%{http_code}" $ADDR/v1/completions -H 'content-type: application/json' \
    -d "{\"prompt\": [$3], \"max_tokens\": 24, \"temperature\": 0, \"ignore_eos\": true, \"logprobs\": 1}" > $L/$1.$2.code
}
# stop_all TAG: SIGTERM to rank 0, then every process must exit 0 within 60 s.
stop_all() {
  local tag=$1 i rc t0=$(date +%s)
  kill -TERM ${PIDS[0]}
  for i in "${!PIDS[@]}"; do
    while kill -0 ${PIDS[$i]} 2>/dev/null && [ $(($(date +%s) - t0)) -lt 60 ]; do sleep 0.2; done
    if kill -0 ${PIDS[$i]} 2>/dev/null; then fail "$tag: rank $i still running 60 s after SIGTERM to rank 0"; kill -9 ${PIDS[$i]}; fi
    wait ${PIDS[$i]}; rc=$?
    echo "$tag: rank $i exited $rc"
    [ $rc -eq 0 ] || { fail "$tag: rank $i exited with $rc"; tail -3 $L/$tag.rank$i.log; }
  done
}

P1=$(python3 -c "print(','.join(str((7 + 131 * j) % 4352) for j in range(30)))")
P2=$(python3 -c "print(','.join(str((1000 + 17 * j) % 4352) for j in range(11)))")

case "${1:-all}" in
run | all)
  echo "=== k3 run --temperature 0 -n 24: --tp 2, --pp 2 and --tp 2 --pp 2 print the ids of --tp 1 ==="
  for p in f32 bf16; do
    a=(run --model $M --device cuda --precision $p --ids $IDS --temperature 0 -n 24 --json)
    t0=$(date +%s%N)
    timeout 300 $D/k3 "${a[@]}" > $L/run1_$p.out 2> $L/run1_$p.log || { fail "run --tp 1 $p"; tail -3 $L/run1_$p.log; }
    echo "run1_$p: $((($(date +%s%N) - t0) / 1000000)) ms  ids $(ids $L/run1_$p.out)"
    world 2 2 1 run_tp2_$p "${a[@]}"
    world 4 2 2 run_tp2pp2_$p "${a[@]}"
    world 2 1 2 run_pp2_$p "${a[@]}"
    exact=$([ $p = f32 ] && echo 1 || echo 0)
    same run1_$p run_tp2_$p $exact
    same run1_$p run_tp2pp2_$p $exact
    same run1_$p run_pp2_$p $exact
  done
  echo "--- eager decode (--no-cuda-graphs), f32 ---"
  world 2 2 1 run_tp2_f32_eager run --model $M --device cuda --precision f32 --ids $IDS --temperature 0 -n 24 --json --no-cuda-graphs
  same run1_f32 run_tp2_f32_eager 1
  ;;&
serve | all)
  echo "=== k3 serve --tp 2 (f32): two concurrent completions = --tp 1's; SIGTERM to rank 0 ends every rank with 0 ==="
  # serve_pp2 and serve_pp2d1: --pp 2 with pipelined steps (two in flight, one sequence
  # each) and with --pipeline-depth 1 (one step at a time).
  for w in tp1 tp2 pp2 pp2d1; do
    tag=serve_$w
    case $w in
    tp1) serve_up $tag 1 1 --precision f32 ;;
    tp2) serve_up $tag 2 2 --precision f32 ;;
    pp2) serve_up $tag 2 1 --precision f32 --pp 2 ;;
    pp2d1) serve_up $tag 2 1 --precision f32 --pp 2 --pipeline-depth 1 ;;
    esac
    [ -n "$ADDR" ] || continue
    complete $tag a "$P1" & ca=$!
    complete $tag b "$P2" & cb=$!
    wait $ca $cb
    for r in a b; do
      code=$(cat $L/$tag.$r.code); echo "$tag request $r: HTTP $code $(head -c 300 $L/$tag.$r.json)"
      [ "$code" = 200 ] || fail "$tag request $r: HTTP $code"
    done
    stop_all $tag
  done
  python3 - $L <<'EOF' || FAILS=$((FAILS + 1))
import json, sys
L = sys.argv[1]; bad = 0
for w in ("tp2", "pp2", "pp2d1"):
  for r in "ab":
    try:
        a, b = (json.load(open(f"{L}/serve_{x}.{r}.json"))["choices"][0] for x in ("tp1", w))
    except Exception as e:
        print(f"FAIL {w} request {r}: no answer to compare ({e})"); bad += 1; continue
    la, lb = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
    d = max((abs(x - y) for x, y in zip(la, lb)), default=float("inf"))
    ok = a["text"] == b["text"] and len(la) == len(lb) == 24 and d <= 1e-3
    print(f"request {r}: {w} vs tp1: same text {a['text'] == b['text']}, {len(lb)} tokens, max |Δ logprob| {d:.2e}  {'ok' if ok else 'FAIL'}")
    bad += not ok
sys.exit(bad > 0)
EOF
  ;;&
fault | all)
  echo "=== k3 serve --tp 2, rank 1 killed: the next request fails naming rank 1, rank 0 stops ==="
  tag=serve_fault
  serve_up $tag 2 2
  if [ -n "$ADDR" ]; then
    complete $tag warm "$P2"; echo "$tag warm-up: HTTP $(cat $L/$tag.warm.code)"
    kill -9 ${PIDS[1]}; wait ${PIDS[1]} 2>/dev/null; echo "killed rank 1 (pid ${PIDS[1]})"
    t0=$(date +%s%N)
    complete $tag dead "$P1" & cd=$!
    for ((i = 0; i < HANG_S * 5; i++)); do kill -0 $cd 2>/dev/null || break; sleep 0.2; done
    kill -0 $cd 2>/dev/null && { echo "$tag: no answer after $HANG_S s: rank 0's threads"; stacks ${PIDS[0]}; tail -30 $L/$tag.rank0.log; }
    wait $cd
    ms=$((($(date +%s%N) - t0) / 1000000)); code=$(cat $L/$tag.dead.code)
    echo "$tag after the kill: HTTP $code in $ms ms: $(head -c 400 $L/$tag.dead.json)"
    [ "$code" = 200 ] && fail "$tag: a request succeeded without rank 1"
    # An HTTP error naming rank 1; or, where NCCL cannot abort the GPU work waiting on the dead
    # rank, rank 0 exits 70 naming it (dist::monitor) and the connection closes.
    [ "$code" = 000 ] && [ $ms -ge 100000 ] && fail "$tag: no answer within $ms ms (a hang)"
    t1=$(date +%s)
    while kill -0 ${PIDS[0]} 2>/dev/null && [ $(($(date +%s) - t1)) -lt 60 ]; do sleep 0.2; done
    if kill -0 ${PIDS[0]} 2>/dev/null; then fail "$tag: rank 0 still serving 60 s after its world failed"; kill -9 ${PIDS[0]}; fi
    wait ${PIDS[0]}; rc=$?
    echo "$tag: rank 0 exited $rc: $(grep -v 'k3 trace' $L/$tag.rank0.log | tail -1)"
    [ $rc -eq 0 ] && fail "$tag: rank 0 exited 0 after its world failed"
    if [ "$code" = 000 ]; then
      [ $rc -eq 70 ] && grep -q "rank 1 failed" $L/$tag.rank0.log || fail "$tag: the connection closed without rank 0 exiting 70 naming rank 1"
    else
      grep -q "rank 1" $L/$tag.dead.json || fail "$tag: the error does not name rank 1"
    fi
  fi
  ;;&
load | all)
  echo "=== one GPU, bf16: k3 bench serve (concurrency 64) against k3 serve, beside the captured step ==="
  $D/k3 bench --device cuda --model $M --prompt-len 128 --batches 1,16,64 --context 512 > $L/load_bench.out 2> $L/load_bench.log || { fail "k3 bench --device cuda"; tail -3 $L/load_bench.log; }
  cat $L/load_bench.out
  # The step budget (--max-step-tokens; default 8192 on a GPU) decides how many prompts prefill
  # per step; LOAD_BUDGETS="1024 8192" sweeps it (measured 2026-12-03: 8192 better on every figure).
  for budget in ${LOAD_BUDGETS:-8192}; do
    tag=load_s$budget
    MAXB=64 MAXC=65536 serve_up $tag 1 1 --max-step-tokens $budget
    if [ -n "$ADDR" ]; then
      for c in 1 64; do
        $D/k3 bench serve --base-url $ADDR --num-prompts $((c == 1 ? 8 : 128)) --max-concurrency $c --input-len 128 --output-len 128 --json > $L/$tag.c$c.json 2> $L/$tag.c$c.log || fail "k3 bench serve --max-concurrency $c"
        echo "bench serve budget=$budget c=$c in=128 out=128: $(cat $L/$tag.c$c.json)"
      done
      # Decode-dominated: short prompts, long answers (the served decode step against the captured one).
      $D/k3 bench serve --base-url $ADDR --num-prompts 64 --max-concurrency 64 --input-len 16 --output-len 512 --json > $L/$tag.long.json 2> $L/$tag.long.log || fail "k3 bench serve long"
      echo "bench serve budget=$budget c=64 in=16 out=512: $(cat $L/$tag.long.json)"
      stop_all $tag
    fi
  done
  ;;&
prefix | all)
  echo "=== k3 serve --tp 2 with the prefix cache (k3-nano, f32, grid 32): warm answers = cold ones ==="
  M0=$M; M=models/k3-nano
  # id lists: A (84 tokens: its snapshot at 64), prompts sharing its first N tokens, distinct ones.
  seq_ids() { python3 -c "import sys; s, n = map(int, sys.argv[1:]); print(','.join(str((s * 7919 + 37 * j) % 4352) for j in range(n)))" $1 $2; }
  head_ids() { echo "$1" | cut -d, -f1-$2; }
  A=$(seq_ids 1 84)
  NAMES=(a b0 b1 b7 a2 c d)
  PROMPTS=("$A" "$(head_ids "$A" 64),$(seq_ids 2 8)" "$(head_ids "$A" 65),$(seq_ids 3 8)" "$(head_ids "$A" 71),$(seq_ids 4 8)"
    "$A" "$(head_ids "$A" 63),$(seq_ids 5 12)" "$(head_ids "$A" 40),$(seq_ids 6 6)")
  WANT=(0 64 64 64 64 0 32) # a; hits at 64 (at it, 1 and 7 past it); a re-sent; a branch at 32, then its hit
  for ((k = 1; k <= 6; k++)); do NAMES+=(e$k); PROMPTS+=("$(seq_ids $((10 + k % 4)) 200)"); WANT+=(-1); done # e5, e6: e1, e2 again
  for w in cold warm small; do
    tag=prefix_$w
    case $w in
    cold) serve_up $tag 2 2 --precision f32 --no-prefix-cache ;;
    warm) serve_up $tag 2 2 --precision f32 --prefix-cache-grid 32 ;;
    small) MAXB=1 MAXC=512 serve_up $tag 2 2 --precision f32 --prefix-cache-grid 32 ;;
    esac
    [ -n "$ADDR" ] || continue
    for i in "${!NAMES[@]}"; do
      [ $w = warm ] && [[ ${NAMES[$i]} == e* ]] && continue
      [ $w = small ] && [[ ${NAMES[$i]} != e* ]] && continue
      complete $tag ${NAMES[$i]} "${PROMPTS[$i]}"
      code=$(cat $L/$tag.${NAMES[$i]}.code)
      [ "$code" = 200 ] || fail "$tag ${NAMES[$i]}: HTTP $code $(head -c 300 $L/$tag.${NAMES[$i]}.json)"
    done
    curl -s -m 10 $ADDR/metrics | grep '^k3_prefix_cache' > $L/$tag.metrics; cat $L/$tag.metrics
    stop_all $tag
  done
  M=$M0
  python3 - $L "${PREFIX_TOL:-2e-2}" "${NAMES[*]}" "${WANT[*]}" <<'EOF' || FAILS=$((FAILS + 1))
import json, sys
L, tol, names, want = sys.argv[1], float(sys.argv[2]), sys.argv[3].split(), [int(x) for x in sys.argv[4].split()]
bad = 0
for name, cached in zip(names, want):
    w = "small" if name.startswith("e") else "warm"
    try:
        a, b = (json.load(open(f"{L}/prefix_{x}.{name}.json")) for x in ("cold", w))
    except Exception as e:
        print(f"FAIL {name}: no answer to compare ({e})"); bad += 1; continue
    ca, cb = a["choices"][0], b["choices"][0]
    la, lb = ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"]
    got = b["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    d = max((abs(x - y) for x, y in zip(la, lb)), default=float("inf"))
    ok = ca["text"] == cb["text"] and len(la) == len(lb) == 24 and d <= tol and (cached < 0 or got == cached)
    print(f"{name} ({w}): cached {got} (want {'any' if cached < 0 else cached}), same text {ca['text'] == cb['text']}, max |Δ logprob| {d:.2e}  {'ok' if ok else 'FAIL'}")
    bad += not ok
try:
    # `name{model="…"} value` → name: value
    m = {l.split()[0].split("{")[0]: l.split()[1] for l in open(f"{L}/prefix_small.metrics") if len(l.split()) >= 2}
except OSError:
    m = {}
ev = float(m.get("k3_prefix_cache_evictions_total", 0))
print(f"small cache: {ev:.0f} evictions, {m.get('k3_prefix_cache_hits_total')} hits")
if ev == 0:
    print("FAIL small cache: nothing was evicted (the forget path did not run)"); bad += 1
sys.exit(bad > 0)
EOF
  ;;
esac
echo "FAILS=$FAILS"
[ "$FAILS" -eq 0 ]
