#!/usr/bin/env bash
# Run 105 (4x H200): lasp2_torch at W = 4 after the test helper refactor (Sequences).
set -uo pipefail
source scripts/gpu-env.sh
R=$OUT/run105; mkdir -p $R
timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 4 examples/python/lasp2_torch.py \
  --lib .bundle/bin/liblasp_shmem.so > $R/lasp2_torch_w4.log 2>&1; echo "lasp2_torch W=4 rc $?" | tee -a $R/summary.txt
grep -h "^rank 0" $R/lasp2_torch_w4.log
cd $OUT && tar czf run105.tgz run105 && rm -rf run105
