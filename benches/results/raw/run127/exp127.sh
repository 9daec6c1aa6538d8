#!/usr/bin/env bash
# Run 127 (8x H200): the relay with paced puts (tile order, 32 tiles in flight per PE), uncommitted
# on top of 9ea0424 + raw/run126/relay.diff: lasp2_forward's checks (f64 reference, modes bitwise
# equal, 100 graph replays of overlapped and relay) and every mode timed in turns at W = 8 and 4.
set -uo pipefail
R=$OUT/run127; mkdir -p $R
source scripts/gpu-env.sh; B=.bundle/bin
S="--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128"
for W in 8 4; do
  timeout 150 $B/lasp-run --timeout 140 -n $W $B/lasp2_forward --graph-calls 100 $S --json $R/w$W.json > $R/w$W.log 2>&1; echo "W=$W rc $? after $SECONDS s"
  grep -h "rank 0\] \(W=\|PE 0: \(over\|100\)\)" $R/w$W.log
done
cd $OUT && tar czf run127.tgz run127 && rm -rf run127
