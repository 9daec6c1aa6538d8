#!/usr/bin/env bash
# Run 108 (4x H200): the segment folds of fold_put and segment_prefix issue the loads of 4 segments
# at once (512 threads per CTA; new: the working tree that became ca85f97) against a09ed31 (base,
# one segment per round trip). Run in two calls (`bash exp108.sh 1`, `bash exp108.sh 2`).
# Part 1: checks of the new build at W = 4, the forward in turns (timelines in pass 2), the new
# forward with 2 head groups. Part 2: the backward in turns; Nsight Compute durations of fold_put
# / segment_prefix at W = 1, B=1 T=32K, three launches per launch configuration, with and without
# ncu's cache flush (ncu_*.durations.txt: the name, grid, duration and register lines).
set -uo pipefail
source scripts/gpu-env.sh
PART=${1:-1}
R=$OUT/run108_$PART; mkdir -p $R
B=.bundle/bin; A=.bundle/baseline
nvidia-smi -L > $R/gpus.txt
SH="--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128"
if [ $PART = 1 ]; then
timeout 200 $B/lasp-run --timeout 190 -n 4 $B/lasp2_forward --graph-calls 1000 --no-time > $R/fwd_check_w4.log 2>&1; echo "fwd check W=4 rc $?" | tee -a $R/summary.txt
timeout 200 $B/lasp-run --timeout 190 -n 4 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w4.log 2>&1; echo "bwd check W=4 rc $?" | tee -a $R/summary.txt
for pass in 1 2 3; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  tl=""; if [ $pass = 2 ]; then mkdir -p $R/tl_$build; tl="--timeline $R/tl_$build/tl"; fi
  timeout 200 $B/lasp-run --timeout 190 -n 4 $d/lasp2_forward --graph-calls 10 $SH $tl --json $R/fwd_${build}_$pass.json > $R/fwd_${build}_$pass.log 2>&1; echo "fwd $build $pass rc $?" >> $R/summary.txt
  grep -h "W=4" $R/fwd_${build}_$pass.log | grep "rank 0" | sed "s/^/fwd $build $pass: /" >> $R/summary.txt
done; done
timeout 200 $B/lasp-run --timeout 190 -n 4 $B/lasp2_forward --graph-calls 10 $SH --groups 2 --json $R/fwd_new_g2.json > $R/fwd_new_g2.log 2>&1; echo "fwd new G=2 rc $?" >> $R/summary.txt
grep -h "W=4" $R/fwd_new_g2.log | grep "rank 0" | sed "s/^/fwd new G=2: /" >> $R/summary.txt
fi
if [ $PART = 2 ]; then
for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 200 $B/lasp-run --timeout 190 -n 4 $d/lasp2_backward --graph-calls 10 $SH --json $R/bwd_${build}_$pass.json > $R/bwd_${build}_$pass.log 2>&1; echo "bwd $build $pass rc $?" >> $R/summary.txt
  grep -h "backward W=4" $R/bwd_${build}_$pass.log | grep "rank 0" | sed "s/^/bwd $build $pass: /" >> $R/summary.txt
done; done
for build in base new; do
  d=$B; [ $build = base ] && d=$A
  for cc in all none; do
    timeout 100 ncu --target-processes all --clock-control none --cache-control $cc --filter-mode per-launch-config --launch-skip 2 -c 3 \
      -k "regex:lasp_lasp2_(fold_put|segment_prefix)" --section LaunchStats --section SpeedOfLight \
      $B/lasp-run --timeout 95 -n 1 $d/lasp2_forward --graph-calls 10 --time 1x32768x16x128 > $R/ncu_${build}_cache_$cc.txt 2>&1; echo "ncu $build cache $cc rc $?" >> $R/summary.txt
  done
done
fi
cat $R/summary.txt
cd $OUT && tar czf run108_$PART.tgz run108_$PART && rm -rf run108_$PART
