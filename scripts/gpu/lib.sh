# shellcheck shell=bash
# k3rs GPU scripts: the shared part. Source it (`. scripts/gpu/lib.sh`); it sets no environment.
#
# Model recipes: random-weight real-width checkpoints of 4 layers made by `k3 init`, each in
# /tmp/<name> (the names README's Benchmarks and docs/gpu.md use):
#   k3r4bf   K3, layers KDA, KDA, KDA, MLA, every layer MoE with 64 BF16 experts (22.5 GB)
#   k3r4mx   the same with 64 MXFP4 experts (10.0 GB)
#   k31r4mx  K3.1 Pro widths, layers KDA, KDA, KDA, DSA, 64 MXFP4 experts
#   k3r4par  K3, dense layer 0, then MoE with 64 MXFP4 experts (9.4 GB; the parallel scripts'
#            checkpoint: its vocabulary of 32768 splits evenly over the ranks)
#   k3r2x896 K3, 2 layers (KDA, MLA), both MoE with the real 896 MXFP4 experts (issue 23's
#            offload checkpoint: 2 × 15.7 GB of routed experts)
#   k3r1x256 K3, 1 layer (KDA), MoE with 256 MXFP4 experts (4.5 GB: far past any cache, quick
#            to make; for tuning the CPU experts' kernel)

K3_REAL4="--num-hidden-layers 4 --num-experts 64 --set vocab_size=32768"

# k3_recipe NAME: the `k3 init` arguments of recipe NAME (all but --out).
k3_recipe() {
  case $1 in
  k3r4bf) echo "--config k3 $K3_REAL4 --set first_k_dense_replace=0 --experts bf16" ;;
  k3r4mx) echo "--config k3 $K3_REAL4 --set first_k_dense_replace=0 --experts mxfp4" ;;
  k31r4mx) echo "--config k3_1_pro $K3_REAL4 --set first_k_dense_replace=0 --experts mxfp4" ;;
  k3r4par) echo "--config k3 $K3_REAL4 --set first_k_dense_replace=1 --experts mxfp4" ;;
  k3r2x896) echo "--config k3 --num-hidden-layers 2 --num-experts 896 --set vocab_size=32768 --set first_k_dense_replace=0 --experts mxfp4" ;;
  k3r1x256) echo "--config k3 --num-hidden-layers 1 --num-experts 256 --set vocab_size=32768 --set first_k_dense_replace=0 --experts mxfp4" ;;
  *)
    echo "unknown model recipe '$1' (k3r4bf, k3r4mx, k31r4mx, k3r4par, k3r2x896, k3r1x256)" >&2
    return 1
    ;;
  esac
}

# k3_model NAME K3: makes /tmp/NAME with `K3 init` and recipe NAME, unless /tmp/NAME is already
# there from the same recipe (kept in /tmp/NAME.recipe), so calling it again costs nothing.
# Prints `k3 init`'s last line and "init <seconds> s" when it initialises.
k3_model() {
  local name=$1 k3=$2 m=/tmp/$1 args
  args=$(k3_recipe "$name") || return 1
  [ -d "$m" ] && [ "$(cat "$m.recipe" 2> /dev/null)" = "$args" ] && return 0
  rm -rf "$m" "$m.recipe"
  # shellcheck disable=SC2086 # the recipe is a word list
  /usr/bin/time -f "init %e s" "$k3" init $args --out "$m" 2>&1 | tail -2
  if [ -d "$m" ]; then echo "$args" > "$m.recipe"; else
    echo "k3 init of $name failed" >&2
    return 1
  fi
}

# stacks PID: every thread of PID — with gdb (symbols: stage the binary with `strip --strip-debug`)
# a backtrace each, else its name, kernel wait channel and current syscall — for a hang.
stacks() {
  local p=$1 t
  kill -0 "$p" 2> /dev/null || return 0
  echo "=== threads of pid $p ($(tr '\0' ' ' < /proc/$p/cmdline | head -c 120)) ==="
  if command -v gdb > /dev/null; then
    timeout 60 gdb -p "$p" -batch -ex "set pagination off" -ex "thread apply all bt 14" 2>&1 | grep -E '^(Thread|#)' | head -400
  else
    for t in /proc/$p/task/*; do
      echo "$(basename $t) $(cat $t/comm) wchan=$(cat $t/wchan 2> /dev/null) syscall=$(cut -d' ' -f1 $t/syscall 2> /dev/null)"
    done
  fi
}
