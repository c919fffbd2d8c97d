#!/bin/bash
# k3rs issue 13: the GPU model's parity suites on the device machine. Staging (docs/gpu.md):
# .dev/model/{cuda_model_ops,cuda_model,k3} (stripped release test executables and binary) and
# .dev/model/golden/ (the three model fixtures + manifest.json), carried with the run tool.
# Usage: bash scripts/gpu/model_run.sh [parity|nano]
set -o pipefail
D=.dev/model
export K3_REQUIRE_CUDA=1 K3_GOLDEN_DIR=$D/golden
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
case "${1:-parity}" in
parity)
  echo "=== cuda_model_ops ==="; K3_CUDA_SYNC=1 timeout 120 $D/cuda_model_ops --test-threads=1 2>&1 | grep -vE "^\s*$" | tail -25
  echo "=== cuda_model ==="; timeout 300 $D/cuda_model --test-threads=1 2>&1 | grep -vE "^\s*$" | tail -60 ;;
nano)
  echo "=== k3 run on k3-nano, GPU ==="; timeout 60 $D/k3 run --model models/k3-nano --device cuda --temperature 0 -n 48 "ROMEO." 2>&1 | tail -5
  echo "=== k3 run on k3-nano, CPU ==="; timeout 60 $D/k3 run --model models/k3-nano --temperature 0 -n 48 "ROMEO." 2>&1 | tail -5 ;;
bench)
  # Real widths, 4 layers (KDA, KDA, KDA, MLA), every layer MoE with 64 experts, MXFP4 experts.
  M=/tmp/k3r4mx
  [ -d $M ] || /usr/bin/time -f "init %e s" $D/k3 init --config k3 --num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0 --experts mxfp4 --out $M 2>&1 | tail -2
  timeout 300 $D/k3 bench --device cuda --model $M --prompt-len 4096 --batches 1,16,64 --context 512 --warmup 5 --repeats 30 2>&1 | tail -12 ;;
bench-bf16)
  # The same model with BF16 experts: the configuration of Moonshot's official code's figures.
  M=/tmp/k3r4bf
  [ -d $M ] || /usr/bin/time -f "init %e s" $D/k3 init --config k3 --num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0 --experts bf16 --out $M 2>&1 | tail -2
  timeout 300 $D/k3 bench --device cuda --model $M --prompt-len 4096 --batches 1,16,64 --context 512 --warmup 5 --repeats 30 2>&1 | tail -8 ;;
dsa)
  # K3.1 Pro widths, 4 layers (KDA, KDA, KDA, DSA), 64 MXFP4 experts: decode at long contexts.
  M=/tmp/k31r4mx
  [ -d $M ] || /usr/bin/time -f "init %e s" $D/k3 init --config k3_1_pro --num-hidden-layers 4 --num-experts 64 --set vocab_size=32768 --set first_k_dense_replace=0 --experts mxfp4 --out $M 2>&1 | tail -2
  timeout 300 $D/k3 bench --device cuda --model $M --op dsa 16384 131072 524288 --warmup 5 --repeats 30 2>&1 | tail -8 ;;
esac
