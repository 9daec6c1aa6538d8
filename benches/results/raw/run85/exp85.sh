#!/usr/bin/env bash
# Run 85: the late prefix (deferred chunks) and few put CTAs, against ff63418, every GPU of the node, one pass.
set -uo pipefail
O=$OUT/run85; mkdir -p $O
source scripts/gpu-env.sh
B=.bundle/bin; BB=.bundle/baseline; W=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,clocks.sm,temperature.gpu,power.draw --format=csv > $O/smi_start.csv
timeout 240 $B/lasp-run --timeout 230 -n "$W" $B/lasp2_forward --no-time --graph-calls 1000 > $O/check.log 2>&1
echo "check rc=$?"
grep -E "FAIL|rror|prefix joining|graph-replayed" $O/check.log | grep "rank 3\|rror\|FAIL" | tail -6
T=(--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128)
run() {
  local tag=$1 bin=$2; shift 2
  local t0=$(date +%s)
  timeout 150 $B/lasp-run --timeout 140 -n "$W" $bin --graph-calls 10 "${T[@]}" --json $O/$tag.json "$@" > $O/$tag.log 2>&1
  echo "$tag rc=$? $(( $(date +%s) - t0 ))s"
  grep -h '^\[rank 0\] W=' $O/$tag.log | sed 's/^\[rank 0\] //'
}
run base_1 $BB/lasp2_forward
run f0_k0 $B/lasp2_forward
run f8_k0 $B/lasp2_forward --put-ctas 8 --defer 0
run f8_k8 $B/lasp2_forward --put-ctas 8 --defer 8 --timeline $O/tl_f8_k8
run f8_k16 $B/lasp2_forward --put-ctas 8 --defer 16 --timeline $O/tl_f8_k16
run f4_k8 $B/lasp2_forward --put-ctas 4 --defer 8
run f16_k8 $B/lasp2_forward --put-ctas 16 --defer 8
run f8_k4 $B/lasp2_forward --put-ctas 8 --defer 4
run base_2 $BB/lasp2_forward
nvidia-smi --query-gpu=index,clocks.sm,temperature.gpu,power.draw --format=csv > $O/smi_end.csv
cd $OUT && tar czf run85.tgz run85 && rm -rf run85
