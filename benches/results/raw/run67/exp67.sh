#!/usr/bin/env bash
# Run 67: two more overlaps in the two-role kernel on 914bfc0 (variants.diff, switched by
# LASP_EXP_A / LASP_EXP_B defined at the top of scalar_decay.cuh): A = the state group's stage
# refill issued inside its products' window; B = the output group computes Q K^T and the scores of
# chunk i before waiting for S_i (then Q S_i, scaling, P V); AB = both. forward_check on each, then
# forward_bench (B=4, T=8K) in turns with 914bfc0 (pipe), four passes.
set -uo pipefail
O=$OUT/run67; mkdir -p $O
for v in A B AB; do
  timeout 240 .bundle/var/forward_check_$v > $O/check_$v.log 2>&1; echo "check $v rc=$?"; grep -E "^forward_check:" $O/check_$v.log | tail -1
done
for r in 1 2 3 4; do
  for v in pipe A B AB; do
    bin=.bundle/var/forward_bench_$v; [ $v = pipe ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --shapes 4x8192x16x128 --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run67.tgz run67 && rm -rf run67
