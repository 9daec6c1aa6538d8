#!/usr/bin/env bash
# Run 43: all-gather start-up: base (e1f4221) vs v1 (static first work item) vs v2 (v1 + no credit round-trip), in turns.
set -uo pipefail
source scripts/gpu-env.sh
O=$OUT/run43; mkdir -p $O
RUN=".bundle/bin/lasp-run --timeout 120 -n 4"
step() { local name=$1; shift; echo "== $name"; timeout 130 $RUN "$@" > $O/$name.log 2>&1; echo "rc=$?"; grep -h "all-gather\|batch\|error\|mismatch" $O/$name.log | grep "rank 0" | head -8; }
step v2_stress .bundle/var/ex_v2 --sizes 64K,4M --rounds 10000 --pingpong 0
for rep in 1 2 3; do
  for v in base v1 v2; do
    step ${v}_$rep .bundle/var/eb_$v --sizes 1M,4M,8M --out $O/${v}_$rep.json
  done
done
step base_batch .bundle/var/eb_base --sizes 4M --batch 20 --out $O/base_batch.json
step v2_batch .bundle/var/eb_v2 --sizes 4M --batch 20 --out $O/v2_batch.json
cd $OUT && tar czf run43.tgz run43 && rm -rf run43
