#!/usr/bin/env bash
# Run 93: backward_check and forward_check at the committed backward (after the argument-check refactor).
set -uo pipefail
O=$OUT/run93; mkdir -p $O
source scripts/gpu-env.sh
timeout 300 .bundle/bin/backward_check > $O/backward_check.log 2>&1; echo "backward_check rc=$?"
grep -E "^(FAIL|backward_check)" $O/backward_check.log | cut -c1-300
timeout 300 .bundle/bin/forward_check > $O/forward_check.log 2>&1; echo "forward_check rc=$?"
grep -E "^(FAIL|forward_check)" $O/forward_check.log | cut -c1-300
cd $OUT && tar czf run93.tgz run93 && rm -rf run93
