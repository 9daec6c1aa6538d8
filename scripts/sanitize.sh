#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, synccheck and initcheck over every single-GPU kernel:
# the forward and backward checks' small cases (every kernel of the forward, the backward and
# their plans runs there) under each tool. Prints each tool's error count and writes them as JSON
# to $OUT/sanitizer.json ({"memcheck": 0, ...}); exits 1 if any tool reports an error or a check
# fails under it.
#
#   OUT=out bash scripts/sanitize.sh
#
# NVSHMEM_DISABLE_NCCL=1: NVSHMEM's NCCL initialisation makes CUDA API calls that memcheck reports
# as errors of NVSHMEM's own (the checks use no NCCL).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
OUT="${OUT:-$PWD/sanitize-out}"
mkdir -p "$OUT"
lasp_binaries || exit 1
SANITIZER="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"

status=0
json="{"
for tool in memcheck racecheck synccheck initcheck; do
  errors=0
  for check in forward_check backward_check; do
    log="$OUT/sanitize-$tool-$check.log"
    NVSHMEM_DISABLE_NCCL=1 "$SANITIZER" --tool "$tool" --error-exitcode 99 --print-limit 20 \
      "$BIN/$check" --quick >"$log" 2>&1
    code=$?
    # memcheck, synccheck, initcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H
    # hazards displayed (E errors, W warnings)".
    found="$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$log" | tail -n 1 | grep -Eo '[0-9]+$')"
    [ -z "$found" ] && found="$(grep -Eo 'RACECHECK SUMMARY: .*\(([0-9]+) errors' "$log" | tail -n 1 | grep -Eo '[0-9]+ errors' | grep -Eo '[0-9]+')"
    if [ -z "$found" ]; then
      echo "sanitize: $tool on $check printed no error summary (exit $code); last lines:"
      tail -n 10 "$log" | sed 's/^/    /'
      status=1
      found=-1
    elif [ "$code" -ne 0 ] && [ "$found" -eq 0 ]; then
      echo "sanitize: $check failed under $tool (exit $code); last lines:"
      tail -n 10 "$log" | sed 's/^/    /'
      status=1
    fi
    if [ "$found" -gt 0 ]; then
      status=1
      echo "sanitize: first reports of $tool on $check:"
      grep -E '^=========' "$log" | grep -v 'COMPUTE-SANITIZER' | head -n 12 | sed 's/^/    /'
    fi
    [ "$found" -ge 0 ] && errors=$((errors + found))
    echo "sanitize: $tool $check: $found errors (exit $code)"
  done
  json="$json\"$tool\": $errors, "
done
json="${json%, }}"
echo "$json" >"$OUT/sanitizer.json"
echo "sanitize: $json"
exit $status
