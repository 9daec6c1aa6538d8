"""Merges the LASP-2 forward timings (lasp2_w*.json from examples' lasp2_forward) with the fla +
NCCL peer (peer_w*.json) into lasp2_forward.json, prints the table and the targets, and plots weak
scaling. Usage: python3 benches/lasp2_report.py OUT_DIR"""
import glob, json, os, sys

out = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(out, "lasp2_w*.json"))):
    rows += json.load(open(path))
peer = {}
for path in glob.glob(os.path.join(out, "peer_w*.json")):
    for r in json.load(open(path)):
        peer[(r["W"], r["B"], r["T_local"])] = r
for r in rows:
    p = peer.get((r["W"], r["B"], r["T_local"]))
    r["fla_peer_ms"] = p["smart_lasp2_fwd_ms"] if p else None
    r["fla_local_fwd_ms"] = p["fla_fwd_ms"] if p else None
    r["overlapped_over_no_comm"] = r["overlapped_ms"] / r["no_comm_ms"]
    r["speedup_vs_sequential_nccl"] = r["sequential_nccl_ms"] / r["overlapped_ms"]
    r["speedup_vs_fla_peer"] = r["fla_peer_ms"] / r["overlapped_ms"] if p else None

shapes = sorted({(r["B"], r["T_local"]) for r in rows})


def weak_scaling(w):
    """t(W=1) / t(W=w) of the overlapped layer at constant tokens per GPU, per shape."""
    out = {}
    for b, t in shapes:
        by_w = {r["W"]: r["overlapped_ms"] for r in rows if (r["B"], r["T_local"]) == (b, t)}
        if 1 in by_w and w in by_w:
            out[f"B={b},T_local={t}"] = by_w[1] / by_w[w]
    return out


weak = weak_scaling(4)
max_w = max((r["W"] for r in rows), default=1)
weak_max = weak_scaling(max_w)

# Every check of lasp2_forward (bitwise equality across modes, runs and graph replays) must have
# passed in every W's run, or that run would have produced no JSON.
logs = glob.glob(os.path.join(out, "lasp2_w*.log"))
bit_identical = bool(logs) and all("give bitwise the same outputs" in open(p).read() for p in logs)
result = {
    "device": os.environ.get("LASP_DEVICE", "unknown"),
    "commit": os.environ.get("LASP_COMMIT", "unknown"),
    "date": os.environ.get("LASP_DATE", "unknown"),
    "method": "per rank median of 30 calls per mode: 6 rounds in which every mode in turn gets 2 untimed then 5 timed calls, each call after an on-stream barrier, CUDA events; max over ranks (every rank's median in per_rank_ms). fla peer: shared/peers/lasp2_fla_baseline.py (smart = states pass + NCCL all-gather + fold + fla forward), same job",
    "bit_identical": bit_identical,
    "weak_scaling_1_to_4": min(weak.values()) if weak else None,
    "weak_scaling_by_shape": weak,
    f"weak_scaling_1_to_{max_w}": min(weak_max.values()) if weak_max else None,
    "rows": rows,
}
json.dump(result, open(os.path.join(out, "lasp2_forward.json"), "w"), indent=1)

print(f"{'W':>2} {'B':>2} {'T_local':>7} {'overlap':>8} {'seq_nccl':>8} {'seq_nvshm':>9} {'no_comm':>8} {'fla_peer':>8} | ovl/nocomm  vs_nccl  vs_peer")
for r in sorted(rows, key=lambda r: (r["B"], r["T_local"], r["W"])):
    fp = f"{r['fla_peer_ms']:8.3f}" if r["fla_peer_ms"] else "       -"
    vp = f"{r['speedup_vs_fla_peer']:6.2f}x" if r["speedup_vs_fla_peer"] else "      -"
    print(f"{r['W']:>2} {r['B']:>2} {r['T_local']:>7} {r['overlapped_ms']:8.3f} {r['sequential_nccl_ms']:8.3f} {r['sequential_nvshmem_ms']:9.3f} {r['no_comm_ms']:8.3f} {fp} | {r['overlapped_over_no_comm']:9.3f}  {r['speedup_vs_sequential_nccl']:6.2f}x {vp}")
print("bit_identical:", bit_identical, " weak scaling 1->4:", {k: round(v, 4) for k, v in weak.items()},
      f" 1->{max_w}:", {k: round(v, 4) for k, v in weak_max.items()})

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for b, t in shapes:
        pts = sorted((r["W"], r["overlapped_ms"]) for r in rows if (r["B"], r["T_local"]) == (b, t))
        ax.plot([w for w, _ in pts], [ms for _, ms in pts], marker="o", label=f"B={b}, T/GPU={t}")
    ax.set_xlabel("GPUs (W)"); ax.set_ylabel("LASP-2 forward, overlapped (ms)")
    ax.set_title("Weak scaling: constant tokens per GPU"); ax.set_xticks(sorted({r["W"] for r in rows}))
    ax.set_ylim(bottom=0); ax.legend(); fig.tight_layout()
    fig.savefig(os.path.join(out, "lasp2_weak_scaling.png"), dpi=120)
except ImportError:
    print("matplotlib not available: no plot")
