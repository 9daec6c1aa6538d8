#!/usr/bin/env bash
# Run 75: at 833d503 (the two-role kernel fed by a loading warp through the Tensor Memory
# Accelerator), forward_check; forward_bench in turns against a2ceb13's kernels (old), three passes;
# then scripts/forward-bench.sh (ours and fla in one job) -> forward_kernel.json.
set -uo pipefail
O=$OUT/run75; mkdir -p $O
cat .bundle/commit > $O/commit.txt
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv > $O/gpu.txt 2>&1
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; rc=$?; echo "check rc=$rc"; grep -E "^forward_check:|FAIL" $O/check.log | tail -5
if [ $rc -ne 0 ]; then cd $OUT && tar czf run75.tgz run75 && rm -rf run75; exit 1; fi
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
print(d['commit'])
for s in d['shapes']: print(s['B'], s['T'], s['ours_ms'], s['fla_ms'], s['speedup'], s['rel_err_vs_fla'])"
cd $OUT && tar czf run75.tgz run75 && rm -rf run75
