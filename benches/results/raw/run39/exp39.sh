#!/usr/bin/env bash
# Run 39: gpu-test (with exchange.json) at the bundle's commit, then exchange_bench old (c1691f3) / new in turns.
set -uo pipefail
source scripts/gpu-env.sh
O=$OUT/run39; mkdir -p $O
OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -v "^\[rank"
RUN=".bundle/bin/lasp-run --timeout 90 -n 4"
for rep in 1 2; do
  for b in old bin; do
    echo "== ${b}_$rep"; $RUN .bundle/$b/exchange_bench --out $O/${b}_$rep.json > $O/${b}_$rep.log 2>&1; echo rc=$?
    grep -h "all-gather\|ping" $O/${b}_$rep.log | grep "rank 0"
  done
done
cd $OUT && tar czf run39.tgz run39 && rm -rf run39
