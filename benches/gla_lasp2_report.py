"""Merges GLA's LASP-2 timings (ours and the fla + NCCL peer, measured in one job) into gla.json.

    python3 benches/gla_lasp2_report.py --ours ours_w1.json ours_w2.json \
        --peer peer_w1.json peer_w2.json --into benches/results/gla.json

ours_w*.json: what `lasp-run -n W gla_lasp2 --no-check --time ... --json FILE` wrote (one row per
shape: W, B, T_local, H, D, every mode's slowest-rank median, per_rank_ms). peer_w*.json: what
`torchrun --nproc-per-node W benches/gla_lasp2_peer.py --out FILE` wrote. The rows of both are
matched by (W, B, T_local, H, D) and written as gla.json's `lasp2` list, with `lasp2_device`,
`lasp2_commit`, `lasp2_date` (env LASP_COMMIT / LASP_DATE, else the peer file's), the method, and
`bit_identical` (set by --bit-identical: the checks of the same build passed, every mode bitwise
equal). A shape missing on either side is an error (exit 1).
"""
import argparse
import json
import os
import sys
from pathlib import Path


def key(row):
    return (row["W"], row["B"], row["T_local"], row["H"], row["D"])


def merge(ours_rows, peer_rows):
    peers = {key(r): r for r in peer_rows}
    out = []
    for r in ours_rows:
        p = peers.get(key(r))
        if p is None:
            raise SystemExit(f"no peer row for W={r['W']} B={r['B']} T_local={r['T_local']}")
        ovl = r["overlapped_ms"]
        out.append(dict(
            W=r["W"], B=r["B"], T_local=r["T_local"], H=r["H"], D=r["D"],
            overlapped_ms=ovl, sequential_nccl_ms=r["sequential_nccl_ms"],
            sequential_nvshmem_ms=r["sequential_nvshmem_ms"], no_comm_ms=r["no_comm_ms"],
            fla_peer_ms=p["fla_peer_ms"],
            peer_over_overlapped=round(p["fla_peer_ms"] / ovl, 3),
            nccl_over_overlapped=round(r["sequential_nccl_ms"] / ovl, 3),
            overlapped_over_no_comm=round(ovl / r["no_comm_ms"], 3),
            per_rank_ms=r["per_rank_ms"],
            peer_parts_ms={k: p[k] for k in ("states_ms", "allgather_ms", "fold_ms", "forward_ms")},
        ))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", nargs="+", type=Path, required=True)
    ap.add_argument("--peer", nargs="+", type=Path, required=True)
    ap.add_argument("--into", type=Path, required=True)
    ap.add_argument("--device", required=True, help="the job's GPUs, e.g. '2x NVIDIA H100 80GB HBM3'")
    ap.add_argument("--bit-identical", action="store_true")
    a = ap.parse_args(argv)
    ours = [r for f in a.ours for r in json.loads(f.read_text())]
    peer_files = [json.loads(f.read_text()) for f in a.peer]
    rows = merge(ours, [r for p in peer_files for r in p["rows"]])
    doc = json.loads(a.into.read_text()) if a.into.exists() else {}
    doc.update(
        lasp2_device=a.device,
        lasp2_commit=os.environ.get("LASP_COMMIT", peer_files[0].get("commit")),
        lasp2_date=os.environ.get("LASP_DATE", peer_files[0].get("date")),
        lasp2_method=("ours: gla_lasp2 --time, every mode in turns (6 rounds of 2 untimed and 5 timed "
                      "calls per mode, each after an on-stream barrier, CUDA events), per rank the "
                      "median, the row the slowest rank; peer: benches/gla_lasp2_peer.py in the same "
                      "job (fla states pass, NCCL all-gather, fold, fla chunk_gla from the prefix), "
                      "same per-rank rule"),
        bit_identical=bool(a.bit_identical),
        lasp2=rows,
    )
    a.into.write_text(json.dumps(doc, indent=2) + "\n")
    for r in rows:
        print(f"W={r['W']} B={r['B']} T_local={r['T_local']}: overlapped {r['overlapped_ms']:.4f} ms, "
              f"NCCL {r['sequential_nccl_ms']:.4f}, no-comm {r['no_comm_ms']:.4f}, peer {r['fla_peer_ms']:.4f} "
              f"({r['peer_over_overlapped']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
