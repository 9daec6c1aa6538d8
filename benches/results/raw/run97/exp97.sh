#!/usr/bin/env bash
# Run 97 (x2 H200): the final commit's example programs (timing rows now built by
# examples/src/lib.rs mode_columns): lasp2_backward and lasp2_forward at W = 2, checks and one shape.
set -uo pipefail
R=$OUT/run97; mkdir -p $R
B=.bundle/bin
timeout 300 $B/lasp-run --timeout 280 -n 2 $B/lasp2_backward --graph-calls 100 --time 4x8192x16x128 --json $R/bwd_w2.json > $R/bwd_w2.log 2>&1; echo "bwd W=2 rc $?" | tee -a $R/summary.txt
timeout 300 $B/lasp-run --timeout 280 -n 2 $B/lasp2_forward --graph-calls 100 --time 4x8192x16x128 --json $R/fwd_w2.json > $R/fwd_w2.log 2>&1; echo "fwd W=2 rc $?" | tee -a $R/summary.txt
grep -h "W=2" $R/*.log | grep rank
cat $R/bwd_w2.json $R/fwd_w2.json
cd $OUT && tar czf run97.tgz run97 && rm -rf run97
