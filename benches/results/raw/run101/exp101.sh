#!/usr/bin/env bash
# Run 101 (4x H200): NVLink push (remote stores) against pull (remote loads), all-gather pattern,
# standalone program (pushpull.cu, one process, peer access), 64 and 128 CTAs per GPU.
set -uo pipefail
R=$OUT/run101; mkdir -p $R
for c in 64 128; do timeout 60 .bundle/var/pushpull $c > $R/pushpull_c$c.txt 2>&1; echo "ctas $c rc $?"; cat $R/pushpull_c$c.txt; done
cd $OUT && tar czf run101.tgz run101 && rm -rf run101
