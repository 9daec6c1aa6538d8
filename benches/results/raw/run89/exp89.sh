#!/usr/bin/env bash
# Run 89: the review refactor (one workspace helper), gpu-test again. The C ABI from C (lasp-run) and from PyTorch (torchrun, unique-id bootstrap), inside the
# GPU test suite (tests only), then the Rust program's timing of the same shape for comparison.
set -uo pipefail
O=$OUT/run89; mkdir -p $O
W=$(nvidia-smi -L | wc -l)
nvidia-smi -L > $O/gpus.txt
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" > $O/torch.txt 2>&1
t0=$(date +%s)
GPU_TEST_SKIP_BENCH=1 GPU_TEST_TORCH_TIME=1 OUT=$O/gpu-test timeout 420 bash scripts/gpu-test.sh > $O/gpu-test.txt 2>&1
echo "gpu-test rc=$? $(( $(date +%s) - t0 ))s"
grep -E "^(PASS|FAIL|gpu-test|NOTICE)|^rank |^\[rank 0\] rank 0" $O/gpu-test.txt | cut -c1-300
source scripts/gpu-env.sh
timeout 120 .bundle/bin/lasp-run --timeout 110 -n "$W" .bundle/bin/lasp2_forward --graph-calls 10 --time 4x8192x16x128 --json $O/rust_time.json > $O/rust_time.log 2>&1
echo "rust timing rc=$?"; grep -h '^\[rank 0\] W=' $O/rust_time.log
cd $OUT && tar czf run89.tgz run89 && rm -rf run89
