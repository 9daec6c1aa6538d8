#!/usr/bin/env bash
# Run 42: the dynamic all-gather's work-item size below 16 KiB (commit 40639c2, default 16 KiB), in turns.
set -uo pipefail
source scripts/gpu-env.sh
O=$OUT/run42; mkdir -p $O
RUN=".bundle/bin/lasp-run --timeout 90 -n 4"
B=.bundle/bin/exchange_bench
step() { local name=$1; shift; echo "== $name"; timeout 100 $RUN "$@" --out $O/$name.json > $O/$name.log 2>&1; echo "rc=$?"; grep -h "all-gather" $O/$name.log | grep "rank 0"; }
for rep in 1 2; do
  step default_$rep $B --sizes 1M,4M,8M
  step chunk8k_$rep $B --sizes 1M,4M,8M --chunk 8192
  step chunk4k_$rep $B --sizes 1M,4M,8M --chunk 4096
  step chunk8k_256t_$rep $B --sizes 1M,4M,8M --chunk 8192 --threads 256
done
cd $OUT && tar czf run42.tgz run42 && rm -rf run42
