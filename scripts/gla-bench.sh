#!/usr/bin/env bash
# The GLA forward and forward+backward against fla's chunk_gla on one GPU, in one command:
# gla_bench times ours in three processes (the median of their medians goes to ours.json) and
# dumps the inputs, our output and our gradients, then benches/fla_gla.py runs fla on the same
# inputs in three processes of its own, checks agreement (o, dq, dk, dv: rel err <= 5e-3; dg
# <= 1e-2) and writes the merged JSON.
#
#   bash scripts/gla-bench.sh                                  # B=4,T=8K / B=1,T=32K / B=1,T=128K, H=16, D=128
#   GLA_BENCH_SHAPES=2x4096x16x64 bash scripts/gla-bench.sh
#
# Output: $OUT/gla.json (OUT defaults to ./gpu-test-out; copy it to benches/results/gla.json to
# record it). The dump (about 4 GB for the default shapes) goes to $GLA_BENCH_DUMP or a temporary
# folder, removed at the end. fla-core must be importable (e.g. its wheel unpacked on PYTHONPATH).
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
set -euo pipefail
OUT="${OUT:-$PWD/gpu-test-out}"
mkdir -p "$OUT"
lasp_binaries -p lasp-shmem-benches --bin gla_bench
DUMP="${GLA_BENCH_DUMP:-$(mktemp -d "${TMPDIR:-/tmp}/lasp-gla.XXXXXX")}"
mkdir -p "$DUMP"
trap 'rm -rf "$DUMP"' EXIT
shape_args=()
if [ -n "${GLA_BENCH_SHAPES:-}" ]; then shape_args=(--shapes "$GLA_BENCH_SHAPES"); fi
for i in 1 2; do "$BIN/gla_bench" "${shape_args[@]}" --out "$DUMP/ours_$i.json"; done
"$BIN/gla_bench" "${shape_args[@]}" --dump "$DUMP"
# ours_fwd_ms, ours_fwdbwd_ms: the median of the three processes' medians; each process's kept
# beside it.
python3 - "$DUMP" <<'PY'
import json, statistics, sys
from pathlib import Path
d = Path(sys.argv[1])
ours = json.loads((d / "ours.json").read_text())
runs = [json.loads((d / f"ours_{i}.json").read_text()) for i in (1, 2)] + [dict(ours)]
for row in ours["shapes"]:
    for key in ("ours_fwd_ms", "ours_fwdbwd_ms"):
        per = [next(s for s in r["shapes"] if s["name"] == row["name"])[key] for r in runs]
        row[key + "_per_process"] = per
        row[key] = statistics.median(per)
(d / "ours.json").write_text(json.dumps(ours, indent=2) + "\n")
PY
PYTHONUNBUFFERED=1 python3 benches/fla_gla.py --dump "$DUMP" --out "$OUT/gla.json"
