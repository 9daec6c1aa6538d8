#!/usr/bin/env bash
# The mLSTM's LASP-2 forward in one job: for W = 1, 2, 4, ... up to every GPU of the node (or
# MLSTM_LASP2_WORLDS), the checks of mlstm_lasp2 (the f64 reference, every mode and graph replays
# bitwise equal), then MLSTM_LASP2_PROCESSES (default 3) processes of `mlstm_lasp2 --no-check
# --time`, every mode in turns in each. benches/mlstm_lasp2_report.py merges the medians over
# processes into $OUT/mlstm.json (a copy of benches/results/mlstm.json, when there is one; copy it
# back to record it) after every W, so that a job cut short keeps every W that finished.
# MLSTM_LASP2_BACKWARD=1 times training steps instead (`--with-backward`: the forward, then the
# backward) into mlstm.json's `lasp2_fwdbwd` rows.
#
#   OUT=out bash scripts/mlstm-lasp2-bench.sh
#   MLSTM_LASP2_WORLDS="4" MLSTM_LASP2_SHAPES="8x2048x16x128" OUT=out bash scripts/mlstm-lasp2-bench.sh
#   MLSTM_LASP2_BACKWARD=1 OUT=out bash scripts/mlstm-lasp2-bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
OUT="${OUT:-$PWD/mlstm-lasp2-bench-out}"
mkdir -p "$OUT"
lasp_binaries -p lasp-shmem -p lasp-shmem-examples --bins
read -r -a SHAPES <<<"${MLSTM_LASP2_SHAPES:-4x8192x16x128 1x32768x16x128 1x131072x16x128 8x2048x16x128}"
PROCESSES="${MLSTM_LASP2_PROCESSES:-3}"
NGPU="$(nvidia-smi -L | wc -l)"
WORLDS="${MLSTM_LASP2_WORLDS:-$(w=1; while [ "$w" -le "$NGPU" ]; do printf '%s ' "$w"; w=$((w * 2)); done)}"
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
if [ ! -f "$OUT/mlstm.json" ] && [ -f benches/results/mlstm.json ]; then
  cp benches/results/mlstm.json "$OUT/mlstm.json"
fi
time_args=()
for s in "${SHAPES[@]}"; do time_args+=(--time "$s"); done
section=(--section lasp2)
if [ -n "${MLSTM_LASP2_BACKWARD:-}" ]; then
  time_args+=(--with-backward)
  section=(--section lasp2_fwdbwd)
fi

for W in $WORLDS; do
  run=("$BIN/lasp-run" --timeout 300 -n "$W" "$BIN/mlstm_lasp2")
  identical=()
  if "${run[@]}" >"$OUT/check_w$W.log" 2>&1 && ! grep -q FAIL "$OUT/check_w$W.log"; then
    identical=(--bit-identical)
    echo "mlstm-lasp2-bench: W=$W checks passed ($(grep -c PASS "$OUT/check_w$W.log") PASS lines)"
  else
    echo "mlstm-lasp2-bench: W=$W checks FAILED (see $OUT/check_w$W.log); its rows say bit_identical false"
  fi
  ours=()
  for i in $(seq "$PROCESSES"); do
    "${run[@]}" --no-check "${time_args[@]}" --json "$OUT/ours_w${W}_$i.json" >"$OUT/ours_w${W}_$i.log" 2>&1
    ours+=("$OUT/ours_w${W}_$i.json")
  done
  python3 benches/mlstm_lasp2_report.py --device "${W}x $GPU_NAME" "${identical[@]}" "${section[@]}" \
    --ours "${ours[@]}" --into "$OUT/mlstm.json"
done
