#!/usr/bin/env bash
# Run 63: on top of run 62's pipelined state chain (pipe), three variants of its tail
# (variants.diff, switched by LASP_EXP_SPLIT / LASP_EXP_STSM defined at the top of
# scalar_decay.cuh): split = the update committed as one group per 64-row m-tile and the first
# m-tile's bf16 rows stored while the second's products run; stsm = the bf16 rows by stmatrix;
# splitstsm = both. forward_check on each, then forward_bench (B=4, T=8K) in turns, four passes.
set -uo pipefail
O=$OUT/run63; mkdir -p $O
for v in split stsm splitstsm; do
  timeout 240 .bundle/var/forward_check_$v > $O/check_$v.log 2>&1; echo "check $v rc=$?"; grep -E "^forward_check:" $O/check_$v.log | tail -1
done
for r in 1 2 3 4; do
  for v in old pipe split stsm splitstsm; do
    bin=.bundle/var/forward_bench_$v; [ $v = pipe ] && bin=.bundle/bin/forward_bench
    timeout 100 $bin --shapes 4x8192x16x128 --out $O/$v.$r.json > $O/$v.$r.log 2>&1
    echo "$v.$r $(python3 -c "import json; d=json.load(open('$O/$v.$r.json')); print(' '.join('%.4f' % s['ours_ms'] for s in d['shapes']))")"
  done
done
cd $OUT && tar czf run63.tgz run63 && rm -rf run63
