#!/usr/bin/env bash
# A kernel change timed against a baseline on one GPU: the forward's GPU tests of the bundle's
# build (.bundle/tests/gpu forward::), then forward_bench of the baseline and of the bundle in
# turns, FORWARD_AB_PASSES times (default 3), so that both see the same node, clocks and
# neighbours. Needs a bundle with a baseline:
#
#   BUNDLE_BASELINE=<commit> bash scripts/bundle.sh          # on the build machine
#   OUT=out bash scripts/forward-ab.sh [forward_bench options]  # on the GPU node
#
# Output under $OUT: check.log, base.N.json / new.N.json with their logs, and on stdout one line
# per run with ours_ms of every shape. Nothing is timed when a forward test fails.
# FORWARD_AB_LASP2=1 also times LASP-2 on one GPU (W = 1: its states, fold and output kernels, no
# exchange) in turns after that: lasp2_forward's checks and every mode on the three benchmark
# shapes, lasp2.base.N.json / lasp2.new.N.json, one line per run with the overlapped ms per shape.
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
set -uo pipefail
OUT="${OUT:-$PWD/gpu-test-out}"
mkdir -p "$OUT"
bins=(.bundle/tests/gpu .bundle/bin/forward_bench .bundle/baseline/forward_bench)
if [ "${FORWARD_AB_LASP2:-0}" = 1 ]; then bins+=(.bundle/bin/lasp-run .bundle/bin/lasp2_forward .bundle/baseline/lasp2_forward); fi
for bin in "${bins[@]}"; do
  if [ ! -x "$bin" ]; then
    echo "forward-ab: $bin not found; build the bundle with BUNDLE_BASELINE=<commit> bash scripts/bundle.sh" >&2
    exit 1
  fi
done
echo "forward-ab: new $(tr '\n' ' ' <.bundle/commit), baseline $(cat .bundle/baseline/commit)"

timeout 900 .bundle/tests/gpu forward:: --test-threads=1 >"$OUT/check.log" 2>&1
rc=$?
grep -E "^test result:|FAIL" "$OUT/check.log" | tail -5
if [ $rc -ne 0 ]; then
  echo "forward-ab: the forward tests failed (rc $rc), nothing timed; see $OUT/check.log" >&2
  exit 1
fi

# turns PREFIX PROGRAM RUN SUMMARY: FORWARD_AB_PASSES times, the baseline's PROGRAM and then the
# bundle's, each through the function RUN (arguments: the binary, its JSON file), its output in
# $OUT/PREFIX{base,new}.N.{json,log}; one line per run with what the Python expression SUMMARY
# prints of the JSON (sys.argv[1]). Stops at the first failed run.
turns() {
  local prefix="$1" program="$2" run="$3" summary="$4" pass build bin name
  for pass in $(seq 1 "${FORWARD_AB_PASSES:-3}"); do
    for build in base new; do
      bin=.bundle/bin/$program
      [ $build = base ] && bin=.bundle/baseline/$program
      name="$prefix$build.$pass"
      if ! "$run" "$bin" "$OUT/$name.json" >"$OUT/$name.log" 2>&1; then
        echo "forward-ab: $name failed; see $OUT/$name.log" >&2
        exit 1
      fi
      echo "$name $(python3 -c "$summary" "$OUT/$name.json")"
    done
  done
}

forward_args=("$@")
run_forward() { timeout 300 "$1" --out "$2" "${forward_args[@]}"; }
turns "" forward_bench run_forward \
  "import json, sys; print(' '.join('%.4f' % s['ours_ms'] for s in json.load(open(sys.argv[1]))['shapes']))"

if [ "${FORWARD_AB_LASP2:-0}" = 1 ]; then
  run_lasp2() {
    .bundle/bin/lasp-run --timeout 300 -n 1 "$1" --graph-calls 10 \
      --time 4x8192x16x128 --time 1x32768x16x128 --time 1x131072x16x128 --json "$2"
  }
  turns lasp2. lasp2_forward run_lasp2 \
    "import json, sys; print(' '.join('%.4f' % r['overlapped_ms'] for r in json.load(open(sys.argv[1]))))"
fi
