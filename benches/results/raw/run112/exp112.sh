#!/usr/bin/env bash
# Run 112 (4x H200): the gate gradient's suffix sums stored per head in place and transposed into
# dg (bundle HEAD) against feab595: backward_check (42 cases) on GPU 0, forward_bench --backward of
# both builds in turns (three passes), Nsight Compute durations of the gate kernels of one backward
# call per shape (new), and the LASP-2 backward's checks at W = 4 with 1000 graph replays.
set -uo pipefail
R=$OUT/run112; mkdir -p $R
source scripts/gpu-env.sh
B=.bundle/bin; A=.bundle/baseline
nvidia-smi -L > $R/gpus.txt
timeout 120 $B/backward_check > $R/backward_check.log 2>&1; echo "backward_check rc=$?" | tee -a $R/summary.txt
grep -E "^(FAIL|backward_check)|T20000|T16385" $R/backward_check.log | cut -c1-300 >> $R/summary.txt
for pass in 1 2 3; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 60 $d/forward_bench --backward --out $R/bwd_${build}_$pass.json > $R/bwd_${build}_$pass.log 2>&1; rc=$?
  echo "bwd $build $pass rc=$rc $(python3 -c "import json,sys; print(' '.join('%.4f' % s['backward_ms'] for s in json.load(open(sys.argv[1]))['shapes']))" $R/bwd_${build}_$pass.json 2>/dev/null)" >> $R/summary.txt
done; done
for shape in 4x8192x16x128 1x32768x16x128 1x131072x16x128; do
  n=4; [ $shape = 4x8192x16x128 ] && n=3
  timeout 40 ncu --clock-control none -k "regex:sd_bwd" --launch-skip $n -c $n --section SpeedOfLight \
    $B/forward_bench --backward --shapes $shape --warmup 1 --iters 1 > $R/ncu_new_$shape.txt 2>&1
  echo "ncu new $shape rc=$?: $(grep -E '^  lasp_sd_bwd|Duration' $R/ncu_new_$shape.txt | sed -E 's/\s+/ /g; s/lasp_sd_bwd_//; s/\(const.*//; s/, Context.*//' | paste -sd' ')" >> $R/summary.txt
done
timeout 100 $B/lasp-run --timeout 95 -n 4 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w4.log 2>&1; echo "lasp2_backward check W=4 rc=$?" | tee -a $R/summary.txt
grep -cE "matches the f64 reference|bitwise" $R/bwd_check_w4.log >> $R/summary.txt
cat $R/summary.txt
cd $OUT && tar czf run112.tgz run112 && rm -rf run112
