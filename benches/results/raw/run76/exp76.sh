#!/usr/bin/env bash
# Run 76: at 833d503 (the two-role kernel fed by a loading warp through the Tensor Memory Accelerator),
# the full GPU test suite with fla installed (its forward_bench check runs too).
set -uo pipefail
O=$OUT/run76; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed|speedup|gbps" | tail -30
cd $OUT && tar czf run76.tgz run76 && rm -rf run76
