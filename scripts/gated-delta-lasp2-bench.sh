#!/usr/bin/env bash
# Gated DeltaNet's LASP-2 against fla's own context parallelism, in one job: for W = 1, 2, 4, ... up
# to every GPU of the node (or GDN_LASP2_WORLDS), the checks of gated_delta_lasp2 (the f64
# reference, every mode and graph replays bitwise equal), then GDN_LASP2_PROCESSES (default 3)
# processes of each side in turns: ours (gated_delta_lasp2 --no-check --time; then, unless
# GDN_LASP2_STEP=0, the training step's forward and backward, --with-backward, which has no peer)
# and the peer (benches/gated_delta_cp_peer.py). benches/gated_delta_report.py merges the medians over processes
# into $OUT/gated_delta.json (a copy of benches/results/gated_delta.json, when there is one; copy
# it back to record it) after every round, so that a job cut short keeps every process that
# finished.
#
#   OUT=out bash scripts/gated-delta-lasp2-bench.sh
#   GDN_LASP2_WORLDS="4" GDN_LASP2_PROCESSES=2 OUT=out bash scripts/gated-delta-lasp2-bench.sh
#   GDN_LASP2_SHAPES="2x4096x16x128 8x1024x16x128" ...   # per-GPU BxT_localxHxD, H and D the same for all
#
# Needs fla-core 0.6.0 (with einops) importable by python3. On a node whose Triton cache is empty
# the peer's first process autotunes fla's kernels for minutes; a TRITON_CACHE_DIR kept from an
# earlier run on the same GPU model avoids it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
OUT="${OUT:-$PWD/gated-delta-lasp2-bench-out}"
mkdir -p "$OUT"
lasp_binaries -p lasp-shmem -p lasp-shmem-examples --bins
read -r -a SHAPES <<<"${GDN_LASP2_SHAPES:-4x8192x16x128 1x32768x16x128 8x2048x16x128 4x4096x16x128}"
PROCESSES="${GDN_LASP2_PROCESSES:-3}"
NGPU="$(nvidia-smi -L | wc -l)"
WORLDS="${GDN_LASP2_WORLDS:-$(w=1; while [ "$w" -le "$NGPU" ]; do printf '%s ' "$w"; w=$((w * 2)); done)}"
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
if [ ! -f "$OUT/gated_delta.json" ] && [ -f benches/results/gated_delta.json ]; then
  cp benches/results/gated_delta.json "$OUT/gated_delta.json"
fi

time_args=()
peer_shapes=""
for s in "${SHAPES[@]}"; do
  IFS=x read -r b t h d <<<"$s"
  time_args+=(--time "$s")
  peer_shapes="$peer_shapes${peer_shapes:+,}${b}x$t"
done
peer_args=(--shapes "$peer_shapes" --heads "$h" --dim "$d")

for W in $WORLDS; do
  run=("$BIN/lasp-run" --timeout 300 -n "$W" "$BIN/gated_delta_lasp2")
  identical=()
  if "${run[@]}" >"$OUT/check_w$W.log" 2>&1 && ! grep -q FAIL "$OUT/check_w$W.log"; then
    identical=(--bit-identical)
    echo "gated-delta-lasp2-bench: W=$W checks passed ($(grep -c PASS "$OUT/check_w$W.log") PASS lines)"
  else
    echo "gated-delta-lasp2-bench: W=$W checks FAILED (see $OUT/check_w$W.log); its rows say bit_identical false"
  fi
  ours=() peers=() steps=()
  for i in $(seq "$PROCESSES"); do
    "${run[@]}" --no-check "${time_args[@]}" --json "$OUT/ours_w${W}_$i.json" >"$OUT/ours_w${W}_$i.log" 2>&1
    ours+=("$OUT/ours_w${W}_$i.json")
    if [ "${GDN_LASP2_STEP:-1}" != 0 ]; then
      "${run[@]}" --no-check --with-backward "${time_args[@]}" --json "$OUT/step_w${W}_$i.json" \
        >"$OUT/step_w${W}_$i.log" 2>&1
      steps+=("$OUT/step_w${W}_$i.json")
    fi
    if timeout 1800 python3 -m torch.distributed.run --standalone --nproc-per-node "$W" benches/gated_delta_cp_peer.py \
      "${peer_args[@]}" --out "$OUT/peer_w${W}_$i.json" >"$OUT/peer_w${W}_$i.log" 2>&1; then
      peers+=("$OUT/peer_w${W}_$i.json")
    else
      echo "gated-delta-lasp2-bench: the peer's process $i failed at W=$W (see $OUT/peer_w${W}_$i.log)"
    fi
    step_args=()
    [ "${#steps[@]}" -eq 0 ] || step_args=(--lasp2-step "${steps[@]}")
    if [ "${#peers[@]}" -gt 0 ]; then
      python3 benches/gated_delta_report.py --device "${W}x $GPU_NAME" "${identical[@]}" \
        --lasp2-ours "${ours[@]}" --lasp2-peer "${peers[@]}" "${step_args[@]}" --into "$OUT/gated_delta.json" \
        >"$OUT/report_w$W.log"
    fi
  done
  [ "${#peers[@]}" -gt 0 ] || { echo "gated-delta-lasp2-bench: no peer process finished at W=$W"; exit 1; }
  cat "$OUT/report_w$W.log"
done
