#!/usr/bin/env bash
# Run 118 (4x H200): the whole GPU test suite (scripts/gpu-test.sh, no benchmark) at d8392dd, after
# the backward's restructuring (runs 113-117): exchange, launch and fault drills, forward and
# backward checks, LASP-2 forward and backward with graph replays and silent ranks, the C ABI
# from C and from PyTorch.
set -uo pipefail
R=$OUT/run118; mkdir -p $R
OUT=$R/gpu-test GPU_TEST_SKIP_BENCH=1 timeout 580 bash scripts/gpu-test.sh > $R/gpu-test.txt 2>&1; echo "gpu-test rc=$?" >> $R/gpu-test.txt
grep -E "^(PASS|FAIL|NOTICE|gpu-test)" $R/gpu-test.txt | cut -c1-200
cd $OUT && tar czf run118.tgz run118 && rm -rf run118
