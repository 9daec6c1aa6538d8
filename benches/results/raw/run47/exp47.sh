#!/usr/bin/env bash
# Run 47: launch shape of the all-gather after the credit removal (61d336a), two passes, in turns.
set -uo pipefail
source scripts/gpu-env.sh
O=$OUT/run47; mkdir -p $O
RUN=".bundle/bin/lasp-run --timeout 120 -n 4"
B=.bundle/bin/exchange_bench
step() { local name=$1; shift; echo "== $name"; timeout 130 $RUN "$@" --out $O/$name.json > $O/$name.log 2>&1; echo "rc=$?"; grep -h "all-gather\|sweep" $O/$name.log | grep "rank 0"; }
for rep in 1 2; do
  step default_$rep $B --sizes 1M,4M,8M --sweep-ctas 32,48,80,96,112
  step t1024_$rep $B --sizes 1M,4M,8M --threads 1024
  step t256_$rep $B --sizes 1M,4M,8M --threads 256
  step c32k_$rep $B --sizes 1M,4M,8M --chunk 32768
done
cd $OUT && tar czf run47.tgz run47 && rm -rf run47
