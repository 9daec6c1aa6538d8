#!/usr/bin/env bash
# Run 62: the two-role kernel's state chain software-pipelined (pipe.diff on 0710368: chunk i+1's
# landing wait, gate scan and K~ fragments issued while chunk i's update products run) against
# 0710368 (old, kernels as eac3983): forward_check, then forward_bench in turns, four passes.
set -uo pipefail
O=$OUT/run62; mkdir -p $O
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; echo "check rc=$?"; grep -E "^forward_check:" $O/check.log | tail -1
for r in 1 2 3 4; do
  for v in old pipe; do
    bin=.bundle/var/forward_bench_old; [ $v = pipe ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --shapes 4x8192x16x128 --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run62.tgz run62 && rm -rf run62
