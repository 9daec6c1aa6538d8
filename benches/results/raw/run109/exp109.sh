#!/usr/bin/env bash
# Run 109 (4x H200), bundle of ca85f97 (the segment folds issue 4 segments' loads at once):
# the LASP-2 forward benchmark (benches/lasp2-bench.sh: W = 1, 2, 4, every mode, the fla + NCCL
# peer, timelines) -> lasp2_forward.json; then the backward at W = 4, B=4 T_local=8K, against
# a09ed31 in turns, four passes (run 108 read +5 us there).
set -uo pipefail
R=$OUT/run109; mkdir -p $R/bench/tl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
LASP2_PEER=.peers/lasp2_fla_baseline.py OUT=$R/bench LASP2_ARGS="--timeline $R/bench/tl/tl" timeout 400 bash benches/lasp2-bench.sh > $R/bench.txt 2>&1; echo "lasp2-bench rc=$?" | tee -a $R/summary.txt
tail -14 $R/bench.txt >> $R/summary.txt
source scripts/gpu-env.sh
B=.bundle/bin; A=.bundle/baseline
for pass in 1 2 3 4; do for build in base new; do
  d=$B; [ $build = base ] && d=$A
  timeout 100 $B/lasp-run --timeout 95 -n 4 $d/lasp2_backward --graph-calls 10 --time 4x8192x16x128 --json $R/bwd_${build}_$pass.json > $R/bwd_${build}_$pass.log 2>&1; echo "bwd $build $pass rc $?" >> $R/summary.txt
  grep -h "backward W=4" $R/bwd_${build}_$pass.log | grep "rank 0" | sed "s/^/bwd $build $pass: /" >> $R/summary.txt
done; done
cat $R/summary.txt
cd $OUT && tar czf run109.tgz run109 && rm -rf run109
