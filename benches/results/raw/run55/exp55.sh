#!/usr/bin/env bash
# Run 55: at 2930d75 (kernels and host code as a974a6f / daef188), the full GPU test suite with
# fla installed (so its forward_bench check runs too), then lasp2_forward at W = 4 on the three
# benchmark shapes (per-rank medians through NcclComm::gather_f64, changed in daef188).
set -uo pipefail
O=$OUT/run55; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
OUT=$O/gpu-test bash scripts/gpu-test.sh 2>&1 | tee $O/gpu-test.txt | grep -E "PASS|FAIL|passed|speedup|gbps" | tail -30
T="--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128"
timeout 200 .bundle/bin/lasp-run --timeout 190 -n 4 .bundle/bin/lasp2_forward $T --json $O/w4.json > $O/w4.log 2>&1; echo "w4 rc=$?"
grep -E "^\[rank 0\] W=" $O/w4.log | head -3 | cut -c1-200
cd $OUT && tar czf run55.tgz run55 && rm -rf run55
