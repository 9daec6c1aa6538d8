#!/usr/bin/env bash
# Run 84: the LASP-2 benchmark at cbde3bc (W = 1, 2, 4, fla + NCCL peer, timelines).
set -uo pipefail
O=$OUT/run84; mkdir -p $O/bench/tl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
OUT=$O/bench LASP2_ARGS="--timeline $O/bench/tl/tl" bash benches/lasp2-bench.sh > $O/bench.txt 2>&1; echo "lasp2-bench rc=$?"
tail -14 $O/bench.txt
cd $OUT && tar czf run84.tgz run84 && rm -rf run84
