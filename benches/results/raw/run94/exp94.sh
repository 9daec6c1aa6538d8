#!/usr/bin/env bash
# Run 94 (x2 H200): LASP-2 backward checks at W = 1, 2; the refactored forward's checks; single-GPU
# forward/backward checks; backward timing W = 1, 2; forward timing W = 1, 2 (no peer).
set -uo pipefail
R=$OUT/run94; mkdir -p $R
B=.bundle/bin
nvidia-smi -L > $R/gpus.txt
export LASP_WAIT_TIMEOUT_MS=20000
for n in 1 2; do
  timeout 300 $B/lasp-run --timeout 280 -n $n $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w$n.log 2>&1; echo "bwd check W=$n rc $?" | tee -a $R/summary.txt
done
timeout 300 $B/lasp-run --timeout 280 -n 2 $B/lasp2_forward --graph-calls 1000 --no-time > $R/fwd_check_w2.log 2>&1; echo "fwd check W=2 rc $?" | tee -a $R/summary.txt
timeout 200 $B/backward_check > $R/backward_check.log 2>&1; echo "backward_check rc $?" | tee -a $R/summary.txt
timeout 200 $B/forward_check > $R/forward_check.log 2>&1; echo "forward_check rc $?" | tee -a $R/summary.txt
OUT=$R/bwdbench LASP2_BENCH_WORLDS="1 2" timeout 400 bash benches/lasp2-backward-bench.sh > $R/bwdbench.log 2>&1; echo "bwd bench rc $?" | tee -a $R/summary.txt
for n in 1 2; do
  timeout 300 $B/lasp-run --timeout 280 -n $n $B/lasp2_forward --graph-calls 10 --time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128 --json $R/fwd_w$n.json > $R/fwd_time_w$n.log 2>&1; echo "fwd time W=$n rc $?" | tee -a $R/summary.txt
done
cat $R/summary.txt
grep -h "rank 0\] PE 0\|rank 1\] PE 1" $R/bwd_check_w2.log | head -20
grep -h "backward W=" $R/bwdbench.log
grep -h "W=" $R/fwd_time_w*.log | grep rank
tail -3 $R/backward_check.log $R/forward_check.log
