#!/usr/bin/env bash
# Run 83: at cbde3bc (pass 1 as a stream), the full GPU test suite with fla installed, the
# single-GPU forward against fla (GPU_TEST_FORWARD_BENCH) and the exchange benchmark.
set -uo pipefail
O=$OUT/run83; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
GPU_TEST_FORWARD_BENCH=1 OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed|speedup|gbps|^B=" | cut -c1-200 | tail -40
cd $OUT && tar czf run83.tgz run83 && rm -rf run83
