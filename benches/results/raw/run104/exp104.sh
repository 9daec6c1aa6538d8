#!/usr/bin/env bash
# Run 104 (4x H200): the exchange benchmark again, twice five processes, at add6df5 (same
# bundle as run 103), each set merged by benches/exchange_report.py.
set -uo pipefail
source scripts/gpu-env.sh
R=$OUT/run104; mkdir -p $R
B=.bundle/bin
for set in a b; do
  for k in 1 2 3 4 5; do
    timeout 100 $B/lasp-run --timeout 90 -n 4 $B/exchange_bench --out $R/exchange_${set}_run$k.json > $R/exchange_${set}_run$k.log 2>&1 || echo "set $set process $k failed"
  done
  python3 benches/exchange_report.py $R/exchange_$set.json $R/exchange_${set}_run*.json > /dev/null
  echo "set $set:"; grep -h "speedup_vs_nccl_\|gbps_egress_8\|pingpong" $R/exchange_$set.json
  python3 -c "import json;d=json.load(open('$R/exchange_$set.json'));r=[x for x in d['rows'] if x['bytes_per_rank']==4194304][0];print('4MiB ours',r['device_us_runs'],'nccl',r['nccl_us_runs'])"
done
cd $OUT && tar czf run104.tgz run104 && rm -rf run104
