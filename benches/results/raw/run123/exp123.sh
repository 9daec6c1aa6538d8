#!/usr/bin/env bash
# Run 123 (8x H200, issue 6): the whole GPU test suite on 8 GPUs, with the exchange benchmark
# (egress, ping-pong, NCCL) at W = 8 in five processes; then the LASP-2 backward benchmark at W = 8.
set -uo pipefail
R=$OUT/run123; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
OUT=$R/gpu-test timeout 400 bash scripts/gpu-test.sh > $R/gpu-test.txt 2>&1; echo "gpu-test rc $? after $SECONDS s" | tee -a $R/gpu-test.txt
grep -E "^(PASS|FAIL|gpu-test)" $R/gpu-test.txt | cut -c1-160
grep -h "speedup_vs_nccl\|gbps_egress\|pingpong" $R/gpu-test/exchange.json
LASP2_BENCH_WORLDS=8 OUT=$R/bwd timeout $((560 - SECONDS)) bash benches/lasp2-backward-bench.sh > $R/bwd.txt 2>&1; echo "backward bench rc $? after $SECONDS s" | tee -a $R/bwd.txt
tail -8 $R/bwd.txt
cd $OUT && tar czf run123.tgz run123 && rm -rf run123
