#!/usr/bin/env bash
# Run 107 (4x H200): fold_put stages its tile in shared memory and puts from there, capped at 128
# registers (new: a09ed31 + smem_put.diff, not committed) against a09ed31 (base). Run in two calls
# (`bash exp107.sh 1`, `bash exp107.sh 2`). Part 1: checks of the new build at W = 4, then the
# forward in turns (timelines in pass 2). Part 2: the backward in turns; Nsight Compute durations of
# fold_put / segment_prefix at W = 1 (B=1, T=32K: S = 8). The ncu runs ran past their 150 s limit
# (rc 9) after profiling every launch; ncu_*.durations.txt keep the name, grid, duration and
# register lines of their output.
set -uo pipefail
source scripts/gpu-env.sh
PART=${1:-1}
R=$OUT/run107_$PART; mkdir -p $R
B=.bundle/bin; A=.bundle/baseline
nvidia-smi -L > $R/gpus.txt
SH="--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128"
if [ $PART = 1 ]; then
timeout 200 $B/lasp-run --timeout 190 -n 4 $B/lasp2_forward --graph-calls 1000 --no-time > $R/fwd_check_w4.log 2>&1; echo "fwd check W=4 rc $?" | tee -a $R/summary.txt
timeout 200 $B/lasp-run --timeout 190 -n 4 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w4.log 2>&1; echo "bwd check W=4 rc $?" | tee -a $R/summary.txt
for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  tl=""; if [ $pass = 2 ]; then mkdir -p $R/tl_$build; tl="--timeline $R/tl_$build/tl"; fi
  timeout 200 $B/lasp-run --timeout 190 -n 4 $d/lasp2_forward --graph-calls 10 $SH $tl --json $R/fwd_${build}_$pass.json > $R/fwd_${build}_$pass.log 2>&1; echo "fwd $build $pass rc $?" >> $R/summary.txt
  grep -h "W=4" $R/fwd_${build}_$pass.log | grep "rank 0" | sed "s/^/fwd $build $pass: /" >> $R/summary.txt
done; done
fi
if [ $PART = 2 ]; then
for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 200 $B/lasp-run --timeout 190 -n 4 $d/lasp2_backward --graph-calls 10 $SH --json $R/bwd_${build}_$pass.json > $R/bwd_${build}_$pass.log 2>&1; echo "bwd $build $pass rc $?" >> $R/summary.txt
  grep -h "backward W=4" $R/bwd_${build}_$pass.log | grep "rank 0" | sed "s/^/bwd $build $pass: /" >> $R/summary.txt
done; done
for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 150 ncu --target-processes all --clock-control none -k "regex:lasp_lasp2_(fold_put|segment_prefix)" -c 400 --section LaunchStats --section SpeedOfLight \
    $B/lasp-run --timeout 140 -n 1 $d/lasp2_forward --graph-calls 10 --time 1x32768x16x128 > $R/ncu_$build.txt 2>&1; echo "ncu $build rc $?" >> $R/summary.txt
done
fi
cat $R/summary.txt
cd $OUT && tar czf run107_$PART.tgz run107_$PART && rm -rf run107_$PART
