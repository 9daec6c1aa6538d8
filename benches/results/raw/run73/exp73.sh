#!/usr/bin/env bash
# Run 73: as run 72, but the output group's first warp issues the copies (after S_i is written, chunk
# i + 3 into chunk i - 1's stage); the state group issues none and its kEmpty barriers are gone.
# Q, K, V of the two-role kernel by the Tensor Memory Accelerator (tensor maps in
# lasp_sd_roles_params, one mbarrier per stage; gates still cp.async). forward_check; forward_bench
# in turns against a2ceb13's kernels (old), three passes; then scripts/forward-bench.sh (ours and
# fla in one job).
set -uo pipefail
O=$OUT/run73; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv > $O/gpu.txt 2>&1
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; rc=$?; echo "check rc=$rc"; grep -E "^forward_check:|FAIL" $O/check.log | tail -5
if [ $rc -ne 0 ]; then cd $OUT && tar czf run73.tgz run73 && rm -rf run73; exit 1; fi
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
cd $OUT && tar czf run73.tgz run73 && rm -rf run73
