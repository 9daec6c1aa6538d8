#!/usr/bin/env bash
# A kernel change timed against a baseline on one GPU: forward_check of the bundle's build, then
# forward_bench of the baseline and of the bundle in turns, FORWARD_AB_PASSES times (default 3),
# so that both see the same node, clocks and neighbours. Needs a bundle with a baseline:
#
#   BUNDLE_BASELINE=<commit> bash scripts/bundle.sh          # on the build machine
#   OUT=out bash scripts/forward-ab.sh [forward_bench options]  # on the GPU node
#
# Output under $OUT: check.log, base.N.json / new.N.json with their logs, and on stdout one line
# per run with ours_ms of every shape. Nothing is timed when forward_check fails.
# FORWARD_AB_LASP2=1 also times LASP-2 on one GPU (W = 1: its states, fold and output kernels, no
# exchange) in turns after that: lasp2_forward's checks and every mode on the three benchmark
# shapes, lasp2.base.N.json / lasp2.new.N.json, one line per run with the overlapped ms per shape.
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
set -uo pipefail
OUT="${OUT:-$PWD/gpu-test-out}"
mkdir -p "$OUT"
bins=(.bundle/bin/forward_check .bundle/bin/forward_bench .bundle/baseline/forward_bench)
if [ "${FORWARD_AB_LASP2:-0}" = 1 ]; then bins+=(.bundle/bin/lasp-run .bundle/bin/lasp2_forward .bundle/baseline/lasp2_forward); fi
for bin in "${bins[@]}"; do
  if [ ! -x "$bin" ]; then
    echo "forward-ab: $bin not found; build the bundle with BUNDLE_BASELINE=<commit> bash scripts/bundle.sh" >&2
    exit 1
  fi
done
echo "forward-ab: new $(tr '\n' ' ' <.bundle/commit), baseline $(cat .bundle/baseline/commit)"

timeout 600 .bundle/bin/forward_check >"$OUT/check.log" 2>&1
rc=$?
grep -E "^forward_check:|FAIL" "$OUT/check.log" | tail -5
if [ $rc -ne 0 ]; then
  echo "forward-ab: forward_check failed (rc $rc), nothing timed; see $OUT/check.log" >&2
  exit 1
fi

for pass in $(seq 1 "${FORWARD_AB_PASSES:-3}"); do
  for build in base new; do
    bin=.bundle/bin/forward_bench
    [ $build = base ] && bin=.bundle/baseline/forward_bench
    json="$OUT/$build.$pass.json"
    if ! timeout 300 "$bin" --out "$json" "$@" >"$OUT/$build.$pass.log" 2>&1; then
      echo "forward-ab: $build pass $pass failed; see $OUT/$build.$pass.log" >&2
      exit 1
    fi
    echo "$build.$pass $(python3 -c "import json, sys; print(' '.join('%.4f' % s['ours_ms'] for s in json.load(open(sys.argv[1]))['shapes']))" "$json")"
  done
done

if [ "${FORWARD_AB_LASP2:-0}" = 1 ]; then
  shapes=(--time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128)
  for pass in $(seq 1 "${FORWARD_AB_PASSES:-3}"); do
    for build in base new; do
      bin=.bundle/bin/lasp2_forward
      [ $build = base ] && bin=.bundle/baseline/lasp2_forward
      json="$OUT/lasp2.$build.$pass.json"
      if ! .bundle/bin/lasp-run --timeout 300 -n 1 "$bin" --graph-calls 10 "${shapes[@]}" --json "$json" \
        >"$OUT/lasp2.$build.$pass.log" 2>&1; then
        echo "forward-ab: lasp2 $build pass $pass failed; see $OUT/lasp2.$build.$pass.log" >&2
        exit 1
      fi
      echo "lasp2.$build.$pass $(python3 -c "import json, sys; print(' '.join('%.4f' % r['overlapped_ms'] for r in json.load(open(sys.argv[1]))))" "$json")"
    done
  done
fi
