#!/usr/bin/env bash
# Run 50: at 9cda9b4 (staged LASP-2 prologue), the full GPU test suite (with its exchange
# benchmark), then the LASP-2 benchmark at W = 1, 2, 4 with the fla + NCCL peer and timelines.
set -uo pipefail
O=$OUT/run50; mkdir -p $O/bench/tl
OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed|speedup|gbps" | tail -30
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
OUT=$O/bench LASP2_ARGS="--timeline $O/bench/tl/tl" bash benches/lasp2-bench.sh > $O/bench.txt 2>&1; echo "lasp2-bench rc=$?"
tail -14 $O/bench.txt
cd $OUT && tar czf run50.tgz run50 && rm -rf run50
