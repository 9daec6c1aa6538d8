#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, synccheck and initcheck over the single-GPU kernels of
# scalar decay, Gated DeltaNet and mLSTM: the GPU tests' small forward and backward cases and their
# rejection checks (every kernel of those forwards, the backward and their plans runs there) under
# each tool. Each test runs in the process
# the sanitizer starts: the test executable (examples/tests/gpu) runs a test's checks itself when
# LASP_GPU_TEST_CHILD names it, as in the child process it starts for them otherwise. Prints each
# tool's error count and writes them as JSON to $OUT/sanitizer.json ({"memcheck": 0, ...}); exits
# 1 if any tool reports an error or a check fails under it.
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
lasp_gpu_tests || exit 1
SANITIZER="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"

status=0
json="{"
for tool in memcheck racecheck synccheck initcheck; do
  errors=0
  for check in forward::small_cases_match_the_f64_reference forward::bad_arguments_are_rejected_before_any_launch \
    backward::small_cases_match_the_f64_reference backward::bad_arguments_are_rejected_before_any_launch \
    gated_delta::gated_delta_small_cases_match_the_f64_reference \
    mlstm::mlstm_small_cases_match_the_f64_reference mlstm::mlstm_bad_arguments_are_rejected_before_any_launch \
    mlstm_backward::mlstm_backward_small_cases_match_the_f64_reference; do
    log="$OUT/sanitize-$tool-${check//::/-}.log"
    LASP_GPU_TEST_CHILD="$check" NVSHMEM_DISABLE_NCCL=1 "$SANITIZER" --tool "$tool" --error-exitcode 99 \
      --print-limit 20 "${GPU_TESTS[0]}" --exact "$check" --nocapture --test-threads=1 >"$log" 2>&1
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
    elif [ "$code" -eq 0 ] && ! grep -q "^gpu test child: every check passed" "$log"; then
      echo "sanitize: $check ran no checks under $tool (was the test renamed?); last lines:"
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
