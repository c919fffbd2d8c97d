#!/bin/bash
# KDA prefill kernels under Nsight Compute (first T=4096 launch of each): stall reasons, pipe use,
# memory throughput. Staged as kda_run.sh. Output: $OUT/ncu.txt
D=.dev/kda
timeout 300 ncu --kernel-name regex:kda_chunk_ --launch-count 2 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
  --section InstructionStats --section SourceCounters \
  $D/kda_bench > $OUT/ncu.txt 2>&1; echo "ncu rc=$?"
grep -E "kda_chunk|Duration|Throughput|Stall|Warp Cycles|Issued|Pipe|Eligible|Occupancy|Registers|Shared Memory Config" $OUT/ncu.txt | head -80
