#!/usr/bin/env bash
# Run 103 (4x H200): gpu-test at add6df5 (the all-gather's items peer by peer), with the exchange
# benchmark in five processes (-> exchange.json).
set -uo pipefail
R=$OUT/run103; mkdir -p $R
OUT=$R/gpu-test timeout 560 bash scripts/gpu-test.sh > $R/gpu-test.txt 2>&1; echo "gpu-test rc $?" | tee -a $R/gpu-test.txt
grep -E "^(PASS|FAIL|gpu-test)" $R/gpu-test.txt | cut -c1-150
grep -h "speedup_vs_nccl\|gbps_egress\|pingpong" $R/gpu-test/exchange.json
cd $OUT && tar czf run103.tgz run103 && rm -rf run103
