#!/usr/bin/env bash
# Run 124 (8x H200), bundle of b02772f: W = 8, B=4 T_local=8K with 1, 2 and 4 head groups, in
# turns, two passes (the automatic plan of b02772f chose 2 groups there).
source scripts/gpu-env.sh; B=.bundle/bin; mkdir -p $OUT/g
for pass in 1 2; do for g in 1 2 4; do
  timeout 60 $B/lasp-run --timeout 55 -n 8 $B/lasp2_forward --graph-calls 10 --groups $g --time 4x8192x16x128 > $OUT/g/g${g}_$pass.log 2>&1
  echo "g=$g pass $pass rc $? $SECONDS s: $(grep -h 'rank 0\] W=8' $OUT/g/g${g}_$pass.log)"
done; done
