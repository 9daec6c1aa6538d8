#!/usr/bin/env bash
# LASP-2 launch-plan sweep on every GPU of the node: the examples' lasp2_forward (checks, then every
# mode timed) for each head-group count / CTAs-per-SM pair, with the per-CTA timeline of one
# overlapped call per shape. Writes $OUT/tuning_g{G}_c{C}.json / .log and timeline files.
#
#   OUT=/tmp/tuning bash benches/lasp2-tuning.sh                  # default pairs
#   OUT=/tmp/tuning LASP2_TUNINGS="2:1 4:1" bash benches/lasp2-tuning.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
OUT="${OUT:-$PWD/lasp2-tuning-out}"
mkdir -p "$OUT"
lasp_binaries -p lasp-shmem -p lasp-shmem-examples --bins || exit 1
NGPU="$(nvidia-smi -L | wc -l)"
W="${LASP2_TUNING_W:-$NGPU}"
time_args=(--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128)
for pair in ${LASP2_TUNINGS:-2:1 1:1 2:2 1:2 4:1}; do
  IFS=: read -r g c <<<"$pair"
  tag="g${g}_c${c}"
  "$BIN/lasp-run" --timeout 240 -n "$W" "$BIN/lasp2_forward" --graph-calls 10 --groups "$g" --ctas-per-sm "$c" \
    --timeline "$OUT/timeline_$tag" "${time_args[@]}" --json "$OUT/tuning_$tag.json" >"$OUT/tuning_$tag.log" 2>&1 \
    || echo "lasp2-tuning: $tag failed (see $OUT/tuning_$tag.log)"
  grep -h "^\[rank 0\] W=" "$OUT/tuning_$tag.log" || true
done
