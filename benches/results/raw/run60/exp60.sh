#!/usr/bin/env bash
# Run 60: O rows through shared memory (stmatrix + one bulk async copy per row) in the
# one-warpgroup output kernels (obulk.diff on eac3983) against eac3983 (old): forward_check, then
# forward_bench in turns (three shapes; B=4, T=8K runs the unchanged two-role kernel) and the
# probes of the B=1 shapes, three passes.
set -uo pipefail
O=$OUT/run60; mkdir -p $O
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; echo "check rc=$?"
grep -E "^(FAIL|forward_check:)" $O/check.log | head -5
for r in 1 2 3; do
  for v in old new; do
    bin=.bundle/var/forward_bench_old; [ $v = new ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
for v in old new; do
  bin=.bundle/var/forward_bench_old; [ $v = new ] && bin=.bundle/bin/forward_bench
  timeout 150 $bin --probes --shapes 1x32768x16x128,1x131072x16x128 --out $O/$v.probes.json > $O/$v.probes.log 2>&1
  echo "$v.probes $(python3 -c "import json; d=json.load(open('$O/$v.probes.json')); print(' | '.join(' '.join('%s %.4f' % (k, s[k]) for k in ('ours_ms','output_ms','probe_memory_ms','probe_compute_ms')) for s in d['shapes']))")"
done
cd $OUT && tar czf run60.tgz run60 && rm -rf run60
