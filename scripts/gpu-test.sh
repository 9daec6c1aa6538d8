#!/usr/bin/env bash
# The GPU test suite: runs on a node with NVIDIA GPUs, from a clone with either a Rust toolchain
# or a .bundle/ made by scripts/bundle.sh. Every check prints PASS or FAIL; the last line counts
# them. Logs and JSON results go to $OUT (default: ./gpu-test-out).
#
#   bash scripts/gpu-test.sh            # tests, then the benchmark
#   GPU_TEST_SKIP_BENCH=1 bash scripts/gpu-test.sh
#   GPU_TEST_SKIP_SANITIZE=1 ...     # without compute-sanitizer's four tools (minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
OUT="${OUT:-$PWD/gpu-test-out}"
mkdir -p "$OUT"

lasp_binaries || exit 1
if [ ! -x "$BIN/lasp2_forward_c" ]; then bash scripts/build-c-examples.sh || exit 1; fi
NGPU="$(nvidia-smi -L | wc -l)"
echo "gpu-test: $NGPU GPU(s), commit $LASP_COMMIT, binaries from $BIN"

passed=0; failed=0
check() {  # check NAME COMMAND... : PASS when the command exits 0
  local name="$1"; shift
  local log="$OUT/$name.log"
  local t0=$SECONDS
  if "$@" >"$log" 2>&1; then
    passed=$((passed + 1)); echo "PASS $name ($((SECONDS - t0)) s)"
  else
    failed=$((failed + 1)); echo "FAIL $name ($((SECONDS - t0)) s), last lines of $log:"; tail -n 15 "$log" | sed 's/^/    /'
  fi
}
# expect_failure NAME PATTERN COMMAND...: PASS when the command fails, within 60 s, with a
# one-line message matching PATTERN.
expect_failure() {
  local name="$1" pattern="$2"; shift 2
  local log="$OUT/$name.log"
  if timeout 60 "$@" >"$log" 2>&1; then
    failed=$((failed + 1)); echo "FAIL $name: succeeded but should have failed"; return
  fi
  if grep -q "killed by signal 11" "$log"; then
    failed=$((failed + 1)); echo "FAIL $name: a rank crashed (SIGSEGV) instead of exiting with its error"; return
  fi
  if grep -Eq "$pattern" "$log"; then
    passed=$((passed + 1)); echo "PASS $name: $(grep -Em1 "$pattern" "$log" | cut -c1-220)"
  else
    failed=$((failed + 1)); echo "FAIL $name: no line matching '$pattern'"; tail -n 10 "$log" | sed 's/^/    /'
  fi
}

RUN="$BIN/lasp-run --timeout 300 -n $NGPU"
check exchange_launcher $RUN "$BIN/exchange"
check exchange_mpirun mpirun --allow-run-as-root --oversubscribe -np "$NGPU" -x LD_LIBRARY_PATH -x NVSHMEM_DISABLE_NVLS "$BIN/exchange" --rounds 1000
check epoch_stress_10000 $RUN "$BIN/exchange" --sizes 64K --rounds 10000 --pingpong 0

