#!/usr/bin/env bash
# Run 77: run 65's Nsight Compute warp-stall sampling of the two-role kernel (B=4, T=8K) at 833d503
# (fed by a loading warp through the Tensor Memory Accelerator).
set -uo pipefail
ncu --clock-control none -k "regex:output_roles_dk128" -c 1 \
  --section WarpStateStats --section SourceCounters --section SchedulerStats --section SpeedOfLight \
  -o $OUT/roles_B4T8K -f .bundle/bin/forward_bench --shapes 4x8192x16x128 --warmup 1 --iters 1 >$OUT/roles_B4T8K.log 2>&1
echo "rc=$?"
ncu --import $OUT/roles_B4T8K.ncu-rep --page details --print-details all >$OUT/roles_B4T8K_details.txt 2>&1
ncu --import $OUT/roles_B4T8K.ncu-rep --page source --csv --print-source sass >$OUT/roles_B4T8K_sass.csv 2>&1
rm -f $OUT/roles_B4T8K.ncu-rep
gzip $OUT/roles_B4T8K_sass.csv
ls -la $OUT
