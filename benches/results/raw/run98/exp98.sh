#!/usr/bin/env bash
# Run 98 (x2 H200): after the review refactor (host code only): LASP-2 backward and forward checks at
# W = 2, forward_check and backward_check on one GPU.
set -uo pipefail
R=$OUT/run98; mkdir -p $R
B=.bundle/bin
timeout 300 $B/lasp-run --timeout 280 -n 2 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w2.log 2>&1; echo "bwd check W=2 rc $?" | tee -a $R/summary.txt
timeout 300 $B/lasp-run --timeout 280 -n 2 $B/lasp2_forward --graph-calls 1000 --no-time > $R/fwd_check_w2.log 2>&1; echo "fwd check W=2 rc $?" | tee -a $R/summary.txt
timeout 200 $B/forward_check > $R/forward_check.log 2>&1; echo "forward_check rc $?" | tee -a $R/summary.txt
timeout 200 $B/backward_check > $R/backward_check.log 2>&1; echo "backward_check rc $?" | tee -a $R/summary.txt
tail -1 $R/forward_check.log $R/backward_check.log
cd $OUT && tar czf run98.tgz run98 && rm -rf run98
