#!/usr/bin/env bash
# All-gather variants on a GPU node, in one command (about 3 minutes on 4 GPUs): for every kernel
# variant the word-by-word check (32 KiB .. 32 MiB) and the 10,000-round epoch stress, then
# exchange_bench with the harness floor and batched timings, other thread counts, the dynamic
# variant's chunk sizes, a CTA sweep of the variant fastest at 4 MiB, and a repeat of every variant
# so run-to-run noise is visible. One failure is recorded and the rest still runs. Logs, JSON and
# summary.txt go to $OUT (default: ./exchange-sweep-out).
#
#   OUT=/tmp/sweep bash scripts/exchange-sweep.sh
#   OUT=/tmp/sweep8 EXCHANGE_SWEEP_W=8 bash scripts/exchange-sweep.sh   # W = 8 on an 8-GPU node
#
# Uses .bundle/bin (scripts/bundle.sh) when present, else builds with cargo.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
OUT="${OUT:-$PWD/exchange-sweep-out}"
mkdir -p "$OUT"

lasp_binaries || exit 1
NGPU="$(nvidia-smi -L | wc -l)"
# The acceptance numbers are for W = 4; EXCHANGE_SWEEP_W sweeps another world size (up to NGPU).
W="${EXCHANGE_SWEEP_W:-$((NGPU < 4 ? NGPU : 4))}"
if [ "$W" -gt "$NGPU" ]; then echo "exchange-sweep: EXCHANGE_SWEEP_W=$W but this node shows $NGPU GPU(s)"; exit 1; fi
VARIANTS=(cta-loop peer-major dynamic)
BENCH_SIZES=1M,4M,8M,32M
# Past this many seconds the remaining steps are skipped (and listed) so the run stays near 4 min.
BUDGET_S="${EXCHANGE_SWEEP_BUDGET_S:-215}"
RUN="$BIN/lasp-run --timeout 90 -n $W"
echo "exchange-sweep: W=$W of $NGPU GPU(s), commit $LASP_COMMIT, binaries from $BIN, output in $OUT" | tee "$OUT/summary.txt"

passed=0; failed=0; skipped=0
step() {  # step NAME COMMAND...: runs it (log in $OUT/NAME.log) unless the time budget is spent
  local name="$1"; shift
  if [ "$SECONDS" -ge "$BUDGET_S" ]; then
    skipped=$((skipped + 1)); echo "SKIP $name (time budget of $BUDGET_S s spent)" | tee -a "$OUT/summary.txt"; return 1
  fi
  local t0=$SECONDS
  if timeout 100 "$@" >"$OUT/$name.log" 2>&1; then
    passed=$((passed + 1)); echo "PASS $name ($((SECONDS - t0)) s)" | tee -a "$OUT/summary.txt"
  else
    failed=$((failed + 1)); echo "FAIL $name ($((SECONDS - t0)) s), last lines of $name.log:" | tee -a "$OUT/summary.txt"
    tail -n 12 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
    return 1
  fi
}
bench() {  # bench NAME ARGS...: exchange_bench with ARGS, JSON to $OUT/NAME.json
  local name="$1"; shift
  step "$name" $RUN "$BIN/exchange_bench" --out "$OUT/$name.json" "$@"
}

# Correctness first: every word of every size, then 10,000 back-to-back epochs at 64 KiB; the
# default shape, and 1024 threads per CTA (a different split of every put) with fewer rounds.
for v in "${VARIANTS[@]}"; do
  step "check_$v" $RUN "$BIN/exchange" --variant "$v" --sizes 32K,256K,1M,4M,8M,32M --rounds 10000 --pingpong 0
done
for v in "${VARIANTS[@]}"; do
  step "check_${v}_1024t" $RUN "$BIN/exchange" --variant "$v" --threads 1024 --sizes 32K,1M,32M --rounds 1000 --pingpong 0
done

# Timings: every variant with the floor and batches of 20 rounds, in the default shape.
for v in "${VARIANTS[@]}"; do
  bench "bench_$v" --variant "$v" --sizes "$BENCH_SIZES" --floor --batch 20
done

# The variant fastest at 4 MiB in the runs above (cta-loop if none produced a number).
best="$(python3 - "$OUT" "${VARIANTS[@]}" <<'EOF' 2>/dev/null || echo cta-loop
import json, sys
out, variants = sys.argv[1], sys.argv[2:]
times = {}
for v in variants:
    try:
        rows = json.load(open(f"{out}/bench_{v}.json"))["rows"]
        times[v] = next(r["device_us"] for r in rows if r["bytes_per_rank"] == 4 << 20)
    except Exception:
        pass
print(min(times, key=times.get) if times else "cta-loop")
EOF
)"
echo "fastest at 4 MiB: $best" | tee -a "$OUT/summary.txt"
bench "sweep_ctas_$best" --variant "$best" --sizes 4M,8M --sweep-ctas 48,64,80,96,112

for t in 256 1024; do
  for v in "${VARIANTS[@]}"; do
    bench "bench_${v}_${t}t" --variant "$v" --threads "$t" --sizes "$BENCH_SIZES"
  done
done
for chunk in 16K 64K 128K; do
  bench "bench_dynamic_chunk_$chunk" --variant dynamic --chunk "$chunk" --sizes "$BENCH_SIZES"
done
# The same runs again, in reverse order, to see how much of a difference is run-to-run noise.
for ((i = ${#VARIANTS[@]} - 1; i >= 0; i--)); do
  bench "bench_${VARIANTS[$i]}_repeat" --variant "${VARIANTS[$i]}" --sizes "$BENCH_SIZES"
done

# One table over every JSON written: per size device us (egress GB/s, speedup vs NCCL of the same
# run), and where measured the floor and the batched per-round times.
python3 - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import glob, json, os, sys
out = sys.argv[1]
print(f"\n{'run':34} {'size':>5} {'ctas':>4} {'device us':>9} {'GB/s':>6} {'NCCL us':>8} {'x NCCL':>6}"
      f" {'floor':>6} {'batch us':>8} {'NCCL b.':>8} {'x b.':>5}")
for path in sorted(glob.glob(f"{out}/*.json")):
    try:
        result = json.load(open(path))
    except Exception as e:
        print(f"{os.path.basename(path)}: unreadable ({e})")
        continue
    name = os.path.basename(path)[:-5]
    for r in result["rows"]:
        f = lambda key, spec: format(r[key], spec) if key in r else "-"
        print(f"{name:34} {r['bytes_per_rank'] >> 20:>4}M {r['ctas']:>4} {r['device_us']:9.1f} {r['egress_gbps']:6.1f}"
              f" {r['nccl_us']:8.1f} {r['speedup_vs_nccl']:6.2f} {f('harness_floor_us', '6.1f'):>6}"
              f" {f('device_batch_us', '8.1f'):>8} {f('nccl_batch_us', '8.1f'):>8} {f('speedup_vs_nccl_batch', '5.2f'):>5}")
print("\ntargets (W=4): 8 MiB egress >= 300 GB/s; x NCCL >= 1.5 at 1 MiB and 4 MiB")
EOF
grep -h "^\[rank 0\] sweep" "$OUT"/sweep_ctas_*.log 2>/dev/null | tee -a "$OUT/summary.txt"
echo "exchange-sweep: $passed passed, $failed failed, $skipped skipped in $SECONDS s" | tee -a "$OUT/summary.txt"
[ "$failed" -eq 0 ]