# A rank killed mid-run: the launcher must end the job, non-zero, within 30 s.
kill_one_rank() {
  $RUN "$BIN/exchange" --sizes 64K --rounds 100000000 --pingpong 0 & local launcher=$!
  sleep 8
  local victim; victim="$(pgrep -n -f "$BIN/exchange --sizes 64K --rounds 100000000")" || return 1
  echo "killing rank pid $victim"; local t0=$SECONDS
  kill -9 "$victim"
  local waited=0
  while kill -0 "$launcher" 2>/dev/null && [ $waited -lt 30 ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$launcher" 2>/dev/null; then echo "launcher still running after 30 s"; kill -9 "$launcher"; return 1; fi
  wait "$launcher"; local code=$?
  echo "launcher exited with code $code after $((SECONDS - t0)) s"
  [ "$code" -ne 0 ]
}
check kill_one_rank_ends_job kill_one_rank
LASP_WAIT_TIMEOUT_MS=3000 expect_failure silent_rank_is_named 'waited [0-9]+ ms for data from PE 1 .*epoch 1' $RUN "$BIN/exchange" --silent-rank 1
expect_failure wrong_nvshmem_path 'could not load libnvshmem_host.so.3 .*/nonexistent' env NVSHMEM_HOME=/nonexistent "$BIN/exchange" --sizes 32K
expect_failure no_gpu 'CUDA .*(no GPU|CUDA_VISIBLE_DEVICES)' env CUDA_VISIBLE_DEVICES= "$BIN/exchange" --sizes 32K
expect_failure too_many_ranks "asked for $((NGPU + 1)) ranks but this node shows $NGPU GPU" "$BIN/lasp-run" -n $((NGPU + 1)) "$BIN/exchange"

check forward_check "$BIN/forward_check"
check backward_check "$BIN/backward_check"
check lasp2_forward_graph_10000 $RUN "$BIN/lasp2_forward" --graph-calls 10000 --no-time
check lasp2_backward_graph_1000 $RUN "$BIN/lasp2_backward" --graph-calls 1000 --no-time
grep -h "^\[rank 0\] PE 0" "$OUT/lasp2_backward_graph_1000.log" || true
grep -h "^\[rank 0\] PE 0" "$OUT/lasp2_forward_graph_10000.log" || true
# A silent rank: every later rank must time out naming it (rank 1 when there are ranks after it).
SILENT=$(( NGPU >= 3 ? 1 : 0 ))
LASP_WAIT_TIMEOUT_MS=3000 expect_failure lasp2_silent_rank_is_named "waited [0-9]+ ms for data from PE $SILENT " $RUN "$BIN/lasp2_forward" --silent-rank $SILENT
# Every PE after the silent one waits for its tiles: each must name it, none another PE.
later_ranks_name_the_silent_rank() {
  local log="$OUT/lasp2_silent_rank_is_named.log" named wrong
  named="$(grep -c "drill error: .*for data from PE $SILENT " "$log")"
  wrong="$(grep -Ec "drill error: .*for data from PE [0-9]+ " "$log")"
  wrong=$((wrong - named))
  echo "$named of $((NGPU - 1 - SILENT)) later ranks name PE $SILENT, $wrong name another PE"
  [ "$named" -eq $((NGPU - 1 - SILENT)) ] && [ "$wrong" -eq 0 ]
}
if [ "$NGPU" -ge 2 ]; then check lasp2_later_ranks_name_the_silent_rank later_ranks_name_the_silent_rank; fi
# The backward's chain runs the other way: every rank BEFORE the silent one waits for its tile.
if [ "$NGPU" -ge 2 ]; then
  SILENT_BWD=$(( NGPU >= 3 ? 1 : NGPU - 1 ))
  LASP_WAIT_TIMEOUT_MS=3000 expect_failure lasp2_backward_silent_rank_is_named "waited [0-9]+ ms for data from PE $SILENT_BWD " $RUN "$BIN/lasp2_backward" --silent-rank $SILENT_BWD
fi
expect_failure lasp2_layout_mismatch_caught 'PEs \[1\] set up a different layout' $RUN "$BIN/lasp2_forward" --mismatch-rank 1
# The C ABI: from C under lasp-run, and from PyTorch under torchrun (bootstrap by unique id).
check lasp2_forward_c $RUN "$BIN/lasp2_forward_c" --graph-calls 1000
grep -h "rank 0:" "$OUT/lasp2_forward_c.log" || true
if python3 -c "import torch" 2>/dev/null; then
  # NVSHMEM's settings come from the environment (the library never writes it); gpu-env.sh
  # already keeps NVLink multicast off, and every rank is on this node.
  check lasp2_torch env NVSHMEM_REMOTE_TRANSPORT=none timeout 600 python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    examples/python/lasp2_torch.py --lib "$BIN/liblasp_shmem.so" ${GPU_TEST_TORCH_TIME:+--time}
  grep -h "^rank " "$OUT/lasp2_torch.log" || true
else
  echo "NOTICE: lasp2_torch skipped: python3 cannot import torch"
fi
grep -hE "^(FAIL|forward_check:|backward_check:)" "$OUT/forward_check.log" "$OUT/backward_check.log" | head -40 || true
# compute-sanitizer's four tools over every single-GPU kernel (a few minutes).
if [ -z "${GPU_TEST_SKIP_SANITIZE:-}" ]; then
  check sanitize env OUT="$OUT" bash scripts/sanitize.sh
  grep -h "^sanitize: .*errors" "$OUT/sanitize.log" || true
fi
# Every gradient against fla's chunk_gla on the same inputs, single GPU and LASP-2 at W = NGPU.
if python3 -c "import torch, fla" 2>/dev/null; then
  sanitized=(); [ -f "$OUT/sanitizer.json" ] && sanitized=(--sanitizer "$OUT/sanitizer.json")
  check gradient_accuracy env NVSHMEM_REMOTE_TRANSPORT=none timeout 900 python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    benches/gradient_accuracy.py --lib "$BIN/liblasp_shmem.so" --out "$OUT/gradient_accuracy.json" \
    "${sanitized[@]}"
  grep -hE "^(PASS|FAIL) " "$OUT/gradient_accuracy.log" || true
else
  echo "NOTICE: gradient_accuracy skipped: python3 cannot import torch and fla (pip install fla-core)"
fi
if [ -n "${GPU_TEST_FORWARD_BENCH:-}" ]; then
  check forward_bench env OUT="$OUT" bash scripts/forward-bench.sh
  grep -h "^B=" "$OUT/forward_bench.log" || true
fi

# The exchange against NCCL in EXCHANGE_PROCESSES separate processes (default 5), merged into
# exchange.json by the median over processes (benches/exchange_report.py says why).
exchange_benchmark() {
  local k
  rm -f "$OUT"/exchange_run*.json
  for k in $(seq 1 "${EXCHANGE_PROCESSES:-5}"); do
    $RUN "$BIN/exchange_bench" --out "$OUT/exchange_run$k.json" || return 1
  done
  python3 benches/exchange_report.py "$OUT/exchange.json" "$OUT"/exchange_run*.json
}
if [ -z "${GPU_TEST_SKIP_BENCH:-}" ]; then
  check exchange_bench exchange_benchmark
  [ -f "$OUT/exchange.json" ] && cat "$OUT/exchange.json"
  grep -h "^all-gather\|ping-pong" "$OUT/exchange_bench.log" || true
fi
echo "gpu-test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
