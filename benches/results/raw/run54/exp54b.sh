#!/usr/bin/env bash
# Run 54 B: probes of the two-role kernel at B=4, T=8K (S = 1): A = one output group, refill
# before the state update (the committed order), A1 = A with the output groups' math removed
# (barriers, O stores kept), A2 = A with the state update removed (loads, gate scan, bf16 state
# stores, barriers kept); B, B1, B2 the same with two output groups. old = a974a6f.
set -uo pipefail
O=$OUT/run54b; mkdir -p $O
for r in 1 2; do
  for v in old A A1 A2 B B1 B2; do
    timeout 100 .bundle/var/forward_bench_$v --shapes 4x8192x16x128 --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print('%.4f' % d['shapes'][0]['ours_ms'])")"
  done
done
cd $OUT && tar czf run54b.tgz run54b && rm -rf run54b
