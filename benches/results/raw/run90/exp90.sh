#!/usr/bin/env bash
# Run 90: the scalar-decay backward (three chunkwise passes, two of them time-reversed, and the
# gate-gradient kernels) against the CPU f64 reference; the forward's check after the shared loops
# gained the reversed time axis; then forward and backward timed on the three benchmark shapes.
set -uo pipefail
O=$OUT/run90; mkdir -p $O
nvidia-smi -L > $O/gpus.txt
source scripts/gpu-env.sh
t0=$(date +%s)
timeout 300 .bundle/bin/backward_check > $O/backward_check.log 2>&1; echo "backward_check rc=$? $(( $(date +%s) - t0 ))s"
grep -E "^(FAIL|backward_check)" $O/backward_check.log | cut -c1-400
grep -E "^PASS" $O/backward_check.log | cut -c1-200 | head -60
t0=$(date +%s)
timeout 300 .bundle/bin/forward_check > $O/forward_check.log 2>&1; echo "forward_check rc=$? $(( $(date +%s) - t0 ))s"
grep -E "^(FAIL|forward_check)" $O/forward_check.log | cut -c1-300
t0=$(date +%s)
LASP_COMMIT=$(head -c 12 .bundle/commit) LASP_DATE=$(date -u +%FT%TZ) timeout 400 .bundle/bin/forward_bench --backward --out $O/backward_bench.json > $O/backward_bench.log 2>&1
echo "forward_bench --backward rc=$? $(( $(date +%s) - t0 ))s"; cat $O/backward_bench.log | cut -c1-300
cd $OUT && tar czf run90.tgz run90 && rm -rf run90
