#!/usr/bin/env bash
# Run 113 (one H200): where the LASP-2 backward's time over the single-GPU backward goes at W = 1.
# Nsight Compute durations of every lasp_* kernel of the first calls of lasp2_backward --no-check
# (one forward_saving call, then backward calls) per shape, the same for the forward at 8K, and
# the plain timings (forward_bench --backward; lasp2_backward W = 1) for reference.
set -uo pipefail
R=$OUT/run113; mkdir -p $R
source scripts/gpu-env.sh
B=.bundle/bin
nvidia-smi -L > $R/gpus.txt
timeout 60 $B/forward_bench --backward --out $R/bwd_single.json > $R/bwd_single.log 2>&1; echo "forward_bench --backward rc=$?" >> $R/summary.txt
timeout 90 $B/lasp-run --timeout 85 -n 1 $B/lasp2_backward --no-check --time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128 > $R/lasp2_bwd_w1.log 2>&1; echo "lasp2_backward W=1 rc=$?" >> $R/summary.txt
grep "backward W=" $R/lasp2_bwd_w1.log >> $R/summary.txt
for shape in 4x8192x16x128 1x32768x16x128 1x131072x16x128; do
  timeout 150 ncu --target-processes all --clock-control none -k "regex:lasp_" -c 34 --section SpeedOfLight \
    $B/lasp-run --timeout 140 -n 1 $B/lasp2_backward --no-check --time $shape > $R/ncu_bwd_$shape.txt 2>&1
  echo "ncu bwd $shape rc=$?" >> $R/summary.txt
  grep -E '^  lasp_[a-z_0-9]+|Duration' $R/ncu_bwd_$shape.txt | sed -E 's/\s+/ /g; s/\(const.*//; s/, Context.*//' | paste -d' ' - - > $R/ncu_bwd_$shape.durations.txt
done
timeout 120 ncu --target-processes all --clock-control none -k "regex:lasp_" -c 12 --section SpeedOfLight \
  $B/lasp-run --timeout 110 -n 1 $B/lasp2_forward --no-check --time 4x8192x16x128 > $R/ncu_fwd_8k.txt 2>&1
echo "ncu fwd 8k rc=$?" >> $R/summary.txt
grep -E '^  lasp_[a-z_0-9]+|Duration' $R/ncu_fwd_8k.txt | sed -E 's/\s+/ /g; s/\(const.*//; s/, Context.*//' | paste -d' ' - - > $R/ncu_fwd_8k.durations.txt
cat $R/summary.txt
cd $OUT && tar czf run113.tgz run113 && rm -rf run113
