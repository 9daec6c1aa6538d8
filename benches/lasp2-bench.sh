#!/usr/bin/env bash
# LASP-2 forward benchmark: W = 1, 2, 4, ... up to every GPU of the node (or LASP2_BENCH_WORLDS) on
# the three per-GPU shapes,
# every exchange mode and the no-communication time of the same kernels (examples' lasp2_forward,
# which also re-runs its correctness checks), and the fla + NCCL peer in the same job. Writes
# $OUT/lasp2_forward.json and $OUT/lasp2_weak_scaling.png.
#
#   OUT=/tmp/lasp2 bash benches/lasp2-bench.sh
# LASP2_ARGS: extra arguments for every lasp2_forward run (e.g. "--groups 2 --ctas-per-sm 1", or
# "--timeline DIR/tl" for per-CTA stamps of one overlapped call per shape).
# Needs fla-core 0.6.0 importable by python3 and the peer script (LASP2_PEER; default: the
# project's shared/peers/lasp2_fla_baseline.py beside the checkout, else .peers/).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
OUT="${OUT:-$PWD/lasp2-bench-out}"
mkdir -p "$OUT"
lasp_binaries -p lasp-shmem -p lasp-shmem-examples --bins
PEER="${LASP2_PEER:-../shared/peers/lasp2_fla_baseline.py}"
[ -f "$PEER" ] || PEER=.peers/lasp2_fla_baseline.py
if [ ! -f "$PEER" ]; then
  # Not fatal (our modes are still timed), but the JSON then has no fla_peer_ms: say so up front.
  echo "lasp2-bench: NOTICE: no fla peer script (tried ${LASP2_PEER:-../shared/peers/lasp2_fla_baseline.py} and .peers/); the fla + NCCL peer is skipped and fla_peer_ms stays null. Set LASP2_PEER to lasp2_fla_baseline.py."
fi
SHAPES=(4x8192x16x128 1x32768x16x128 1x131072x16x128)
export LASP_DEVICE="${LASP_DEVICE:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l)}"

NGPU="$(nvidia-smi -L | wc -l)"
WORLDS="${LASP2_BENCH_WORLDS:-$(w=1; while [ "$w" -le "$NGPU" ]; do printf '%s ' "$w"; w=$((w * 2)); done)}"
for W in $WORLDS; do
  time_args=()
  peer_shapes=()
  for s in "${SHAPES[@]}"; do
    IFS=x read -r b t h d <<<"$s"
    time_args+=(--time "$s")
    peer_shapes+=("${b}x$((t * W))x${h}x${d}")
  done
  "$BIN/lasp-run" --timeout 500 -n "$W" "$BIN/lasp2_forward" --graph-calls 10 ${LASP2_ARGS:-} "${time_args[@]}" --json "$OUT/lasp2_w$W.json" \
    2>&1 | tee "$OUT/lasp2_w$W.log" | grep -E "^\[rank 0\] (W=|PE 0)" || true
  [ -f "$OUT/lasp2_w$W.json" ] || { echo "lasp2-bench: W=$W produced no results (see $OUT/lasp2_w$W.log)"; exit 1; }
  if [ -f "$PEER" ]; then
    OUT="$OUT" timeout 900 python3 -m torch.distributed.run --standalone --nproc_per_node="$W" "$PEER" "${peer_shapes[@]}" >"$OUT/peer_w$W.log" 2>&1 \
      || echo "lasp2-bench: the fla peer failed at W=$W (see $OUT/peer_w$W.log)"
  fi
done
python3 benches/lasp2_report.py "$OUT"
