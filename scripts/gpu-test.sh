#!/usr/bin/env bash
# The GPU test suite: runs on a node with NVIDIA GPUs, from a clone with either a Rust toolchain
# or a .bundle/ made by scripts/bundle.sh. First the GPU tests, cargo test executables
# (examples/tests/gpu: the forward and backward against the f64 reference, the exchange, LASP-2 on
# every GPU, their fault drills), then what cannot be a test: a rank killed under the launcher,
# mpirun, the C ABI from C and from PyTorch, the lasp_shmem package (where installed),
# compute-sanitizer, the gradients against fla and the exchange benchmark. Every test and check
# prints PASS, FAIL or SKIP; the last line counts them.
# Logs and JSON results go to $OUT (default: ./gpu-test-out).
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
lasp_gpu_tests || exit 1
if [ ! -x "$BIN/lasp2_forward_c" ]; then bash scripts/build-c-examples.sh || exit 1; fi
NGPU="$(nvidia-smi -L | wc -l)"
echo "gpu-test: $NGPU GPU(s), commit $LASP_COMMIT, binaries from $BIN"

passed=0; failed=0; skipped=0
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
# run_tests EXECUTABLE: every test of a cargo test executable, one PASS, SKIP (a test that passed
# with a skip notice: no GPU, or a drill that needs two) or FAIL line each, a failing one with the
# end of its output.
run_tests() {
  local exe="$1" log="$OUT/tests-$(basename "$1").log" code test result notice
  "$exe" --test-threads=1 --show-output >"$log" 2>"$log.stderr"
  code=$?
  local results; results="$(sed -nE 's/^test (.+) \.\.\. (ok|FAILED)$/\1 \2/p' "$log")"
  while read -r test result; do
    [ -n "$test" ] || continue
    notice="$(grep -F -m1 "NOTICE: skipped $test: " "$log.stderr")"
    if [ "$result" = ok ] && [ -n "$notice" ]; then
      skipped=$((skipped + 1)); echo "SKIP $test: ${notice#*"$test": }"
    elif [ "$result" = ok ]; then
      passed=$((passed + 1)); echo "PASS $test"
    else
      failed=$((failed + 1)); echo "FAIL $test, end of its output in $log:"
      awk -v head="---- $test stdout ----" '$0 == head { on = 1; next } on && (/^---- .* ----$/ || /^failures:$/) { on = 0 } on' \
        "$log" | tail -n 15 | sed 's/^/    /'
    fi
  done <<<"$results"
  if [ "$code" -ne 0 ] && ! grep -q " FAILED$" <<<"$results"; then
    failed=$((failed + 1)); echo "FAIL $(basename "$exe"): exited with $code without a failed test; last lines of $log.stderr:"
    tail -n 10 "$log.stderr" | sed 's/^/    /'
  fi
}
for exe in "${GPU_TESTS[@]}"; do run_tests "$exe"; done
# What LASP-2 reported on PE 0 (the tests' output is indented).
grep -hE "^ +\[rank 0\] PE 0(:| \()" "$OUT"/tests-*.log | sed 's/^ *//' || true

RUN="$BIN/lasp-run --timeout 300 -n $NGPU"
check exchange_mpirun mpirun --allow-run-as-root --oversubscribe -np "$NGPU" -x LD_LIBRARY_PATH -x NVSHMEM_DISABLE_NVLS "$BIN/exchange" --rounds 1000

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
# The lasp_shmem package where it is installed (pip install --no-deps dist/lasp_shmem-*.whl): its
# tests on one GPU (with the library's own checks of descriptors), then LASP-2 through it on every
# GPU. The tests that need no GPU (the *_cpu files, the training report's) are CI's.
if python3 -c "import torch, pytest, lasp_shmem.torch" 2>/dev/null; then
  check python_package env NVSHMEM_REMOTE_TRANSPORT=none timeout 900 python3 -m pytest -rs python/tests/test_gpu.py python/tests/test_abi.py
  check python_package_lasp2 env NVSHMEM_REMOTE_TRANSPORT=none timeout 900 python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    -m pytest -rs python/tests/test_lasp2.py
  # Guest mode: PyTorch's SymmetricMemory starts NVSHMEM, lasp_shmem joins it (a process of its own).
  if [ "$NGPU" -ge 2 ]; then
    check python_package_guest env LASP_TEST_GUEST=1 NVSHMEM_REMOTE_TRANSPORT=none timeout 600 python3 -m torch.distributed.run --standalone \
      --nproc-per-node "$NGPU" -m pytest -rs python/tests/test_guest.py
  fi
  grep -h "passed\|failed" "$OUT"/python_package*.log || true
else
  echo "NOTICE: python_package skipped: python3 cannot import torch, pytest and lasp_shmem (pip install --no-deps dist/lasp_shmem-*.whl)"
fi
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
# mLSTM's forward and backward against mlstm_kernels' TFLA on the same inputs: agreement, then both timed.
if python3 -c "import torch, mlstm_kernels.torch.chunkwise.triton_xl_chunk" 2>/dev/null; then
  check mlstm_bench env OUT="$OUT" MLSTM_BENCH_SHAPES="${MLSTM_BENCH_SHAPES:-4x8192x16x128}" bash scripts/mlstm-bench.sh
  grep -h "^B=" "$OUT/mlstm_bench.log" || true
else
  echo "NOTICE: mlstm_bench skipped: python3 cannot import torch and mlstm_kernels (mlstm_kernels 2.0.6 and einops on PYTHONPATH)"
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
echo "gpu-test: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
