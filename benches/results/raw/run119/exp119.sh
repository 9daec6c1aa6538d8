#!/usr/bin/env bash
# Run 119 (4x H200): the LASP-2 backward's fold_put in two kernels, the puts in 128-thread CTAs
# beside the dq pass (new = HEAD of the bundle) against d8392dd (base):
# 1. lasp2_backward checks at W = 4 (f64 reference, modes bitwise equal, 1000 graph replays) and
#    the silent-rank drill (every earlier rank must name rank 1);
# 2. lasp2_backward --no-check in turns base / new, two passes: W = 4 and W = 2 at the three shapes.
set -uo pipefail
R=$OUT/run119; mkdir -p $R
source scripts/gpu-env.sh
B=.bundle/bin; A=.bundle/baseline
t0=$(date +%s)
timeout 100 $B/lasp-run --timeout 95 -n 4 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w4.log 2>&1; echo "lasp2_backward check W=4 rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
grep -E "rank 0\]" $R/bwd_check_w4.log | grep -E "reference|bitwise" | cut -c1-260 >> $R/summary.txt
LASP_WAIT_TIMEOUT_MS=3000 timeout 60 $B/lasp-run --timeout 55 -n 4 $B/lasp2_backward --silent-rank 1 > $R/drill.log 2>&1; echo "drill rc=$? (non-zero expected)" >> $R/summary.txt
grep "drill error" $R/drill.log | cut -c1-250 >> $R/summary.txt
for W in 4 2; do for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 100 $B/lasp-run --timeout 95 -n $W $d/lasp2_backward --no-check --time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128 --json $R/w${W}_${build}_$pass.json > $R/w${W}_${build}_$pass.log 2>&1; echo "w$W $build $pass rc $?" >> $R/summary.txt
  grep -h "backward W=" $R/w${W}_${build}_$pass.log | grep "rank 0" | sed "s/^/w$W $build $pass: /" >> $R/summary.txt
done; done; echo "t=$(( $(date +%s) - t0 ))s" >> $R/summary.txt; done
cat $R/summary.txt
cd $OUT && tar czf run119.tgz run119 && rm -rf run119
