#!/usr/bin/env bash
# Run 49: LASP-2 prologue tiles staged through shared memory (new) against a4c9c93's kernels (old),
# both with per-rank medians in the JSON rows. W = 4 in turns (old new new old; the first pass of
# each with timelines), then W = 1 on every GPU alone (new), and old at W = 1 on GPU 0.
set -uo pipefail
O=$OUT/run49; mkdir -p $O
source scripts/gpu-env.sh
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $O/smi_start.csv
T="--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128"
run() {  # name binary W [extra args]
  local name=$1 bin=$2 w=$3; shift 3
  echo "== $name"; timeout 200 .bundle/bin/lasp-run --timeout 190 -n $w $bin --graph-calls 10 $T --json $O/$name.json "$@" > $O/$name.log 2>&1; echo rc=$?
  grep -E "^\[rank 0\] W=" $O/$name.log | head -3
}
NEW=.bundle/bin/lasp2_forward OLD=.bundle/var/lasp2_forward_old
mkdir -p $O/tl
run old_1 $OLD 4 --timeline $O/tl/old
run new_1 $NEW 4 --timeline $O/tl/new
run new_2 $NEW 4
run old_2 $OLD 4
for g in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$g run new_w1_gpu$g $NEW 1; done
CUDA_VISIBLE_DEVICES=0 run old_w1_gpu0 $OLD 1
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $O/smi_end.csv
cd $OUT && tar czf run49.tgz run49 && rm -rf run49
