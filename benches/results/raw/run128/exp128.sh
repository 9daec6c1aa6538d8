#!/usr/bin/env bash
# Run 128 (4x H200): the two-role output kernel in the LASP-2 forward (ef67175) against 82ae192.
# Checks (f64 reference incl. the two-role plan at H = 66, modes bitwise equal, 1000 graph
# replays; the backward's checks, whose fold_put was refactored), then B=4 T_local=8K timed in
# turns: base (82ae192), new (two-role), new --one-warpgroup, at W = 4, 2, 1; one timeline at W = 4.
set -uo pipefail
R=$OUT/run128; mkdir -p $R
source scripts/gpu-env.sh; B=.bundle/bin; A=.bundle/baseline
timeout 200 $B/lasp-run --timeout 190 -n 4 $B/lasp2_forward --graph-calls 1000 --no-time > $R/check_fwd4.log 2>&1; echo "fwd check W=4 rc $? after $SECONDS s"
grep -h "rank 0\] PE 0\|rank 3\] PE 3" $R/check_fwd4.log | head -20
timeout 120 $B/lasp-run --timeout 110 -n 4 $B/lasp2_backward --graph-calls 100 --no-time > $R/check_bwd4.log 2>&1; echo "bwd check W=4 rc $? after $SECONDS s"
S="--no-check --time 4x8192x16x128"
for pass in 1 2; do
  for W in 4 2 1; do
    timeout 60 $B/lasp-run --timeout 55 -n $W $A/lasp2_forward $S --json $R/base_w${W}_p$pass.json > $R/base_w${W}_p$pass.log 2>&1; echo "base W=$W p$pass rc $?"
    timeout 60 $B/lasp-run --timeout 55 -n $W $B/lasp2_forward $S --json $R/roles_w${W}_p$pass.json > $R/roles_w${W}_p$pass.log 2>&1; echo "roles W=$W p$pass rc $?"
    timeout 60 $B/lasp-run --timeout 55 -n $W $B/lasp2_forward $S --one-warpgroup --json $R/owg_w${W}_p$pass.json > $R/owg_w${W}_p$pass.log 2>&1; echo "owg W=$W p$pass rc $?"
    grep -h "rank 0\] W=" $R/base_w${W}_p$pass.log $R/roles_w${W}_p$pass.log $R/owg_w${W}_p$pass.log
  done
done
timeout 60 $B/lasp-run --timeout 55 -n 4 $B/lasp2_forward $S --timeline $R/tl --json $R/roles_tl.json > $R/roles_tl.log 2>&1; echo "timeline rc $? after $SECONDS s"
grep -h "rank 0\] W=" $R/roles_tl.log
cd $OUT && tar czf run128.tgz run128 && rm -rf run128
