#!/bin/bash
# session run G: the f32 reference attend's parity test; k3 run --device cuda on k3-nano (the
# CPU side loaded without the MXFP4 scale scan) against the CPU.
D=.dev/model
export K3_REQUIRE_CUDA=1
timeout 100 $D/cuda_mla --test-threads=1 --nocapture 2>&1 | grep -E "^test |test result|panicked|F32" | cut -c1-150
bash scripts/gpu/model_run.sh nano 2>&1 | tail -12
