#!/usr/bin/env bash
# Run 48: gpu-test (no bench) after the store_o_rows refactor, then LASP-2 W=4 timing old (61d336a) / new in turns.
set -uo pipefail
O=$OUT/run48; mkdir -p $O
GPU_TEST_SKIP_BENCH=1 OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed"
source scripts/gpu-env.sh
T="--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128"
for rep in 1 2; do
  for v in old new; do
    bin=.bundle/bin/lasp2_forward; [ $v = old ] && bin=.bundle/var/lasp2_forward_old
    echo "== ${v}_$rep"; timeout 200 .bundle/bin/lasp-run --timeout 190 -n 4 $bin --graph-calls 10 $T --json $O/${v}_$rep.json > $O/${v}_$rep.log 2>&1; echo rc=$?
    grep -E "^\[rank 0\] W=" $O/${v}_$rep.log | head -6
  done
done
cd $OUT && tar czf run48.tgz run48 && rm -rf run48
