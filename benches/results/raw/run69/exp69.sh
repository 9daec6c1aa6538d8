#!/usr/bin/env bash
# Run 69: the two-role kernel with the chunk copies issued by the output warpgroup (inside its
# first products' window) instead of the state warpgroup (loads_by_output_group.diff on 25d7dba),
# against a4c139b's build (pipe; same kernels as 25d7dba): forward_check, then forward_bench
# (three shapes) in turns, three passes.
set -uo pipefail
O=$OUT/run69; mkdir -p $O
timeout 240 .bundle/var/forward_check_C > $O/check.log 2>&1; echo "check rc=$?"; grep -E "^forward_check:" $O/check.log | tail -1
grep FAIL $O/check.log | head -3 | cut -c1-200
for r in 1 2 3; do
  for v in pipe C; do
    bin=.bundle/var/forward_bench_C; [ $v = pipe ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run69.tgz run69 && rm -rf run69
