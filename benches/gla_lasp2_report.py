"""Merges GLA's LASP-2 timings (ours and the fla + NCCL peer, measured in one job) into gla.json.

    python3 benches/gla_lasp2_report.py --device '4x NVIDIA H100 80GB HBM3' --bit-identical \\
        --ours ours_w4_1.json ours_w4_2.json ours_w4_3.json \\
        --ours-step step_w4_1.json step_w4_2.json step_w4_3.json \\
        --peer peer_w4_1.json peer_w4_2.json peer_w4_3.json --into benches/results/gla.json

--ours: what `lasp-run -n W gla_lasp2 --no-check --time ... --json FILE` wrote (one row per shape:
W, B, T_local, H, D, every mode's slowest-rank median, per_rank_ms); --ours-step: the same with
--with-backward (a timed call is a training step). --peer: what `torchrun --nproc-per-node W
benches/gla_lasp2_peer.py [--with-backward] --out FILE` wrote (fla_peer_ms, and fla_peer_step_ms
with --with-backward). Each file is one process's; a shape measured in several processes gets the
median of their values, the per-process values kept beside it (fla's times vary between processes).

Rows are matched by (W, B, T_local, H, D); a forward shape missing on the peer's side is an error
(exit 1), a training-step shape without the peer's step gets fla_peer_ms null.
The forward rows go to gla.json's `lasp2` list, the training-step rows (with --ours-step) to
`lasp2_forward_backward`'s. Each row carries its own `commit` (env LASP_COMMIT), `date` (env
LASP_DATE, else now), `device` and `bit_identical` (--bit-identical: the checks of the same build
passed, every mode bitwise equal), and replaces the row of the same key, so that a job that
re-measures some W leaves the others as they were, with their own provenance. The file's
`bit_identical` is true when every LASP-2 row's is.
"""
import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from lasp2_rows import by_shape, replace_rows

MODES = ("overlapped_ms", "sequential_nccl_ms", "sequential_nvshmem_ms", "no_comm_ms")
PEER_PARTS = ("states_ms", "allgather_ms", "fold_ms", "forward_ms")


def median_of(rows, field):
    """(the median over processes of rows' `field`, the per-process values)."""
    per = [r[field] for r in rows]
    return round(statistics.median(per), 5), per


def merge(ours, peers, peer_field, provenance, peer_required=True):
    """One gla.json row per shape of `ours`: every mode's and the peer's `peer_field` as medians
    over processes, their ratios and the per-process values. Without peer_required a shape the
    peer did not measure gets fla_peer_ms null."""
    out = []
    for k, runs in sorted(ours.items()):
        peer = [r for r in peers.get(k, []) if peer_field in r]
        if not peer and peer_required:
            raise SystemExit(f"no peer {peer_field} for W={k[0]} B={k[1]} T_local={k[2]}")
        row = dict(zip(("W", "B", "T_local", "H", "D"), k))
        per_process = {}
        for field in MODES:
            row[field], per_process[field] = median_of(runs, field)
        ovl = row["overlapped_ms"]
        row["fla_peer_ms"] = row["peer_over_overlapped"] = None
        if peer:
            row["fla_peer_ms"], per_process["fla_peer_ms"] = median_of(peer, peer_field)
            row["peer_over_overlapped"] = round(row["fla_peer_ms"] / ovl, 3)
        row.update(
            nccl_over_overlapped=round(row["sequential_nccl_ms"] / ovl, 3),
            overlapped_over_no_comm=round(ovl / row["no_comm_ms"], 3),
            processes={"ours": len(runs), "peer": len(peer)},
            per_process_ms=per_process,
            per_rank_ms_first_process=runs[0]["per_rank_ms"],
        )
        if peer and peer_field == "fla_peer_ms":
            row["peer_parts_ms"] = {p: median_of(peer, p)[0] for p in PEER_PARTS}
        elif peer:
            row["peer_parts_ms"] = {p: statistics.median(r["step_parts_ms"][p] for r in peer)
                                    for p in peer[0]["step_parts_ms"]}
        row.update(provenance)
        out.append(row)
    return out


