#!/usr/bin/env bash
# Run 111 (4x H200): the backward's gate gradient split over (block, head) CTAs, with the
# single-kernel path kept at one block (ab2 = HEAD of the bundle) against be705cb:
# 1. GPU 0: backward_check (42 cases), forward_bench --backward of both builds in turns (three
#    passes), Nsight Compute durations of the gate kernels of one backward call per shape (new);
# 2. the LASP-2 backward: checks at W = 4 with 1000 graph replays, the benchmark (W = 1, 2, 4 ->
#    lasp2_backward.json), then W = 4, B=1 T_local=128K against be705cb in turns, two passes.
set -uo pipefail
R=$OUT/run111; mkdir -p $R/bench
source scripts/gpu-env.sh
B=.bundle/bin; A=.bundle/baseline
nvidia-smi -L > $R/gpus.txt
t0=$(date +%s)
timeout 120 $B/backward_check > $R/backward_check.log 2>&1; echo "backward_check rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
grep -E "^(FAIL|backward_check)|T20000|T16385" $R/backward_check.log | cut -c1-300 >> $R/summary.txt
for pass in 1 2 3; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 60 $d/forward_bench --backward --out $R/bwd_${build}_$pass.json > $R/bwd_${build}_$pass.log 2>&1; rc=$?
  echo "bwd $build $pass rc=$rc $(python3 -c "import json,sys; print(' '.join('%.4f' % s['backward_ms'] for s in json.load(open(sys.argv[1]))['shapes']))" $R/bwd_${build}_$pass.json 2>/dev/null)" >> $R/summary.txt
done; done
for shape in 4x8192x16x128 1x32768x16x128 1x131072x16x128; do
  n=3; [ $shape = 4x8192x16x128 ] && n=2
  timeout 40 ncu --clock-control none -k "regex:sd_bwd" --launch-skip $n -c $n --section SpeedOfLight \
    $B/forward_bench --backward --shapes $shape --warmup 1 --iters 1 > $R/ncu_new_$shape.txt 2>&1
  echo "ncu new $shape rc=$?: $(grep -E '^  lasp_sd_bwd|Duration' $R/ncu_new_$shape.txt | sed -E 's/\s+/ /g; s/lasp_sd_bwd_//; s/\(const.*//; s/, Context.*//' | paste -sd' ')" >> $R/summary.txt
done
timeout 100 $B/lasp-run --timeout 95 -n 4 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w4.log 2>&1; echo "lasp2_backward check W=4 rc=$?" | tee -a $R/summary.txt
OUT=$R/bench timeout 240 bash benches/lasp2-backward-bench.sh > $R/bench.txt 2>&1; echo "lasp2-backward-bench rc=$?" | tee -a $R/summary.txt
tail -12 $R/bench.txt >> $R/summary.txt
for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 45 $B/lasp-run --timeout 40 -n 4 $d/lasp2_backward --graph-calls 10 --time 1x131072x16x128 --json $R/bwd128_${build}_$pass.json > $R/bwd128_${build}_$pass.log 2>&1; echo "bwd128 $build $pass rc $?" >> $R/summary.txt
  grep -h "backward W=4" $R/bwd128_${build}_$pass.log | grep "rank 0" | sed "s/^/bwd128 $build $pass: /" >> $R/summary.txt
done; done
cat $R/summary.txt
cd $OUT && tar czf run111.tgz run111 && rm -rf run111
