#!/usr/bin/env bash
# Run 58: Nsight Compute warp-stall sampling of the two-role output kernel (B=4, T=8K) and of the
# one-warpgroup output kernel (B=1, T=32K, S=8), at the GPU's own clocks (--clock-control none).
set -uo pipefail
B=.bundle/bin
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/smi.txt
which ncu; ncu --version | tail -1
run_ncu() {  # name kernel-regex shape
  ncu --clock-control none -k "regex:$2" -c 1 \
    --section WarpStateStats --section SourceCounters --section SchedulerStats --section SpeedOfLight \
    -o $OUT/$1 -f $B/forward_bench --shapes $3 --warmup 1 --iters 1 >$OUT/$1.log 2>&1
  echo "$1 rc=$?"; tail -3 $OUT/$1.log
  ncu --import $OUT/$1.ncu-rep --page details --print-details all >$OUT/$1_details.txt 2>&1
  ncu --import $OUT/$1.ncu-rep --page raw --csv >$OUT/$1_raw.csv 2>&1
  ncu --import $OUT/$1.ncu-rep --page source --csv --print-source sass >$OUT/$1_sass.csv 2>&1
  ls -la $OUT/$1*
}
run_ncu roles_B4T8K 'output_roles_dk128' 4x8192x16x128
run_ncu onewg_B1T32K 'lasp_scalar_decay_output_dk128' 1x32768x16x128
