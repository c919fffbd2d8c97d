#!/bin/bash
# session run I: the last commit's MLA and model suites (the attend's selection helper).
D=.dev/model
export K3_REQUIRE_CUDA=1 K3_GOLDEN_DIR=$D/golden
for t in cuda_mla cuda_model; do timeout 120 $D/$t --test-threads=1 2>&1 | grep -E "^test |test result|panicked" | cut -c1-120; done
