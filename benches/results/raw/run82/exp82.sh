#!/usr/bin/env bash
# Run 82: Nsight Compute speed-of-light of the streaming states kernel and the fold at B=1, T=32K
# (uncommitted tree of run 81).
cd "$(dirname "$0")/../.."
source scripts/gpu-env.sh
mkdir -p $OUT/run82
ncu --clock-control none -k "regex:scalar_decay_states_dk128|scalar_decay_fold|scalar_decay_output_dk128$" -c 3 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats --section WarpStateStats \
  .bundle/bin/forward_bench --shapes 1x32768x16x128 --warmup 1 --iters 1 >$OUT/run82/ncu_B1T32K.txt 2>&1
echo "rc=$?"
grep -E "lasp_|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Issued Warp|No Eligible|Registers|Waves|Block Limit" $OUT/run82/ncu_B1T32K.txt
