#!/bin/bash
# Stall reasons (warp-cycles per issued instruction, by reason) of the KDA prefill kernels, first
# T=4096 launch of each, plus the executed instruction mix. Staged as kda_run.sh.
D=.dev/kda
timeout 300 ncu --kernel-name regex:kda_chunk_ --launch-count 2 \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed_pipe_xu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_global_ld.sum,smsp__inst_executed_op_global_st.sum,smsp__inst_executed_pipe_tensor.sum,smsp__inst_executed_pipe_fmaheavy.sum" \
  $D/kda_bench > $OUT/stalls.txt 2>&1; echo "ncu rc=$?"
grep -E "kda_chunk|stalled|inst_executed" $OUT/stalls.txt | awk '$NF+0 >= 0.05 || /kda_chunk|inst_executed/' | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -70
