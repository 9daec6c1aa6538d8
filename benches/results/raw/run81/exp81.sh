#!/usr/bin/env bash
# Run 81: streaming states loop (uncommitted, on ce79098) against ce79098, one H200.
cd "$(dirname "$0")/../.."
nvidia-smi -L
OUT=$OUT/run81 FORWARD_AB_PASSES=3 FORWARD_AB_LASP2=1 bash scripts/forward-ab.sh
rc=$?
cd $OUT && tar czf run81.tgz run81
exit $rc
