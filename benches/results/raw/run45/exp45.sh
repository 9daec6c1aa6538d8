#!/usr/bin/env bash
# Run 45: gpu-test at the final commit (exchange benchmark over five processes -> exchange.json).
set -uo pipefail
O=$OUT/run45; mkdir -p $O
OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed|gpu-test|^all-gather|speedup_vs"
cd $OUT && tar czf run45.tgz run45 && rm -rf run45
