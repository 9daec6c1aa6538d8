#!/usr/bin/env bash
# Run 92: the backward's gate kernels reworked (gate_terms: 16-byte loads, Dk/8 lanes per row, 4 rows
# per thread; gate_grad: coalesced blocks through shared memory): backward_check, the timing of
# run 90, and Nsight Compute durations of one backward call at B=4, T=8K and B=1, T=128K.
set -uo pipefail
O=$OUT/run92; mkdir -p $O
source scripts/gpu-env.sh
t0=$(date +%s)
timeout 300 .bundle/bin/backward_check > $O/backward_check.log 2>&1; echo "backward_check rc=$? $(( $(date +%s) - t0 ))s"
grep -E "^(FAIL|backward_check)" $O/backward_check.log | cut -c1-400
LASP_COMMIT=$(head -c 12 .bundle/commit) LASP_DATE=$(date -u +%FT%TZ) timeout 400 .bundle/bin/forward_bench --backward --out $O/backward_bench.json > $O/backward_bench.log 2>&1
echo "forward_bench --backward rc=$?"; cut -c1-300 $O/backward_bench.log
ncu --clock-control none -k "regex:scalar_decay|sd_bwd" --launch-skip $((3 + 5)) -c 5 --section SpeedOfLight \
  .bundle/bin/forward_bench --backward --shapes 4x8192x16x128 --warmup 1 --iters 1 > $O/ncu_B4T8K.txt 2>&1; echo "ncu 8K rc=$?"
ncu --clock-control none -k "regex:scalar_decay|sd_bwd" --launch-skip $((9 + 11)) -c 11 --section SpeedOfLight \
  .bundle/bin/forward_bench --backward --shapes 1x131072x16x128 --warmup 1 --iters 1 > $O/ncu_B1T128K.txt 2>&1; echo "ncu 128K rc=$?"
for f in $O/ncu_*.txt; do echo "== $f"; grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput" $f | sed -E 's/\s+/ /g' | cut -c1-100 | paste - - - ; done
cd $OUT && tar czf run92.tgz run92 && rm -rf run92
