#!/usr/bin/env bash
# Run 79: the state group packs S_{i+1} to bf16 after chunk i's products and stores it only after
# chunk i + 1's products are issued (off the chain S_i -> S_{i+1}); 168 registers with 64 bytes of
# spills. Against 833d503 (old).
set -uo pipefail
O=$OUT/run79; mkdir -p $O
cat .bundle/commit > $O/commit.txt
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv > $O/gpu.txt 2>&1
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; rc=$?; echo "check rc=$rc"; grep -E "^forward_check:|FAIL" $O/check.log | tail -5
if [ $rc -ne 0 ]; then cd $OUT && tar czf run79.tgz run79 && rm -rf run79; exit 1; fi
for r in 1 2 3; do
  for v in old new; do
    bin=.bundle/var/forward_bench_old; [ $v = new ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run79.tgz run79 && rm -rf run79
