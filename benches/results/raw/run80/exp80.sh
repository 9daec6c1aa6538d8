#!/usr/bin/env bash
# Run 80: scripts/forward-ab.sh's first run (bundle of the commit that adds it, baseline a2ceb13),
# two passes: checks the script and times the tensor-copy two-role kernel once more.
set -uo pipefail
OUT=$OUT/run80 FORWARD_AB_PASSES=2 bash scripts/forward-ab.sh; echo "forward-ab rc=$?"
cd $OUT && tar czf run80.tgz run80 && rm -rf run80
