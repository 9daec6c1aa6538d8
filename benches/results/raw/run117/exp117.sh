#!/usr/bin/env bash
# Run 117 (4x H200): one reversed states pass for both reversed passes of the backward, in the
# single-GPU backward too (new = d8392dd), against 297e137 (base, before run 116's change):
# 1. GPU 0: backward_check (42 cases, forced S = 1, 2, 3, 8 among them); forward_bench --backward
#    in turns base / new, two passes; Nsight Compute durations of one backward call at B=4 T=8K (new);
# 2. lasp2_backward at W = 4: checks (f64 reference, modes bitwise equal, 1000 graph replays);
# 3. lasp2_backward --no-check in turns base / new, two passes: W = 1 and W = 4 at the three shapes;
# 4. benches/lasp2-backward-bench.sh (W = 1, 2, 4 -> lasp2_backward.json).
set -uo pipefail
R=$OUT/run117; mkdir -p $R/bench
source scripts/gpu-env.sh
B=.bundle/bin; A=.bundle/baseline
nvidia-smi -L > $R/gpus.txt
t0=$(date +%s)
timeout 120 $B/backward_check > $R/backward_check.log 2>&1; echo "backward_check rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
grep -E "^(FAIL|backward_check)" $R/backward_check.log | cut -c1-300 >> $R/summary.txt
for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 60 $d/forward_bench --backward --out $R/bwd_${build}_$pass.json > $R/bwd_${build}_$pass.log 2>&1; rc=$?
  echo "bwd $build $pass rc=$rc $(python3 -c "import json,sys; print(' '.join('%.4f' % s['backward_ms'] for s in json.load(open(sys.argv[1]))['shapes']))" $R/bwd_${build}_$pass.json 2>/dev/null)" >> $R/summary.txt
done; done
timeout 60 ncu --clock-control none -k "regex:sd_bwd|scalar_decay" -c 24 --section SpeedOfLight \
  $B/forward_bench --backward --shapes 4x8192x16x128 --warmup 1 --iters 1 > $R/ncu_new_8k.txt 2>&1
echo "ncu new 8k rc=$?" >> $R/summary.txt
grep -E '^  lasp_[a-z_0-9]+|Duration' $R/ncu_new_8k.txt | sed -E 's/\s+/ /g; s/\(const.*//; s/, Context.*//' | paste -d' ' - - >> $R/summary.txt
timeout 100 $B/lasp-run --timeout 95 -n 4 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w4.log 2>&1; echo "lasp2_backward check W=4 rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
grep -E "rank 0\]" $R/bwd_check_w4.log | grep -E "reference|bitwise" | cut -c1-260 >> $R/summary.txt
grep -iE "error|fail" $R/bwd_check_w4.log | head -5 | cut -c1-300 >> $R/summary.txt
for W in 1 4; do for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 100 $B/lasp-run --timeout 95 -n $W $d/lasp2_backward --no-check --time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128 --json $R/w${W}_${build}_$pass.json > $R/w${W}_${build}_$pass.log 2>&1; echo "w$W $build $pass rc $?" >> $R/summary.txt
  grep -h "backward W=" $R/w${W}_${build}_$pass.log | grep "rank 0" | sed "s/^/w$W $build $pass: /" >> $R/summary.txt
done; done; echo "t=$(( $(date +%s) - t0 ))s" >> $R/summary.txt; done
OUT=$R/bench timeout 250 bash benches/lasp2-backward-bench.sh > $R/bench.txt 2>&1; echo "lasp2-backward-bench rc=$? t=$(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
tail -4 $R/bench.txt >> $R/summary.txt
cat $R/summary.txt
cd $OUT && tar czf run117.tgz run117 && rm -rf run117
