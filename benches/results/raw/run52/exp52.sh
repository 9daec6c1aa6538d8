#!/usr/bin/env bash
# Run 52: at c937f7c (folds load a whole segment at once), gpu-test without its benchmark; then in
# turns against c64c2a2's builds (old): LASP-2 at W = 4 and at W = 1 (GPU 0), the single-GPU
# forward with probes (GPU 0); then scripts/forward-bench.sh (ours and fla) at c937f7c.
set -uo pipefail
O=$OUT/run52; mkdir -p $O
GPU_TEST_SKIP_BENCH=1 OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed" | cut -c1-100
source scripts/gpu-env.sh
T="--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128"
for name in old_1 new_1 new_2 old_2; do
  bin=.bundle/bin/lasp2_forward; [ ${name%_*} = old ] && bin=.bundle/var/lasp2_forward_old
  echo "== w4 $name"; timeout 200 .bundle/bin/lasp-run --timeout 190 -n 4 $bin --graph-calls 10 $T --json $O/w4_$name.json > $O/w4_$name.log 2>&1; echo rc=$?
  grep -E "^\[rank 0\] W=" $O/w4_$name.log | head -3 | cut -c1-170
done
for name in old_1 new_1 new_2 old_2; do
  bin=.bundle/bin/lasp2_forward; [ ${name%_*} = old ] && bin=.bundle/var/lasp2_forward_old
  echo "== w1 $name"; CUDA_VISIBLE_DEVICES=0 timeout 200 .bundle/bin/lasp-run --timeout 190 -n 1 $bin --graph-calls 10 $T --json $O/w1_$name.json > $O/w1_$name.log 2>&1; echo rc=$?
  grep -E "^\[rank 0\] W=" $O/w1_$name.log | head -3 | cut -c1-170
done
for name in old_1 new_1 new_2 old_2; do
  bin=.bundle/bin/forward_bench; [ ${name%_*} = old ] && bin=.bundle/var/forward_bench_old
  echo "== fwd $name"; CUDA_VISIBLE_DEVICES=0 timeout 200 $bin --probes --out $O/fwd_$name.json > $O/fwd_$name.log 2>&1; echo rc=$?
  python3 -c "
import json,sys; d=json.load(open('$O/fwd_$name.json'))
for s in d['shapes']: print(s['B'], s['T'], 'ours %.4f output %.4f' % (s['ours_ms'], s['output_ms']))"
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
OUT=$O/fwdbench bash scripts/forward-bench.sh > $O/fwdbench.txt 2>&1; echo "forward-bench rc=$?"
python3 -c "
import json; d=json.load(open('$O/fwdbench/forward_kernel.json'))
for s in d['shapes']: print(s['B'], s['T'], s['ours_ms'], s['fla_ms'], s['speedup'], s['rel_err_vs_fla'])"
cd $OUT && tar czf run52.tgz run52 && rm -rf run52
