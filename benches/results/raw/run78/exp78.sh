#!/usr/bin/env bash
# Run 78: the loading warp also scans each chunk's gates once (plain loads, warp scan, cumsums into
# the gate slot; both groups read them instead of scanning with shuffles), against 833d503 (old).
set -uo pipefail
O=$OUT/run78; mkdir -p $O
cat .bundle/commit > $O/commit.txt
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv > $O/gpu.txt 2>&1
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; rc=$?; echo "check rc=$rc"; grep -E "^forward_check:|FAIL" $O/check.log | tail -5
if [ $rc -ne 0 ]; then cd $OUT && tar czf run78.tgz run78 && rm -rf run78; exit 1; fi
for r in 1 2 3; do
  for v in old new; do
    bin=.bundle/var/forward_bench_old; [ $v = new ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run78.tgz run78 && rm -rf run78
