#!/usr/bin/env bash
# Run 100 (4x H200): lasp2_torch at W = 4, 2, 1 after adding the stacked-calls check and the
# captured forward + backward.
set -uo pipefail
source scripts/gpu-env.sh
R=$OUT/run100; mkdir -p $R
B=.bundle/bin
for w in 4 2 1; do
  timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node $w examples/python/lasp2_torch.py \
    --lib $B/liblasp_shmem.so > $R/lasp2_torch_w$w.log 2>&1; echo "lasp2_torch W=$w rc $?" | tee -a $R/summary.txt
done
grep -h "stacked\|captured\|autograd\|every check\|Error\|error" $R/lasp2_torch_w*.log | head -60
cd $OUT && tar czf run100.tgz run100 && rm -rf run100
