#!/usr/bin/env bash
# Run 51: at the commit of the bundle (staged rows padded to 72 floats), gpu-test without its
# benchmark, then LASP-2 W = 4 timing against 9cda9b4's build (rows padded to 68) in turns.
set -uo pipefail
O=$OUT/run51; mkdir -p $O
GPU_TEST_SKIP_BENCH=1 OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed" | cut -c1-120
source scripts/gpu-env.sh
T="--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128"
for name in p68_1 p72_1 p72_2 p68_2; do
  bin=.bundle/bin/lasp2_forward; [ ${name%_*} = p68 ] && bin=.bundle/var/lasp2_forward_68
  echo "== $name"; timeout 200 .bundle/bin/lasp-run --timeout 190 -n 4 $bin --graph-calls 10 $T --json $O/$name.json > $O/$name.log 2>&1; echo rc=$?
  grep -E "^\[rank 0\] W=" $O/$name.log | head -3
done
cd $OUT && tar czf run51.tgz run51 && rm -rf run51
