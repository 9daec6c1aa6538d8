#!/usr/bin/env bash
# Run 54: the two-role output kernel with two output warpgroups (g2, the working tree) against the
# committed one (old, a974a6f) and the new code with one output group (g1): forward_check for g2
# and g1, then forward_bench --probes in turns, default plans and --target-ctas 132 (S = 4 at B=1,
# one CTA per SM, where the plan now takes the two-role kernel).
set -uo pipefail
O=$OUT/run54; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $O/smi_start.csv
for c in g2:.bundle/bin/forward_check g1:.bundle/var/forward_check_g1; do
  echo "== check ${c%%:*}"; timeout 240 ${c#*:} > $O/check_${c%%:*}.log 2>&1; echo rc=$?
  grep -E "^(FAIL|forward_check:)" $O/check_${c%%:*}.log | head -5
done
bin_of() { case $1 in old*) echo .bundle/var/forward_bench_old;; g1*) echo .bundle/var/forward_bench_g1;; g2*) echo .bundle/bin/forward_bench;; esac; }
for name in old_1 g1_1 g2_1 g2t_1 g1t_1 g1t_2 g2t_2 g2_2 g1_2 old_2; do
  extra=""; case $name in *t_*) extra="--target-ctas 132";; esac
  echo "== fwd $name"; timeout 200 $(bin_of $name) --probes $extra --out $O/fwd_$name.json > $O/fwd_$name.log 2>&1; echo rc=$?
  python3 -c "
import json,sys; d=json.load(open('$O/fwd_$name.json'))
for s in d['shapes']: print(s['B'], s['T'], 'S', s.get('num_segments'), 'ours %.4f output %.4f' % (s['ours_ms'], s['output_ms']), s.get('output_kernel',''))"
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $O/smi_end.csv
cd $OUT && tar czf run54.tgz run54 && rm -rf run54
