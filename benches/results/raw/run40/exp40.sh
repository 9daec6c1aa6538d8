#!/usr/bin/env bash
# Run 40: two-role output kernel at two CTAs per SM (2 stages, launch bounds (256, 2), 128 registers)
# for every plan (var) against the base (6915430: two-role only at S = 1, 4 stages) in one job.
set -uo pipefail
source scripts/gpu-env.sh
O=$OUT/run40; mkdir -p $O
nvidia-smi -L
.bundle/var/forward_check > $O/var_forward_check.log 2>&1; echo "var forward_check rc=$?"; grep -E "^(FAIL|forward_check:)" $O/var_forward_check.log | head -20
for b in bin var var bin; do
  echo "== $b"; .bundle/$b/forward_bench > $O/${b}_fwd.log 2>&1; grep -h "^B=" $O/${b}_fwd.log; done
for ta in 264 396; do echo "== var target $ta"; .bundle/var/forward_bench --target-ctas $ta > $O/var_t$ta.log 2>&1; grep -h "^B=" $O/var_t$ta.log; done
echo "== bin target 396"; .bundle/bin/forward_bench --target-ctas 396 > $O/bin_t396.log 2>&1; grep -h "^B=" $O/bin_t396.log
cd $OUT && tar czf run40.tgz run40 && rm -rf run40
