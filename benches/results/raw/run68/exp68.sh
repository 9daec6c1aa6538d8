#!/usr/bin/env bash
# Run 68: at a4c139b (the two-role kernel's pipelined state chain; every other kernel as eac3983),
# the full GPU test suite with fla installed (its forward_bench check runs too).
set -uo pipefail
O=$OUT/run68; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed|speedup|gbps" | tail -30
cd $OUT && tar czf run68.tgz run68 && rm -rf run68
