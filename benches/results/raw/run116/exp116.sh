#!/usr/bin/env bash
# Run 116 (4x H200): the LASP-2 backward's dv and dk passes from the reversed states pass's segment
# states (new = 4d93851: lasp_lasp2_reversed_starts, no states passes of their own) against 297e137:
# 1. GPU 0: backward_check (the single-GPU backward, whose launch path was refactored);
# 2. lasp2_backward checks at W = 4 (f64 reference, modes bitwise equal, 1000 graph replays),
#    with a new case of one segment per shard (the benchmark in 5 runs the checks at W = 1, 2, 4 too);
# 3. Nsight Compute durations of every lasp_* kernel of the first calls of lasp2_backward
#    --no-check at W = 1, B=4 T=8K (new);
# 4. lasp2_backward --no-check in turns base / new, two passes: W = 1 and W = 4 at the three shapes;
# 5. benches/lasp2-backward-bench.sh (W = 1, 2, 4 -> lasp2_backward.json).
set -uo pipefail
R=$OUT/run116; mkdir -p $R/bench
source scripts/gpu-env.sh
B=.bundle/bin; A=.bundle/baseline
nvidia-smi -L > $R/gpus.txt
t0=$(date +%s)
timeout 120 $B/backward_check > $R/backward_check.log 2>&1; echo "backward_check rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
grep -E "^(FAIL|backward_check)" $R/backward_check.log | cut -c1-300 >> $R/summary.txt
for W in 4; do
  g=100; [ $W = 4 ] && g=1000
  timeout 150 $B/lasp-run --timeout 145 -n $W $B/lasp2_backward --graph-calls $g --no-time > $R/bwd_check_w$W.log 2>&1; echo "lasp2_backward check W=$W rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
  grep -E "rank 0\]" $R/bwd_check_w$W.log | grep -E "reference|bitwise|rror" | cut -c1-260 >> $R/summary.txt
  grep -iE "error|fail" $R/bwd_check_w$W.log | head -5 | cut -c1-300 >> $R/summary.txt
done
timeout 90 ncu --target-processes all --clock-control none -k "regex:lasp_" -c 16 --section SpeedOfLight \
  $B/lasp-run --timeout 80 -n 1 $B/lasp2_backward --no-check --time 4x8192x16x128 > $R/ncu_new_8k.txt 2>&1
echo "ncu new 8k rc=$?" >> $R/summary.txt
grep -E '^  lasp_[a-z_0-9]+|Duration' $R/ncu_new_8k.txt | sed -E 's/\s+/ /g; s/\(const.*//; s/, Context.*//' | paste -d' ' - - >> $R/summary.txt
echo "t=$(( $(date +%s) - t0 ))s" >> $R/summary.txt
for W in 1 4; do for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 100 $B/lasp-run --timeout 95 -n $W $d/lasp2_backward --no-check --time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128 --json $R/w${W}_${build}_$pass.json > $R/w${W}_${build}_$pass.log 2>&1; echo "w$W $build $pass rc $?" >> $R/summary.txt
  grep -h "backward W=" $R/w${W}_${build}_$pass.log | grep "rank 0" | sed "s/^/w$W $build $pass: /" >> $R/summary.txt
done; done; echo "t=$(( $(date +%s) - t0 ))s" >> $R/summary.txt; done
OUT=$R/bench timeout 250 bash benches/lasp2-backward-bench.sh > $R/bench.txt 2>&1; echo "lasp2-backward-bench rc=$? t=$(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
tail -4 $R/bench.txt >> $R/summary.txt
cat $R/summary.txt
cd $OUT && tar czf run116.tgz run116 && rm -rf run116
