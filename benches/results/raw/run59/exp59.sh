#!/usr/bin/env bash
# Run 59: the bf16 state copy through stmatrix (stsm) and, on top, the state group's stage refill
# issued while its products run plus a bounds-free copy for whole chunks (full), against eac3983
# (old): forward_check on full, then forward_bench in turns (three shapes), three passes.
set -uo pipefail
O=$OUT/run59; mkdir -p $O
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; echo "check rc=$?"
grep -E "^(FAIL|forward_check:)" $O/check.log | head -5; tail -2 $O/check.log
for r in 1 2 3; do
  for v in old stsm full; do
    bin=.bundle/var/forward_bench_$v; [ $v = full ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run59.tgz run59 && rm -rf run59
