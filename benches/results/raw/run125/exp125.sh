#!/usr/bin/env bash
# Run 125 (8x H200), bundle of 353329a (one head group by default): the exchange's CTA count at
# W = 8 (the default, 64 CTAs, was chosen on the 4-GPU node), two processes; then the LASP-2
# forward benchmark at W = 8 with the new default plan (benches/lasp2-bench.sh, fla + NCCL peer).
set -uo pipefail
R=$OUT/run125; mkdir -p $R/bench/tl
source scripts/gpu-env.sh; B=.bundle/bin
for k in 1 2; do
  timeout 120 $B/lasp-run --timeout 110 -n 8 $B/exchange_bench --variant dynamic --sizes 1M,4M,8M,32M --sweep-ctas 48,64,80,96,112 --out $R/sweep$k.json > $R/sweep$k.log 2>&1; echo "sweep $k rc $? after $SECONDS s"
  grep -h "^\[rank 0\] sweep\|^\[rank 0\] all-gather" $R/sweep$k.log
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
LASP2_BENCH_WORLDS=8 LASP2_PEER=.peers/lasp2_fla_baseline.py OUT=$R/bench LASP2_ARGS="--timeline $R/bench/tl/tl" timeout 300 bash benches/lasp2-bench.sh > $R/bench.txt 2>&1; echo "lasp2-bench rc=$? after $SECONDS s" | tee -a $R/bench.txt
tail -8 $R/bench.txt
cd $OUT && tar czf run125.tgz run125 && rm -rf run125
