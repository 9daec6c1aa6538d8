#!/usr/bin/env bash
# Run 57: the two-role kernel with a separate load warpgroup (working tree on 6ef0fd6) against
# 6ef0fd6 (old): forward_check, then forward_bench in turns (three shapes; the B=1 ones run the
# unchanged one-warpgroup kernel), three passes.
set -uo pipefail
O=$OUT/run57; mkdir -p $O
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; echo "check rc=$?"
grep -E "^(FAIL|forward_check:)" $O/check.log | head -5
for r in 1 2 3; do
  for v in old new; do
    bin=.bundle/var/forward_bench_old; [ $v = new ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run57.tgz run57 && rm -rf run57
