#!/usr/bin/env bash
# Run 46: all-gather tail variants against 537e9a5 (base), in turns: sig = every CTA signals every
# peer after its own quiet (per-(source, CTA) words, the last CTA waits for all); late = the last
# CTA's fence before its counter reset instead of after.
set -uo pipefail
source scripts/gpu-env.sh
O=$OUT/run46; mkdir -p $O
RUN=".bundle/bin/lasp-run --timeout 120 -n 4"
step() { local name=$1; shift; echo "== $name"; timeout 130 $RUN "$@" > $O/$name.log 2>&1; echo "rc=$?"; grep -h "all-gather\|batch\|stress\|rror" $O/$name.log | grep "rank 0" | head -8; }
step sig_stress .bundle/var/ex_sig --sizes 64K,4M --rounds 10000 --pingpong 0
for rep in 1 2 3; do
  step base_$rep .bundle/bin/exchange_bench --sizes 1M,4M,8M --out $O/base_$rep.json
  step sig_$rep .bundle/var/eb_sig --sizes 1M,4M,8M --out $O/sig_$rep.json
  step late_$rep .bundle/var/eb_late --sizes 1M,4M,8M --out $O/late_$rep.json
done
cd $OUT && tar czf run46.tgz run46 && rm -rf run46
