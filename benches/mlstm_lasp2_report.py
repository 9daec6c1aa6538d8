"""Merges the mLSTM's LASP-2 timings into mlstm.json's `lasp2` rows (the forward) or, with
--section lasp2_fwdbwd, its `lasp2_fwdbwd` rows (a training step: the forward, then the backward).

    python3 benches/mlstm_lasp2_report.py --device '4x NVIDIA H100 80GB HBM3' --bit-identical \\
        --ours ours_w4_1.json ours_w4_2.json ours_w4_3.json --into benches/results/mlstm.json

--ours: what `lasp-run -n W mlstm_lasp2 --no-check --time ... --json FILE` wrote, one file per
process (one row per shape: W, B, T_local, H, D, every mode's slowest-rank median, per_rank_ms).
A shape measured in several processes gets the median of their values, the per-process values kept
beside it. No mLSTM context parallelism exists elsewhere, so the baseline is our own kernels
composed with a host NCCL all-gather (the sequential_nccl mode), measured in the same turns.

Rows are keyed by (W, B, T_local, H, D) and carry their own `commit` (env LASP_COMMIT), `date`
(env LASP_DATE, else now), `device` and `bit_identical` (--bit-identical: the checks of the same
build passed, every mode bitwise equal); a row replaces the row of the same key, so a job that
re-measures some W leaves the others as they were. The file's `bit_identical` is true when every
row of both LASP-2 sections is.
"""
import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from lasp2_rows import by_shape, replace_rows

MODES = ("overlapped_ms", "sequential_nccl_ms", "sequential_nvshmem_ms", "no_comm_ms",
         "pipelined_chain_ms")
KEY = ("W", "B", "T_local", "H", "D")


def merge(ours, provenance):
    """One row per shape: every mode's median over processes, the ratios, the per-process values."""
    out = []
    for k, runs in sorted(ours.items()):
        row = dict(zip(KEY, k))
        per_process = {}
        for field in MODES:
            values = [r.get(field) for r in runs]
            if any(v is None for v in values):
                row[field] = None
                continue
            row[field] = round(statistics.median(values), 5)
            per_process[field] = values
        ovl = row["overlapped_ms"]
        row.update(
            nccl_over_overlapped=round(row["sequential_nccl_ms"] / ovl, 3),
            overlapped_over_no_comm=round(ovl / row["no_comm_ms"], 3),
            processes=len(runs),
            per_process_ms=per_process,
        )
        row.update(provenance)
        out.append(row)
    return out


def self_test():
    """The merge on made-up rows: medians over processes, rows replaced by key with their
    provenance, the file's flag."""
    import tempfile

    def ours(W, ms, chain=True):
        return [dict(W=W, B=4, T_local=8192, H=16, D=128, overlapped_ms=ms, sequential_nccl_ms=2 * ms,
                     sequential_nvshmem_ms=2 * ms, no_comm_ms=ms / 2,
                     pipelined_chain_ms=3 * ms if chain else None)]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def files(name, docs):
            paths = []
            for i, doc in enumerate(docs):
                paths.append(tmp / f"{name}_{i}.json")
                paths[-1].write_text(json.dumps(doc))
            return [str(p) for p in paths]

        into = tmp / "mlstm.json"
        into.write_text(json.dumps({"single_gpu": [], "lasp2": [dict(ours(2, 1.0)[0], commit="old")]}))
        os.environ.update(LASP_COMMIT="new", LASP_DATE="today")
        main(["--device", "4x GPU", "--bit-identical", "--into", str(into),
              "--ours", *files("ours", [ours(4, 1.0), ours(4, 3.0), ours(4, 2.0)])])
        doc = json.loads(into.read_text())
        [w2, w4] = doc["lasp2"]
        assert w2["W"] == 2 and w2["commit"] == "old", "a row of another W stays as it was"
        assert w4["overlapped_ms"] == 2.0 and w4["per_process_ms"]["overlapped_ms"] == [1.0, 3.0, 2.0]
        assert w4["nccl_over_overlapped"] == 2.0 and w4["pipelined_chain_ms"] == 6.0
        assert w4["processes"] == 3 and w4["commit"] == "new" and w4["bit_identical"]
        main(["--device", "4x GPU", "--bit-identical", "--into", str(into), "--section", "lasp2_fwdbwd",
              "--ours", *files("step", [ours(4, 5.0)])])
        doc = json.loads(into.read_text())
        assert [r["overlapped_ms"] for r in doc["lasp2"]] == [1.0, 2.0], "the forward's rows stay"
        assert [r["overlapped_ms"] for r in doc["lasp2_fwdbwd"]] == [5.0]
        assert "backward" in doc["lasp2_fwdbwd_method"]
        main(["--device", "4x GPU", "--into", str(into), "--ours", *files("again", [ours(4, 4.0, False)])])
        doc = json.loads(into.read_text())
        [_, w4] = doc["lasp2"]
        assert w4["overlapped_ms"] == 4.0 and w4["pipelined_chain_ms"] is None and not w4["bit_identical"]
        assert not doc["bit_identical"], "one row without the checks clears the flag"
    print("mlstm_lasp2_report: self-test passed")
    return 0


def main(argv=None):
    if argv is None and sys.argv[1:] == ["--self-test"]:
        return self_test()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", nargs="+", type=Path, required=True)
    ap.add_argument("--into", type=Path, required=True)
    ap.add_argument("--device", required=True, help="the job's GPUs, e.g. '4x NVIDIA H100 80GB HBM3'")
    ap.add_argument("--bit-identical", action="store_true")
    ap.add_argument("--section", choices=("lasp2", "lasp2_fwdbwd"), default="lasp2",
                    help="lasp2_fwdbwd: rows of `mlstm_lasp2 --with-backward`")
    a = ap.parse_args(argv)
    provenance = dict(
        commit=os.environ.get("LASP_COMMIT", "unknown"),
        date=os.environ.get("LASP_DATE", datetime.now(timezone.utc).isoformat(timespec="seconds")),
        device=a.device, bit_identical=bool(a.bit_identical))
    rows = merge(by_shape(a.ours), provenance)
    doc = json.loads(a.into.read_text()) if a.into.exists() else {}
    step = " --with-backward: a timed call is the forward saving the boundary states and rows, then the backward," if a.section == "lasp2_fwdbwd" else ","
    doc[f"{a.section}_method"] = (
        f"mlstm_lasp2 --time{step} every mode in turns (6 rounds of 2 untimed and 5 timed calls per mode, "
        "each after an on-stream barrier, CUDA events), per rank the median, per process the slowest "
        "rank, the row the median over processes (per_process_ms). sequential_nccl: the same kernels "
        "with a host NCCL all-gather of the summaries between them; no_comm: the same kernels without "
        "any exchange (the floor of the schedule); inputs random, gates as mlstm_kernels' benchmark "
        "(input around 0, forget around 3), T_local tokens per GPU")
    doc[a.section] = replace_rows(doc.get(a.section, []), rows)
    doc["bit_identical"] = all(r.get("bit_identical", False)
                               for section in ("lasp2", "lasp2_fwdbwd") for r in doc.get(section, []))
    a.into.write_text(json.dumps(doc, indent=2) + "\n")
    for r in rows:
        print(f"W={r['W']} B={r['B']} T_local={r['T_local']}: overlapped {r['overlapped_ms']} ms, "
              f"sequential NCCL {r['sequential_nccl_ms']} ({r['nccl_over_overlapped']}x), "
              f"no-comm {r['no_comm_ms']}, chain {r['pipelined_chain_ms']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
