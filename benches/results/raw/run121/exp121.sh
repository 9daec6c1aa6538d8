#!/usr/bin/env bash
# Run 121 (4x H200): checks after the reversed workspace's new layout (the starts first; LASP-2
# allocates only them): backward_check on GPU 0, lasp2_backward at W = 4 with 1000 graph replays.
set -uo pipefail
R=$OUT/run121; mkdir -p $R
source scripts/gpu-env.sh
B=.bundle/bin
timeout 100 $B/backward_check > $R/backward_check.log 2>&1; echo "backward_check rc=$?" | tee -a $R/summary.txt
grep -E "^(FAIL|backward_check)" $R/backward_check.log | cut -c1-300 >> $R/summary.txt
timeout 100 $B/lasp-run --timeout 95 -n 4 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w4.log 2>&1; echo "lasp2_backward check W=4 rc=$?" | tee -a $R/summary.txt
grep -E "rank 0\]" $R/bwd_check_w4.log | grep -E "reference|bitwise" | cut -c1-200 >> $R/summary.txt
cat $R/summary.txt
cd $OUT && tar czf run121.tgz run121 && rm -rf run121
