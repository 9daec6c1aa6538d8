#!/usr/bin/env bash
# Run 95 (x2 H200): the backward's silent-rank drill and the forward's drills at W = 2; the backward
# benchmark at W = 1, 2 again (its JSON did not come back from run 94).
set -uo pipefail
R=$OUT/run95; mkdir -p $R
B=.bundle/bin
export LASP_WAIT_TIMEOUT_MS=3000
timeout 60 $B/lasp-run --timeout 55 -n 2 $B/lasp2_backward --silent-rank 1 > $R/bwd_silent.log 2>&1; echo "bwd silent rc $?" | tee -a $R/summary.txt
timeout 60 $B/lasp-run --timeout 55 -n 2 $B/lasp2_forward --silent-rank 0 > $R/fwd_silent.log 2>&1; echo "fwd silent rc $?" | tee -a $R/summary.txt
timeout 60 $B/lasp-run --timeout 55 -n 2 $B/lasp2_forward --mismatch-rank 1 > $R/fwd_mismatch.log 2>&1; echo "fwd mismatch rc $?" | tee -a $R/summary.txt
grep -h "drill error\|different layout" $R/*.log | cut -c1-400
unset LASP_WAIT_TIMEOUT_MS
OUT=$R/bwdbench LASP2_BENCH_WORLDS="1 2" timeout 400 bash benches/lasp2-backward-bench.sh > $R/bwdbench.log 2>&1; echo "bwd bench rc $?" | tee -a $R/summary.txt
grep -h "backward W=" $R/bwdbench.log
cd $OUT && tar czf run95.tgz run95 && rm -rf run95
