#!/usr/bin/env bash
# Run 115 (4x H200): as run 114, with gate_grad's dh0 stores batched (new = HEAD of the bundle) against 41d7e74 (base):
# (4c052a5: state_inputs as a tiled transpose, <ht, dht> with ht^T read in rows)
# 1. GPU 0: backward_check (42 cases, h0 / dht among them), Nsight Compute durations of the
#    sd_bwd kernels of one LASP-2 backward call at W = 1, B=4 T=8K (new);
# 2. lasp2_backward at W = 4: checks (modes bitwise equal, 1000 graph replays);
# 3. lasp2_backward --no-check, in turns base / new, two passes: W = 1 at the three shapes,
#    W = 4 at B=4 T_local=8K;
# 4. benches/lasp2-backward-bench.sh (W = 1, 2, 4 -> lasp2_backward.json).
set -uo pipefail
R=$OUT/run115; mkdir -p $R/bench
source scripts/gpu-env.sh
B=.bundle/bin; A=.bundle/baseline
nvidia-smi -L > $R/gpus.txt
t0=$(date +%s)
timeout 120 $B/backward_check > $R/backward_check.log 2>&1; echo "backward_check rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
grep -E "^(FAIL|backward_check)" $R/backward_check.log | cut -c1-300 >> $R/summary.txt
timeout 90 ncu --target-processes all --clock-control none -k "regex:sd_bwd" -c 8 --section SpeedOfLight \
  $B/lasp-run --timeout 80 -n 1 $B/lasp2_backward --no-check --time 4x8192x16x128 > $R/ncu_new_8k.txt 2>&1
echo "ncu new 8k rc=$?" >> $R/summary.txt
grep -E '^  lasp_[a-z_0-9]+|Duration' $R/ncu_new_8k.txt | sed -E 's/\s+/ /g; s/\(const.*//; s/, Context.*//' | paste -d' ' - - >> $R/summary.txt
timeout 90 ncu --target-processes all --clock-control none -k "regex:sd_bwd_gate_(block|grad)" -c 4 --section SpeedOfLight \
  $B/lasp-run --timeout 80 -n 1 $B/lasp2_backward --no-check --time 1x32768x16x128 > $R/ncu_new_32k.txt 2>&1
echo "ncu new 32k rc=$?" >> $R/summary.txt
grep -E '^  lasp_[a-z_0-9]+|Duration' $R/ncu_new_32k.txt | sed -E 's/\s+/ /g; s/\(const.*//; s/, Context.*//' | paste -d' ' - - >> $R/summary.txt
timeout 100 $B/lasp-run --timeout 95 -n 4 $B/lasp2_backward --graph-calls 1000 --no-time > $R/bwd_check_w4.log 2>&1; echo "lasp2_backward check W=4 rc=$? $(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
grep -E "bitwise|FAIL|error" $R/bwd_check_w4.log | grep "rank 0" | head -8 | cut -c1-250 >> $R/summary.txt
for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 90 $B/lasp-run --timeout 85 -n 1 $d/lasp2_backward --no-check --time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128 --json $R/w1_${build}_$pass.json > $R/w1_${build}_$pass.log 2>&1; echo "w1 $build $pass rc $?" >> $R/summary.txt
  grep -h "backward W=" $R/w1_${build}_$pass.log | sed "s/^/w1 $build $pass: /" >> $R/summary.txt
done; done
echo "t=$(( $(date +%s) - t0 ))s" >> $R/summary.txt
for pass in 1 2; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 60 $B/lasp-run --timeout 55 -n 4 $d/lasp2_backward --no-check --time 4x8192x16x128 --json $R/w4_${build}_$pass.json > $R/w4_${build}_$pass.log 2>&1; echo "w4 $build $pass rc $?" >> $R/summary.txt
  grep -h "backward W=" $R/w4_${build}_$pass.log | grep "rank 0" | sed "s/^/w4 $build $pass: /" >> $R/summary.txt
done; done
echo "t=$(( $(date +%s) - t0 ))s" >> $R/summary.txt
OUT=$R/bench timeout 250 bash benches/lasp2-backward-bench.sh > $R/bench.txt 2>&1; echo "lasp2-backward-bench rc=$? t=$(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
tail -12 $R/bench.txt >> $R/summary.txt
cat $R/summary.txt
cd $OUT && tar czf run115.tgz run115 && rm -rf run115
