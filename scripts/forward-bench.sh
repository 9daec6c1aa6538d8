#!/usr/bin/env bash
# The scalar-decay forward against fla on one GPU, in one command: forward_bench times ours and
# dumps the inputs and our output into a temporary folder, then benches/fla_forward.py runs fla's
# chunk_simple_gla on the same inputs, checks agreement (rel err <= 5e-3), times it the same way
# and writes the merged JSON. Binaries come from .bundle/bin (scripts/bundle.sh) or are built.
#
#   bash scripts/forward-bench.sh                                   # B=4,T=8K / B=1,T=32K / B=1,T=128K, H=16, D=128
#   FORWARD_BENCH_SHAPES=2x4096x16x128 bash scripts/forward-bench.sh
#   FORWARD_BENCH_ARGS="--segments 8" bash scripts/forward-bench.sh  # extra forward_bench options
#
# Output: $OUT/forward_kernel.json (OUT defaults to ./gpu-test-out; copy it to
# benches/results/forward_kernel.json to record it) and the two programs' logs on stdout.
# The dump (about 3.3 GB for the default shapes) goes to $FORWARD_BENCH_DUMP or a temporary
# folder under ${TMPDIR:-/tmp}, removed at the end unless FORWARD_BENCH_KEEP_DUMP=1.
# fla-core must be importable (e.g. its wheel unpacked on PYTHONPATH).
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
set -euo pipefail
OUT="${OUT:-$PWD/gpu-test-out}"
mkdir -p "$OUT"

lasp_binaries -p lasp-shmem-benches --bin forward_bench

if [ ! -x "$BIN/forward_bench" ]; then
  echo "forward-bench: $BIN/forward_bench not found; rebuild the bundle with scripts/bundle.sh" >&2
  exit 1
fi

DUMP="${FORWARD_BENCH_DUMP:-$(mktemp -d "${TMPDIR:-/tmp}/lasp-forward.XXXXXX")}"
mkdir -p "$DUMP"
if [ -z "${FORWARD_BENCH_KEEP_DUMP:-}" ]; then trap 'rm -rf "$DUMP"' EXIT; fi
echo "forward-bench: commit $LASP_COMMIT, dump in $DUMP ($(df -h --output=avail "$DUMP" | tail -1 | tr -d ' ') free)"

shape_args=()
if [ -n "${FORWARD_BENCH_SHAPES:-}" ]; then shape_args=(--shapes "$FORWARD_BENCH_SHAPES"); fi
# shellcheck disable=SC2086
"$BIN/forward_bench" --dump "$DUMP" "${shape_args[@]}" ${FORWARD_BENCH_ARGS:-}
rc=0
PYTHONUNBUFFERED=1 python3 benches/fla_forward.py --dump "$DUMP" --out "$OUT/forward_kernel.json" || rc=$?
if [ -f "$OUT/forward_kernel.json" ]; then cat "$OUT/forward_kernel.json"; fi
exit "$rc"
