#!/usr/bin/env bash
# Run 44: gpu-test at 30b192f (all-gather without credits), then base (e1f4221) vs new exchange_bench in turns.
set -uo pipefail
O=$OUT/run44; mkdir -p $O
OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed|gpu-test"
source scripts/gpu-env.sh
RUN=".bundle/bin/lasp-run --timeout 120 -n 4"
step() { local name=$1; shift; echo "== $name"; timeout 130 $RUN "$@" > $O/$name.log 2>&1; echo "rc=$?"; grep -h "all-gather\|batch" $O/$name.log | grep "rank 0" | head -8; }
for rep in 1 2 3; do
  step base_$rep .bundle/var/eb_base --sizes 1M,4M,8M --out $O/base_$rep.json
  step new_$rep .bundle/bin/exchange_bench --sizes 1M,4M,8M --out $O/new_$rep.json
done
step new_batch .bundle/bin/exchange_bench --sizes 1M,4M --batch 20 --floor --out $O/new_batch.json
cd $OUT && tar czf run44.tgz run44 && rm -rf run44
