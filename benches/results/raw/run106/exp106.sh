#!/usr/bin/env bash
# Run 106 (4x H200): after the review refactor of the C ABI's pointer checks (d0fcc0a):
# lasp2_torch and the C example at W = 4.
set -uo pipefail
source scripts/gpu-env.sh
R=$OUT/run106; mkdir -p $R
B=.bundle/bin
timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 4 examples/python/lasp2_torch.py \
  --lib $B/liblasp_shmem.so > $R/lasp2_torch_w4.log 2>&1; echo "lasp2_torch W=4 rc $?" | tee -a $R/summary.txt
grep -h "^rank 0" $R/lasp2_torch_w4.log
timeout 120 $B/lasp-run --timeout 110 -n 4 $B/lasp2_forward_c --graph-calls 1000 > $R/lasp2_forward_c_w4.log 2>&1; echo "lasp2_forward_c W=4 rc $?" | tee -a $R/summary.txt
grep -h "rank 0" $R/lasp2_forward_c_w4.log | tail -6
cd $OUT && tar czf run106.tgz run106 && rm -rf run106
