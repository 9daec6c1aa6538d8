#!/usr/bin/env bash
# Run 56: is the two-role kernel's pipeline floor at B=4, T=8K set by the bytes it loads? The
# committed kernel (full), P0 = its output warpgroup's math removed (loads, barriers, state update,
# O stores kept), P1 = P0 without the Q tile loads (24 of 40 KB per chunk and CTA). In turns, 3x.
set -uo pipefail
O=$OUT/run56; mkdir -p $O
for r in 1 2 3; do
  for v in full P0 P1; do
    bin=.bundle/var/forward_bench_$v; [ $v = full ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --shapes 4x8192x16x128 --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print('%.4f' % d['shapes'][0]['ours_ms'])")"
  done
done
cd $OUT && tar czf run56.tgz run56 && rm -rf run56
