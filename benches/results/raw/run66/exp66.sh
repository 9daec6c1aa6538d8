#!/usr/bin/env bash
# Run 66: the pipelined state chain with its loop unrolled by two (two StateSteps swapping roles,
# no copy between them; unroll2.diff on 6b9dac8) against 6b9dac8 (pipe): forward_check, then
# forward_bench (B=4, T=8K) in turns, four passes.
set -uo pipefail
O=$OUT/run66; mkdir -p $O
timeout 240 .bundle/var/forward_check_u2 > $O/check.log 2>&1; echo "check rc=$?"; grep -E "^forward_check:" $O/check.log | tail -1
for r in 1 2 3 4; do
  for v in pipe u2; do
    bin=.bundle/var/forward_bench_u2; [ $v = pipe ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --shapes 4x8192x16x128 --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run66.tgz run66 && rm -rf run66
