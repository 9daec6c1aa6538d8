#!/usr/bin/env bash
# Where the scalar-decay output kernel's time goes, on one GPU: forward_bench --probes times the
# forward, the output kernel alone and its memory / compute / no-exp probes on the same shapes and
# input sets (kernels/docs/scalar-decay.md, "Probes", says how to read them). No fla, no dump.
# Binaries come from .bundle/bin (scripts/bundle.sh); about a minute for the default shapes.
#
#   bash scripts/forward-probes.sh                                   # B=4,T=8K / B=1,T=32K / B=1,T=128K, H=16, D=128
#   FORWARD_BENCH_SHAPES=2x4096x16x128 bash scripts/forward-probes.sh
#   FORWARD_BENCH_ARGS="--segments 8" bash scripts/forward-probes.sh  # extra forward_bench options
#
# Output: $OUT/forward_probes.json and $OUT/forward_probes.log (OUT defaults to ./gpu-test-out).
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
set -euo pipefail
OUT="${OUT:-$PWD/gpu-test-out}"
mkdir -p "$OUT"

BIN="$PWD/.bundle/bin"
if [ ! -x "$BIN/forward_bench" ]; then
  echo "forward-probes: $BIN/forward_bench not found; build the bundle with scripts/bundle.sh first" >&2
  exit 1
fi
lasp_binaries  # the bundle is there: sets LASP_COMMIT and LASP_DATE
echo "forward-probes: commit $LASP_COMMIT"

shape_args=()
if [ -n "${FORWARD_BENCH_SHAPES:-}" ]; then shape_args=(--shapes "$FORWARD_BENCH_SHAPES"); fi
# The watchdog ends a hung run within the 2 minutes this script is meant to take.
# shellcheck disable=SC2086
"$BIN/forward_bench" --probes --timeout 110 --out "$OUT/forward_probes.json" "${shape_args[@]}" \
  ${FORWARD_BENCH_ARGS:-} 2>&1 | tee "$OUT/forward_probes.log"
cat "$OUT/forward_probes.json"
