#!/usr/bin/env bash
# Run 99 (4x H200): the C ABI's backward from PyTorch (lasp2_torch: forward checks, LASP-2 and
# single-GPU gradients through torch.autograd against the float64 reference, modes bitwise,
# then --time: forward and backward in every mode), and the C example after the ABI refactor.
set -uo pipefail
source scripts/gpu-env.sh
R=$OUT/run99; mkdir -p $R
B=.bundle/bin
nvidia-smi -L > $R/gpus.txt
timeout 420 python3 -m torch.distributed.run --standalone --nproc-per-node 4 examples/python/lasp2_torch.py \
  --lib $B/liblasp_shmem.so --time > $R/lasp2_torch_w4.log 2>&1; echo "lasp2_torch W=4 rc $?" | tee -a $R/summary.txt
grep "^rank" $R/lasp2_torch_w4.log | tail -40
timeout 120 $B/lasp-run --timeout 110 -n 4 $B/lasp2_forward_c --graph-calls 1000 > $R/lasp2_forward_c_w4.log 2>&1; echo "lasp2_forward_c W=4 rc $?" | tee -a $R/summary.txt
tail -3 $R/lasp2_forward_c_w4.log
cd $OUT && tar czf run99.tgz run99 && rm -rf run99
