#!/usr/bin/env bash
# The mLSTM forward and backward against mlstm_kernels' TFLA kernels on one GPU, in one command:
# mlstm_bench times ours (forward; forward+backward; backward) in three processes (the median of
# their medians goes to ours.json) and dumps the inputs, dh and our outputs and gradients, then
# benches/tfla_mlstm.py runs TFLA's forward and forward+backward at chunk sizes 64, 128 and 256 on
# the same inputs in three processes of its own, checks agreement (h, dq, dk, dv: rel err <= 1e-2)
# and writes the merged JSON.
#
#   bash scripts/mlstm-bench.sh                                # B=4,T=8K / B=1,T=32K / B=1,T=128K, H=16, D=128
#   MLSTM_BENCH_SHAPES=2x4096x16x64 bash scripts/mlstm-bench.sh
#
# Output: $OUT/mlstm.json (OUT defaults to ./gpu-test-out; copy it to benches/results/mlstm.json to
# record it). The dump (about 6 GB for the default shapes) goes to $MLSTM_BENCH_DUMP or a
# temporary folder, removed at the end. mlstm_kernels 2.0.6 must be importable by python3 (e.g. its
# wheel unpacked on PYTHONPATH, with einops).
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
set -euo pipefail
OUT="${OUT:-$PWD/gpu-test-out}"
mkdir -p "$OUT"
lasp_binaries -p lasp-shmem-benches --bin mlstm_bench
DUMP="${MLSTM_BENCH_DUMP:-$(mktemp -d "${TMPDIR:-/tmp}/lasp-mlstm.XXXXXX")}"
mkdir -p "$DUMP"
trap 'rm -rf "$DUMP"' EXIT
shape_args=()
if [ -n "${MLSTM_BENCH_SHAPES:-}" ]; then shape_args=(--shapes "$MLSTM_BENCH_SHAPES"); fi
for i in 1 2; do "$BIN/mlstm_bench" "${shape_args[@]}" --out "$DUMP/ours_$i.json"; done
"$BIN/mlstm_bench" "${shape_args[@]}" --dump "$DUMP"
# ours_fwd_ms, ours_fwdbwd_ms, ours_bwd_ms: the median of the three processes' medians; each
# process's forward and forward+backward kept beside them.
python3 - "$DUMP" <<'PY'
import json, statistics, sys
from pathlib import Path
d = Path(sys.argv[1])
ours = json.loads((d / "ours.json").read_text())
runs = [json.loads((d / f"ours_{i}.json").read_text()) for i in (1, 2)] + [dict(ours)]
for row in ours["shapes"]:
    for key in ("ours_fwd_ms", "ours_fwdbwd_ms", "ours_bwd_ms"):
        per = [next(s for s in r["shapes"] if s["name"] == row["name"])[key] for r in runs]
        if key != "ours_bwd_ms":
            row[key + "_per_process"] = per
        row[key] = statistics.median(per)
(d / "ours.json").write_text(json.dumps(ours, indent=2) + "\n")
PY
PYTHONUNBUFFERED=1 python3 benches/tfla_mlstm.py --dump "$DUMP" --out "$OUT/mlstm.json"
