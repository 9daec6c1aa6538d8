#!/usr/bin/env bash
# Run 70: whole-chunk copies without per-row bounds in copy_tile_async (fastpath.diff on 314e4ab;
# every kernel that loads chunks) against 314e4ab (pipe): forward_check, then forward_bench (three
# shapes) in turns, three passes.
set -uo pipefail
O=$OUT/run70; mkdir -p $O
timeout 240 .bundle/bin/forward_check > $O/check.log 2>&1; echo "check rc=$?"; grep -E "^forward_check:" $O/check.log | tail -1
for r in 1 2 3; do
  for v in pipe fast; do
    bin=.bundle/var/forward_bench_pipe; [ $v = fast ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run70.tgz run70 && rm -rf run70
