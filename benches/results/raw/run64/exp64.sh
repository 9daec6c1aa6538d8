#!/usr/bin/env bash
# Run 64: at 6b9dac8 (the pipelined state chain of the two-role kernel),
# forward_check; forward_bench in turns against eac3983's kernels (old), three passes; then
# scripts/forward-bench.sh (ours and fla in one job) -> forward_kernel.json.
set -uo pipefail
O=$OUT/run64; mkdir -p $O
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; echo "check rc=$?"; grep -E "^forward_check:" $O/check.log | tail -1
for r in 1 2 3; do
  for v in old new; do
    bin=.bundle/var/forward_bench_old; [ $v = new ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
OUT=$O/fwdbench bash scripts/forward-bench.sh > $O/fwdbench.txt 2>&1; echo "forward-bench rc=$?"
python3 -c "
import json; d=json.load(open('$O/fwdbench/forward_kernel.json'))
for s in d['shapes']: print(s['B'], s['T'], s['ours_ms'], s['fla_ms'], s['speedup'], s['rel_err_vs_fla'])"
cd $OUT && tar czf run64.tgz run64 && rm -rf run64
