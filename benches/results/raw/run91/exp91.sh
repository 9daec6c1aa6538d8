#!/usr/bin/env bash
# Run 91: where the backward's time goes: Nsight Compute duration and DRAM throughput of every
# kernel of one backward call (the second one) at B=4, T=8K and at B=1, T=32K (H=16, D=128).
set -uo pipefail
O=$OUT/run91; mkdir -p $O
source scripts/gpu-env.sh
# Forward calls before the backward: warm-up + timed + set 0's output = 3; a backward call has
# 5 launches at S = 1 (no h0 / dht: no state_inputs) and 11 at S = 8. Skip the first backward.
ncu --clock-control none -k "regex:scalar_decay|sd_bwd" --launch-skip $((3 + 5)) -c 5 --section SpeedOfLight \
  .bundle/bin/forward_bench --backward --shapes 4x8192x16x128 --warmup 1 --iters 1 > $O/ncu_B4T8K.txt 2>&1; echo "ncu 8K rc=$?"
ncu --clock-control none -k "regex:scalar_decay|sd_bwd" --launch-skip $((9 + 11)) -c 11 --section SpeedOfLight \
  .bundle/bin/forward_bench --backward --shapes 1x32768x16x128 --warmup 1 --iters 1 > $O/ncu_B1T32K.txt 2>&1; echo "ncu 32K rc=$?"
for f in $O/ncu_*.txt; do echo "== $f"; grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput" $f | sed -E 's/\s+/ /g' | cut -c1-120; done
cd $OUT && tar czf run91.tgz run91 && rm -rf run91
