#!/usr/bin/env bash
# Times every exchange mode of the LASP-2 backward (examples' lasp2_backward) at W = 1, 2, 4, ...
# up to the node's GPU count on the three per-GPU shapes of the forward benchmark (B=4, T=8K;
# B=1, T=32K; B=1, T=128K per GPU; H=16, D=128), after its checks, and merges the rows into
# $OUT/lasp2_backward.json with the device, commit and date.
#
#   OUT=/tmp/lasp2 bash benches/lasp2-backward-bench.sh
# LASP2_BENCH_WORLDS: the W values (default 1 2 4 .. up to the GPU count).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
lasp_binaries
OUT="${OUT:-$PWD/lasp2-bench-out}"
mkdir -p "$OUT"
SHAPES=(4x8192x16x128 1x32768x16x128 1x131072x16x128)
NGPU="$(nvidia-smi -L | wc -l)"
DEVICE="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NGPU"
WORLDS="${LASP2_BENCH_WORLDS:-$(w=1; while [ "$w" -le "$NGPU" ]; do printf '%s ' "$w"; w=$((w * 2)); done)}"
for W in $WORLDS; do
  time_args=()
  for s in "${SHAPES[@]}"; do time_args+=(--time "$s"); done
  "$BIN/lasp-run" --timeout 500 -n "$W" "$BIN/lasp2_backward" --graph-calls 10 "${time_args[@]}" \
    --json "$OUT/lasp2_backward_w$W.json" 2>&1 | tee "$OUT/lasp2_backward_w$W.log" | grep -E "^\[rank 0\] (backward|PE 0)" || true
  [ -f "$OUT/lasp2_backward_w$W.json" ] || { echo "lasp2-backward-bench: W=$W produced no results (see $OUT/lasp2_backward_w$W.log)"; exit 1; }
done
python3 - "$OUT" "$DEVICE" "$LASP_COMMIT" "$WORLDS" <<'PY'
import datetime, json, sys
out, device, commit, worlds = sys.argv[1:5]
rows = [r for w in worlds.split() for r in json.load(open(f"{out}/lasp2_backward_w{w}.json"))]
doc = {"device": device, "commit": commit, "date": datetime.date.today().isoformat(),
       "what": "LASP-2 backward (dq, dk, dv, dg, dh0 of one layer call), median ms per call, "
               "slowest rank; no_comm = the same kernels without the exchange", "rows": rows}
json.dump(doc, open(f"{out}/lasp2_backward.json", "w"), indent=1)
print(f"lasp2-backward-bench: {len(rows)} rows -> {out}/lasp2_backward.json")
PY
