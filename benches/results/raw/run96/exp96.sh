#!/usr/bin/env bash
# Run 96 (x4 H200): LASP-2 backward checks and silent-rank drill at W = 4; the backward benchmark at
# W = 1, 2, 4 in one job; the refactored forward's checks and timing at W = 4 (no peer); the
# exchange benchmark (issue 2), five processes.
set -uo pipefail
R=$OUT/run96; mkdir -p $R
B=.bundle/bin
nvidia-smi -L > $R/gpus.txt
timeout 300 $B/lasp-run --timeout 280 -n 4 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w4.log 2>&1; echo "bwd check W=4 rc $?" | tee -a $R/summary.txt
LASP_WAIT_TIMEOUT_MS=3000 timeout 60 $B/lasp-run --timeout 55 -n 4 $B/lasp2_backward --silent-rank 1 > $R/bwd_silent_w4.log 2>&1; echo "bwd silent W=4 rc $?" | tee -a $R/summary.txt
timeout 300 $B/lasp-run --timeout 280 -n 4 $B/lasp2_forward --graph-calls 1000 --no-time > $R/fwd_check_w4.log 2>&1; echo "fwd check W=4 rc $?" | tee -a $R/summary.txt
OUT=$R/bwdbench LASP2_BENCH_WORLDS="1 2 4" timeout 500 bash benches/lasp2-backward-bench.sh > $R/bwdbench.log 2>&1; echo "bwd bench rc $?" | tee -a $R/summary.txt
timeout 300 $B/lasp-run --timeout 280 -n 4 $B/lasp2_forward --graph-calls 10 --time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128 --json $R/fwd_w4.json > $R/fwd_time_w4.log 2>&1; echo "fwd time W=4 rc $?" | tee -a $R/summary.txt
for k in 1 2 3 4 5; do timeout 120 $B/lasp-run --timeout 110 -n 4 $B/exchange_bench --out $R/exchange_run$k.json > $R/exchange_run$k.log 2>&1; done
python3 benches/exchange_report.py $R/exchange.json $R/exchange_run*.json > $R/exchange_report.log 2>&1; echo "exchange report rc $?" | tee -a $R/summary.txt
cat $R/summary.txt
grep -h "drill error" $R/bwd_silent_w4.log | cut -c1-300
grep -h "backward W=" $R/bwdbench.log
grep -h "W=4" $R/fwd_time_w4.log | grep rank
cat $R/exchange.json 2>/dev/null | head -30
cd $OUT && tar czf run96.tgz run96 && rm -rf run96
