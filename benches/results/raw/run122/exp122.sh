#!/usr/bin/env bash
# Run 122 (8x H200, issue 6): the LASP-2 forward benchmark at W = 1, 2, 4, 8 on the three per-GPU
# shapes, every mode, the fla + NCCL peer, timelines (benches/lasp2-bench.sh).
set -uo pipefail
R=$OUT/run122; mkdir -p $R/bench/tl
nvidia-smi -L > $R/gpus.txt; nvidia-smi topo -m >> $R/gpus.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
LASP2_PEER=.peers/lasp2_fla_baseline.py OUT=$R/bench LASP2_ARGS="--timeline $R/bench/tl/tl" timeout 540 bash benches/lasp2-bench.sh > $R/bench.txt 2>&1; echo "lasp2-bench rc=$? after $SECONDS s" | tee -a $R/bench.txt
tail -22 $R/bench.txt
cd $OUT && tar czf run122.tgz run122 && rm -rf run122
