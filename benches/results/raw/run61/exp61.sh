#!/usr/bin/env bash
# Run 61: the two-role kernel's output warpgroup with A = Q from registers (qreg.diff on ce4dcf1)
# and the same plus the stmatrix bf16 state copy (qreg_stsm.diff), against ce4dcf1 (old):
# forward_check on both, then forward_bench in turns (three shapes), three passes.
set -uo pipefail
O=$OUT/run61; mkdir -p $O
timeout 240 .bundle/bin/forward_check > $O/check_qreg.log 2>&1; echo "check qreg rc=$?"; grep -E "^forward_check:" $O/check_qreg.log | tail -1
timeout 240 .bundle/var/forward_check_qs > $O/check_qs.log 2>&1; echo "check qs rc=$?"; grep -E "^forward_check:" $O/check_qs.log | tail -1
for r in 1 2 3; do
  for v in old qreg qs; do
    bin=.bundle/var/forward_bench_$v; [ $v = qreg ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run61.tgz run61 && rm -rf run61