def self_test():
    """The merge on made-up rows: medians over processes, the peer's field per direction, rows
    replaced by key with their provenance, and the errors."""
    import tempfile

    def ours(W, ms):
        return [dict(W=W, B=4, T_local=8192, H=16, D=128, overlapped_ms=ms, sequential_nccl_ms=2 * ms,
                     sequential_nvshmem_ms=2 * ms, no_comm_ms=ms / 2, per_rank_ms={"overlapped": [ms] * W})]

    def peer(W, ms, step=None):
        row = dict(W=W, B=4, T_local=8192, H=16, D=128, fla_peer_ms=ms,
                   **{p: ms / 4 for p in PEER_PARTS})
        if step is not None:
            row.update(fla_peer_step_ms=step, step_parts_ms={"forward": step / 2, "backward": step / 2})
        return {"rows": [row]}

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def files(name, docs):
            paths = []
            for i, doc in enumerate(docs):
                paths.append(tmp / f"{name}_{i}.json")
                paths[-1].write_text(json.dumps(doc))
            return [str(p) for p in paths]

        into = tmp / "gla.json"
        into.write_text(json.dumps({"single_gpu": [], "lasp2": [dict(ours(2, 1.0)[0], commit="old")]}))
        os.environ.update(LASP_COMMIT="new", LASP_DATE="today")
        main(["--device", "4x GPU", "--bit-identical", "--into", str(into),
              "--ours", *files("ours", [ours(4, 1.0), ours(4, 3.0), ours(4, 2.0)]),
              "--ours-step", *files("step", [ours(4, 5.0)]),
              "--peer", *files("peer", [peer(4, 9.0, 20.0), peer(4, 7.0)])])
        doc = json.loads(into.read_text())
        [w2, w4] = doc["lasp2"]
        assert w2["W"] == 2 and w2["commit"] == "old", "a row of another W stays as it was"
        assert w4["overlapped_ms"] == 2.0 and w4["per_process_ms"]["overlapped_ms"] == [1.0, 3.0, 2.0]
        assert w4["fla_peer_ms"] == 8.0 and w4["peer_over_overlapped"] == 4.0
        assert w4["processes"] == {"ours": 3, "peer": 2} and w4["commit"] == "new" and w4["bit_identical"]
        [step] = doc["lasp2_forward_backward"]["rows"]
        assert step["fla_peer_ms"] == 20.0 and step["processes"]["peer"] == 1, "only processes with a step count"
        main(["--device", "4x GPU", "--into", str(into), "--ours", *files("again", [ours(4, 4.0)]),
              "--peer", *files("peer2", [peer(4, 8.0)])])
        [_, w4] = json.loads(into.read_text())["lasp2"]
        assert w4["overlapped_ms"] == 4.0 and not w4["bit_identical"], "a re-measured row replaces the old"
        assert not json.loads(into.read_text())["bit_identical"], "one row without the checks clears the flag"
        try:
            main(["--device", "x", "--into", str(into), "--ours", *files("lone", [ours(1, 1.0)]),
                  "--peer", *files("other", [peer(4, 1.0)])])
        except SystemExit as e:
            assert "no peer fla_peer_ms for W=1" in str(e), e
        else:
            raise AssertionError("a forward row without its peer must fail")
    print("gla_lasp2_report: self-test passed")
    return 0


def main(argv=None):
    if argv is None and sys.argv[1:] == ["--self-test"]:
        return self_test()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", nargs="*", type=Path, default=[])
    ap.add_argument("--ours-step", nargs="*", type=Path, default=[])
    ap.add_argument("--peer", nargs="*", type=Path, default=[])
    ap.add_argument("--into", type=Path, required=True)
    ap.add_argument("--device", required=True, help="the job's GPUs, e.g. '4x NVIDIA H100 80GB HBM3'")
    ap.add_argument("--bit-identical", action="store_true")
    a = ap.parse_args(argv)
    if not a.ours and not a.ours_step:
        ap.error("give --ours, --ours-step or both")
    provenance = dict(
        commit=os.environ.get("LASP_COMMIT", "unknown"),
        date=os.environ.get("LASP_DATE", datetime.now(timezone.utc).isoformat(timespec="seconds")),
        device=a.device, bit_identical=bool(a.bit_identical))
    peers = by_shape(a.peer)
    forward = merge(by_shape(a.ours), peers, "fla_peer_ms", provenance)
    # the training step's peer (--with-backward) is reported where it was measured
    step = merge(by_shape(a.ours_step), peers, "fla_peer_step_ms", provenance, peer_required=False)

    doc = json.loads(a.into.read_text()) if a.into.exists() else {}
    doc["lasp2_method"] = (
        "ours: gla_lasp2 --time, every mode in turns (6 rounds of 2 untimed and 5 timed calls per mode, "
        "each after an on-stream barrier, CUDA events), per rank the median, per process the slowest "
        "rank; peer: benches/gla_lasp2_peer.py in the same job (fla states pass, NCCL all-gather, "
        "fold, fla chunk_gla from the prefix), same per-rank rule; each side in its own processes, "
        "the row the median over processes (per_process_ms)")
    if forward:
        doc["lasp2"] = replace_rows(doc.get("lasp2", []), forward)
    if step:
        fb = doc.setdefault("lasp2_forward_backward", {})
        fb["method"] = (
            "gla_lasp2 --time --with-backward: a timed call is a training step, the LASP-2 forward "
            "saving its chunk states then the LASP-2 backward from a fixed random do (no dht), "
            "timed as the forward rows; peer: benches/gla_lasp2_peer.py --with-backward, fla's "
            "training step composed with NCCL (chunk_fwd_h, all-gather, fold, chunk_gla forward; "
            "chunk_bwd_dh, all-gather, descending fold, chunk_gla backward), fla_peer_ms its step")
        fb["rows"] = replace_rows(fb.get("rows", []), step)
    # the file's own flag: every LASP-2 row's checks passed with every mode bitwise equal
    doc["bit_identical"] = all(r.get("bit_identical", False) for r in
                               doc.get("lasp2", []) + doc.get("lasp2_forward_backward", {}).get("rows", []))
    a.into.write_text(json.dumps(doc, indent=2) + "\n")
    for name, rows in (("forward", forward), ("training step", step)):
        for r in rows:
            peer = "no peer" if r["fla_peer_ms"] is None else \
                f"peer {r['fla_peer_ms']:.4f} ({r['peer_over_overlapped']:.2f}x)"
            print(f"{name} W={r['W']} B={r['B']} T_local={r['T_local']}: overlapped {r['overlapped_ms']:.4f} ms, "
                  f"NCCL {r['sequential_nccl_ms']:.4f}, no-comm {r['no_comm_ms']:.4f}, {peer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
