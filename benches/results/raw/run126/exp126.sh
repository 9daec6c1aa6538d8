#!/usr/bin/env bash
# Run 126 (8x H200): the relay exchange mode (uncommitted on top of 9ea0424): lasp2_forward's
# checks (f64 reference; overlapped, relay and both sequential modes bitwise equal; 1000 graph
# replays of the overlapped and of the relay mode) and every mode timed in turns at W = 8, 4, 2;
# then the backward's checks at W = 4 (its mode list no longer comes from ExchangeMode::ALL).
set -uo pipefail
R=$OUT/run126; mkdir -p $R
source scripts/gpu-env.sh; B=.bundle/bin
S="--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128"
for W in 8 4; do
  timeout 150 $B/lasp-run --timeout 140 -n $W $B/lasp2_forward --graph-calls 1000 $S --json $R/w$W.json > $R/w$W.log 2>&1; echo "W=$W rc $? after $SECONDS s"
  grep -h "rank 0\] \(W=\|PE 0\)" $R/w$W.log
done
timeout 80 $B/lasp-run --timeout 70 -n 2 $B/lasp2_forward --graph-calls 100 --time 4x8192x16x128 --json $R/w2.json > $R/w2.log 2>&1; echo "W=2 rc $? after $SECONDS s"
grep -h "rank 0\] W=" $R/w2.log
timeout 80 $B/lasp-run --timeout 70 -n 4 $B/lasp2_backward --graph-calls 10 --no-time > $R/bwd4.log 2>&1; echo "bwd W=4 rc $? after $SECONDS s"
tail -3 $R/bwd4.log
cd $OUT && tar czf run126.tgz run126 && rm -rf run126
