#!/usr/bin/env bash
# Run 102 (4x H200): the all-gather's "phased" item order (phased.diff on d144e18) against the
# default "dynamic": data checks (every size, 10,000 checked epochs at 64 KiB), then
# exchange_bench in turns, three processes each, at 1 / 4 / 8 MiB per rank.
set -uo pipefail
source scripts/gpu-env.sh
R=$OUT/run102; mkdir -p $R
B=.bundle/bin
timeout 120 $B/lasp-run --timeout 110 -n 4 $B/exchange --variant phased > $R/check_phased.log 2>&1; echo "exchange --variant phased rc $?" | tee -a $R/summary.txt
timeout 120 $B/lasp-run --timeout 110 -n 4 $B/exchange --variant phased --sizes 64K --rounds 10000 > $R/stress_phased.log 2>&1; echo "phased 10000 rounds rc $?" | tee -a $R/summary.txt
for pass in 1 2 3; do
  for v in dynamic phased; do
    timeout 120 $B/lasp-run --timeout 110 -n 4 $B/exchange_bench --variant $v --sizes 1M,4M,8M > $R/bench_${v}_$pass.log 2>&1
    echo "$v pass $pass rc $?" >> $R/summary.txt
    grep -h "rank 0" $R/bench_${v}_$pass.log | grep -i "MiB" | sed "s/^/$v $pass: /" | tee -a $R/summary.txt
  done
done
cd $OUT && tar czf run102.tgz run102 && rm -rf run102
