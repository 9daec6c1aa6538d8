#!/usr/bin/env bash
# Run 110 (4x H200 node, GPU 0 only): the backward's gate gradient split over (block, head) CTAs
# (aed87d5) against be705cb: backward_check (42 cases, two longer than one 8192-token block),
# forward_bench --backward of both builds in turns (three passes, the three benchmark shapes),
# Nsight Compute durations of the gate kernels of one backward call per shape and build.
set -uo pipefail
R=$OUT/run110; mkdir -p $R
source scripts/gpu-env.sh
B=.bundle/bin; A=.bundle/baseline
nvidia-smi -L > $R/gpus.txt
t0=$(date +%s)
timeout 240 $B/backward_check > $R/backward_check.log 2>&1; echo "backward_check rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
grep -E "^(FAIL|backward_check)|T20000|T16385" $R/backward_check.log | cut -c1-300 >> $R/summary.txt
for pass in 1 2 3; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  t0=$(date +%s)
  timeout 100 $d/forward_bench --backward --out $R/bwd_${build}_$pass.json > $R/bwd_${build}_$pass.log 2>&1; rc=$?
  echo "bwd $build $pass rc=$rc $(( $(date +%s) - t0 ))s $(python3 -c "import json,sys; print(' '.join('%.4f' % s['backward_ms'] for s in json.load(open(sys.argv[1]))['shapes']))" $R/bwd_${build}_$pass.json 2>/dev/null)" >> $R/summary.txt
done; done
for shape in 4x8192x16x128 1x32768x16x128 1x131072x16x128; do
  for build in base new; do
    d=$B; n=3; [ $build = base ] && { d=$A; n=2; }
    timeout 60 ncu --clock-control none -k "regex:sd_bwd" --launch-skip $n -c $n --section SpeedOfLight \
      $d/forward_bench --backward --shapes $shape --warmup 1 --iters 1 > $R/ncu_${build}_$shape.txt 2>&1
    echo "ncu $build $shape rc=$?: $(grep -E '^  lasp_sd_bwd|Duration' $R/ncu_${build}_$shape.txt | sed -E 's/\s+/ /g; s/lasp_sd_bwd_//; s/\(const.*//' | paste -sd' ')" >> $R/summary.txt
  done
done
cat $R/summary.txt
cd $OUT && tar czf run110.tgz run110 && rm -rf run110
