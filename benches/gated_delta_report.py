"""Merges Gated DeltaNet's timings measured in one GPU job (single GPU: ours and fla; LASP-2: ours and
fla's context parallelism) into gated_delta.json.

    python3 benches/gated_delta_report.py --device 'NVIDIA H100 80GB HBM3' \\
        --single-ours ours.json --single-fla fla_1.json fla_2.json fla_3.json \\
        --into benches/results/gated_delta.json
    python3 benches/gated_delta_report.py --device '4x NVIDIA H100 80GB HBM3' --bit-identical \\
        --lasp2-ours ours_w4_1.json ours_w4_2.json ours_w4_3.json \\
        --lasp2-peer peer_w4_1.json peer_w4_2.json peer_w4_3.json --into benches/results/gated_delta.json
    python3 benches/gated_delta_report.py --device '4x NVIDIA H100 80GB HBM3' --bit-identical \
        --lasp2-step step_w4_1.json step_w4_2.json step_w4_3.json --into benches/results/gated_delta.json
    python3 benches/gated_delta_report.py --self-test    # CPU only, no files

--single-ours: what `gated_delta_bench --dump DIR` (or --out FILE) wrote (shapes: B, T, H, D,
ours_fwd_ms, hbm_floor_fwd_ms, ...); --single-fla: what `benches/fla_gated_delta.py DIR --out FILE`
wrote on that dump (shapes: fla_fwd_ms). --lasp2-ours: what `lasp-run -n W gated_delta_lasp2
--no-check --time ... --json FILE` wrote (a list of rows: W, B, T_local, H, D, every mode's
slowest-rank median, per_rank_ms); --lasp2-peer: what `torchrun --nproc-per-node W
benches/gated_delta_cp_peer.py --out FILE` wrote (rows: fla_cp_ms, fla_no_comm_ms, per_rank_ms);
--lasp2-step: what `gated_delta_lasp2 --with-backward` wrote (the training step: the LASP-2
forward and backward; no peer, fla's backward does not run on the node's Triton). Any of the
groups in one call. Each file is one process's; a shape measured in several
processes gets the median of their values, the per-process values kept beside it (fla's times vary
between processes); one file is one process, whose value is its own median.

Single-GPU rows are matched by (B, T, H, D), LASP-2 rows by (W, B, T_local, H, D); a shape of ours
missing on the peer's side is an error (exit 1). ours_bwd_ms and hbm_floor_bwd_ms are null unless
our files carry them (fla's backward is not timed: it does not run on the node's Triton). The rows go to gated_delta.json's
`single_gpu`, `lasp2` and `lasp2_step` lists. Each row carries its own `commit` (env LASP_COMMIT), `date` (env
LASP_DATE, else now) and `device` (--device), a LASP-2 or step row also `bit_identical` (--bit-identical:
the checks of the same build passed, every mode bitwise equal), and replaces the row of the same
key, so that a job that re-measures some shapes leaves the others as they were, with their own
provenance. The file's `device`, `commit` and `date` are the last merge's; its `method` has one line
per list (`single_gpu: ...`, `lasp2: ...`), a list not merged keeping its line; its `bit_identical`
is true when there are LASP-2 rows and every LASP-2 and step row's is.
"""
import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

SINGLE_KEY = ("B", "T", "H", "D")
LASP2_KEY = ("W", "B", "T_local", "H", "D")
MODES = ("overlapped_ms", "sequential_nccl_ms", "sequential_nvshmem_ms", "no_comm_ms")
LISTS = ("single_gpu", "lasp2", "lasp2_step")


def load(files):
    return [json.loads(Path(f).read_text()) for f in files]


def by_shape(docs, fields):
    """{key: [that shape's row of every process that measured it]} over one side's documents; a
    document is its row list (gated_delta_lasp2) or holds it in `shapes` (the single-GPU programs)
    or `rows` (the CP peer)."""
    rows = {}
    for doc in docs:
        for r in doc if isinstance(doc, list) else doc.get("shapes", doc.get("rows")):
            rows.setdefault(tuple(r[f] for f in fields), []).append(r)
    return rows


def methods(docs):
    """The distinct `method` strings the documents carry, in order."""
    return " / ".join(dict.fromkeys(d["method"] for d in docs))


def median_of(rows, field):
    """(the median over processes of rows' `field`, the per-process values)."""
    per = [r[field] for r in rows]
    return round(statistics.median(per), 5), per


def shape_text(fields, k):
    return " ".join(f"{f}={v}" for f, v in zip(fields, k))


def merge_single(ours, fla, provenance):
    """One single_gpu row per shape of `ours`: our forward and fla's as medians over processes,
    the HBM floor and the ratios."""
    out = []
    for k, runs in sorted(ours.items()):
        if k not in fla:
            raise SystemExit(f"gated_delta_report: no fla row (--single-fla) for {shape_text(SINGLE_KEY, k)}")
        row = dict(zip(SINGLE_KEY, k))
        row["ours_fwd_ms"], ours_per = median_of(runs, "ours_fwd_ms")
        row["fla_fwd_ms"], fla_per = median_of(fla[k], "fla_fwd_ms")
        row["ours_bwd_ms"] = median_of(runs, "ours_bwd_ms")[0] if all("ours_bwd_ms" in r for r in runs) else None
        # a floor depends on the shape and the device's bandwidth only: every process has the same
        row["hbm_floor_fwd_ms"] = runs[0]["hbm_floor_fwd_ms"]
        row["hbm_floor_bwd_ms"] = runs[0].get("hbm_floor_bwd_ms")
        row.update(
            floor_fraction_fwd=round(row["hbm_floor_fwd_ms"] / row["ours_fwd_ms"], 4),
            fla_over_ours=round(row["fla_fwd_ms"] / row["ours_fwd_ms"], 3),
            ours_per_process_ms=ours_per,
            fla_per_process_ms=fla_per,
        )
        row.update(provenance)
        out.append(row)
    return out


def merge_lasp2(ours, peers, provenance):
    """One lasp2 row per shape of `ours`: every mode's time and fla's CP and no-comm times as
    medians over processes, and the ratios to the overlapped mode."""
    out = []
    for k, runs in sorted(ours.items()):
        if k not in peers:
            raise SystemExit(f"gated_delta_report: no fla CP row (--lasp2-peer) for {shape_text(LASP2_KEY, k)}")
        row = dict(zip(LASP2_KEY, k))
        row["overlapped_ms"], overlapped_per = median_of(runs, "overlapped_ms")
        for field in MODES[1:]:
            row[field] = median_of(runs, field)[0]
        row["fla_cp_ms"], fla_cp_per = median_of(peers[k], "fla_cp_ms")
        row["fla_no_comm_ms"] = median_of(peers[k], "fla_no_comm_ms")[0]
        ovl = row["overlapped_ms"]
        row.update(
            fla_cp_over_overlapped=round(row["fla_cp_ms"] / ovl, 3),
            nccl_over_overlapped=round(row["sequential_nccl_ms"] / ovl, 3),
            overlapped_per_process_ms=overlapped_per,
            fla_cp_per_process_ms=fla_cp_per,
        )
        row.update(provenance)
        out.append(row)
    return out


def merge_step(ours, provenance):
    """One lasp2_step row per shape of `ours`: every mode's time as medians over processes, and
    sequential NCCL over overlapped."""
    out = []
    for k, runs in sorted(ours.items()):
        row = dict(zip(LASP2_KEY, k))
        row["overlapped_ms"], overlapped_per = median_of(runs, "overlapped_ms")
        for field in MODES[1:]:
            row[field] = median_of(runs, field)[0]
        row.update(
            nccl_over_overlapped=round(row["sequential_nccl_ms"] / row["overlapped_ms"], 3),
            overlapped_per_process_ms=overlapped_per,
        )
        row.update(provenance)
        out.append(row)
    return out


def replace_rows(old, new, fields):
    """`old` without the rows whose key a row of `new` has, then `new`, sorted by key."""
    key = lambda r: tuple(r[f] for f in fields)  # noqa: E731
    keys = {key(r) for r in new}
    return sorted([r for r in old if key(r) not in keys] + new, key=key)


def table(head, rows, cells):
    """A markdown table: `head`'s columns, one line per row from cells(row)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def self_test():
    """The merge on made-up files: medians over processes with the per-process values, one file
    of ours as one process, the fields of each list, rows replaced by key with their provenance, a
    list not merged keeping its rows and its method line, and the errors."""
    import tempfile

    def ours_single(ms_by_t, bwd=None):
        shapes = [dict(name=f"b1_t{t}_h2_d64", B=1, T=t, H=2, D=64, ours_fwd_ms=ms, ours_fwd_min_ms=ms,
                       num_segments=1, hbm_floor_fwd_ms=0.25, floor_fraction_fwd=0.0) for t, ms in ms_by_t]
        if bwd is not None:
            for s in shapes:
                s.update(ours_bwd_ms=bwd, hbm_floor_bwd_ms=0.5)
        return dict(device="GPU", commit="x", method="ours method", shapes=shapes)

    def fla_single(ms_by_t):
        return dict(device="GPU", method="fla method",
                    shapes=[dict(name="n", B=1, T=t, H=2, D=64, fla_fwd_ms=ms, ours_fwd_ms=0.0) for t, ms in ms_by_t])

    def ours_lasp2(W, ms):
        return [dict(W=W, B=2, T_local=4096, H=2, D=64, overlapped_ms=ms, sequential_nccl_ms=2 * ms,
                     sequential_nvshmem_ms=1.5 * ms, no_comm_ms=ms / 2,
                     per_rank_ms={m: [ms] * W for m in ("overlapped", "sequential_nccl", "sequential_nvshmem",
                                                        "no_comm")})]

    def peer_lasp2(W, ms):
        return dict(device="GPU", method="peer method", check={"ok": True}, errors=[],
                    rows=[dict(W=W, B=2, T_local=4096, H=2, D=64, fla_cp_ms=ms, fla_no_comm_ms=ms / 4,
                               per_rank_ms=[ms] * W, no_comm_per_rank_ms=[ms / 4] * W,
                               summary_bytes_per_rank=1)])

    single_fields = {"B", "T", "H", "D", "ours_fwd_ms", "fla_fwd_ms", "ours_bwd_ms", "hbm_floor_fwd_ms",
                     "hbm_floor_bwd_ms", "floor_fraction_fwd", "fla_over_ours", "ours_per_process_ms",
                     "fla_per_process_ms", "commit", "date", "device"}
    lasp2_fields = {"W", "B", "T_local", "H", "D", *MODES, "fla_cp_ms", "fla_no_comm_ms", "fla_cp_over_overlapped",
                    "nccl_over_overlapped", "overlapped_per_process_ms", "fla_cp_per_process_ms", "bit_identical",
                    "commit", "date", "device"}

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def files(name, docs):
            paths = []
            for i, doc in enumerate(docs):
                paths.append(tmp / f"{name}_{i}.json")
                paths[-1].write_text(json.dumps(doc))
            return [str(p) for p in paths]

        into = tmp / "gated_delta.json"
        os.environ.update(LASP_COMMIT="first", LASP_DATE="day 1")
        main(["--device", "GPU", "--into", str(into),
              "--single-ours", *files("ours", [ours_single([(1024, 1.0), (2048, 2.0)])]),
              "--single-fla", *files("fla", [fla_single([(1024, 3.0), (2048, 5.0)]),
                                             fla_single([(1024, 2.0), (2048, 4.0)]),
                                             fla_single([(1024, 2.5), (2048, 6.0)])])])
        main(["--device", "4x GPU", "--bit-identical", "--into", str(into),
              "--lasp2-ours", *files("o2", [ours_lasp2(2, 1.0), ours_lasp2(2, 3.0), ours_lasp2(2, 2.0)]),
              "--lasp2-peer", *files("p2", [peer_lasp2(2, 4.0), peer_lasp2(2, 6.0)])])
        doc = json.loads(into.read_text())
        t1, t2 = doc["single_gpu"]
        assert all(set(r) == single_fields for r in (t1, t2)), sorted(t1)
        assert t1["T"] == 1024 and t1["ours_fwd_ms"] == 1.0 and t1["ours_per_process_ms"] == [1.0], \
            "one file of ours is one process"
        assert t1["fla_fwd_ms"] == 2.5 and t1["fla_per_process_ms"] == [3.0, 2.0, 2.5] and t1["fla_over_ours"] == 2.5
        assert t1["floor_fraction_fwd"] == 0.25 and t1["ours_bwd_ms"] is None and t1["hbm_floor_bwd_ms"] is None
        assert t1["commit"] == "first" and t1["date"] == "day 1" and t1["device"] == "GPU"
        [w2] = doc["lasp2"]
        assert set(w2) == lasp2_fields, sorted(w2)
        assert w2["overlapped_ms"] == 2.0 and w2["overlapped_per_process_ms"] == [1.0, 3.0, 2.0]
        assert w2["sequential_nccl_ms"] == 4.0 and w2["nccl_over_overlapped"] == 2.0 and w2["no_comm_ms"] == 1.0
        assert w2["fla_cp_ms"] == 5.0 and w2["fla_cp_per_process_ms"] == [4.0, 6.0]
        assert w2["fla_no_comm_ms"] == 1.25 and w2["fla_cp_over_overlapped"] == 2.5 and w2["bit_identical"]
        assert doc["bit_identical"] and doc["device"] == "4x GPU"
        assert doc["method"].splitlines()[0].startswith("single_gpu: ours: gated_delta_bench, ours method")
        assert doc["method"].splitlines()[1].startswith("lasp2: ours: gated_delta_lasp2"), \
            "a list not merged keeps its method line"

        # a second job: T=2048 and W=4 in both groups, our side in two processes, without the checks
        os.environ.update(LASP_COMMIT="second", LASP_DATE="day 2")
        main(["--device", "4x GPU", "--into", str(into),
              "--single-ours", *files("ours2", [ours_single([(2048, 1.0)], bwd=3.0),
                                                ours_single([(2048, 2.0)], bwd=5.0)]),
              "--single-fla", *files("fla2", [fla_single([(2048, 3.0)])]),
              "--lasp2-ours", *files("o4", [ours_lasp2(4, 1.0)]),
              "--lasp2-peer", *files("p4", [peer_lasp2(4, 2.0)])])
        doc = json.loads(into.read_text())
        t1, t2 = doc["single_gpu"]
        assert t1["T"] == 1024 and t1["commit"] == "first", "a row of another shape stays as it was"
        assert t2["commit"] == "second" and t2["ours_fwd_ms"] == 1.5 and t2["ours_per_process_ms"] == [1.0, 2.0], \
            "a re-measured row replaces the old, median of the processes"
        assert t2["ours_bwd_ms"] == 4.0 and t2["hbm_floor_bwd_ms"] == 0.5 and t2["fla_over_ours"] == 2.0
        w2, w4 = doc["lasp2"]
        assert (w2["W"], w2["commit"], w2["bit_identical"]) == (2, "first", True)
        assert (w4["W"], w4["commit"], w4["bit_identical"]) == (4, "second", False)
        assert not doc["bit_identical"], "one row without the checks clears the flag"
        assert (doc["commit"], doc["date"]) == ("second", "day 2")

        def must_fail(args, shape):
            try:
                main(["--device", "x", "--into", str(into), *args])
            except SystemExit as e:
                assert "no fla" in str(e) and shape in str(e), e
            else:
                raise AssertionError(f"{shape}: a shape of ours without its peer must fail")

        # the training step's rows: no peer, their own list and method line
        main(["--device", "4x GPU", "--bit-identical", "--into", str(into),
              "--lasp2-step", *files("s4", [ours_lasp2(4, 2.0), ours_lasp2(4, 4.0), ours_lasp2(4, 3.0)])])
        doc = json.loads(into.read_text())
        [s4] = doc["lasp2_step"]
        assert set(s4) == {"W", "B", "T_local", "H", "D", *MODES, "nccl_over_overlapped",
                           "overlapped_per_process_ms", "bit_identical", "commit", "date", "device"}, sorted(s4)
        assert s4["overlapped_ms"] == 3.0 and s4["overlapped_per_process_ms"] == [2.0, 4.0, 3.0]
        assert s4["nccl_over_overlapped"] == 2.0 and len(doc["lasp2"]) == 2, "the other lists stay"
        assert doc["method"].splitlines()[2].startswith("lasp2_step: ours: gated_delta_lasp2 --time --with-backward")
        assert not doc["bit_identical"], "the W=4 lasp2 row still lacks the checks"

        must_fail(["--single-ours", *files("lone", [ours_single([(512, 1.0)])]),
                   "--single-fla", *files("other", [fla_single([(1024, 1.0)])])], "T=512")
        must_fail(["--lasp2-ours", *files("lone", [ours_lasp2(8, 1.0)]),
                   "--lasp2-peer", *files("other", [peer_lasp2(2, 1.0)])], "W=8")
        assert json.loads(into.read_text()) == doc, "a failed merge leaves the file as it was"
    print("gated_delta_report: self-test passed")
    return 0


def main(argv=None):
    if argv is None and sys.argv[1:] == ["--self-test"]:
        return self_test()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--single-ours", nargs="+", type=Path, default=[], metavar="F")
    ap.add_argument("--single-fla", nargs="+", type=Path, default=[], metavar="F")
    ap.add_argument("--lasp2-ours", nargs="+", type=Path, default=[], metavar="F")
    ap.add_argument("--lasp2-peer", nargs="+", type=Path, default=[], metavar="F")
    ap.add_argument("--lasp2-step", nargs="+", type=Path, default=[], metavar="F")
    ap.add_argument("--bit-identical", action="store_true",
                    help="the LASP-2 checks (forward and backward) of the same build passed, every mode "
                         "bitwise equal")
    ap.add_argument("--into", type=Path, required=True)
    ap.add_argument("--device", required=True, help="the job's GPUs, e.g. '4x NVIDIA H100 80GB HBM3'")
    a = ap.parse_args(argv)
    if bool(a.single_ours) != bool(a.single_fla) or bool(a.lasp2_ours) != bool(a.lasp2_peer):
        ap.error("--single-ours goes with --single-fla, --lasp2-ours with --lasp2-peer")
    if not a.single_ours and not a.lasp2_ours and not a.lasp2_step:
        ap.error("give --single-ours and --single-fla, --lasp2-ours and --lasp2-peer, --lasp2-step, or several")
    if a.bit_identical and not a.lasp2_ours and not a.lasp2_step:
        ap.error("--bit-identical qualifies the --lasp2-ours and --lasp2-step rows")
    provenance = dict(
        commit=os.environ.get("LASP_COMMIT", "unknown"),
        date=os.environ.get("LASP_DATE", datetime.now(timezone.utc).isoformat(timespec="seconds")),
        device=a.device)

    # every row is merged before the file is read, so that a failed merge leaves it untouched
    new, how = {}, {}
    if a.single_ours:
        ours, fla = load(a.single_ours), load(a.single_fla)
        new["single_gpu"] = merge_single(by_shape(ours, SINGLE_KEY), by_shape(fla, SINGLE_KEY), provenance)
        how["single_gpu"] = (
            f"ours: gated_delta_bench, {methods(ours)}; fla: benches/fla_gated_delta.py, {methods(fla)}; "
            "each side in its own processes, the row the median over processes (*_per_process_ms); "
            "hbm_floor_fwd_ms: q, k, v, o in bf16 and g, beta in fp32 moved once at the device's spec HBM "
            "bandwidth (H100 SXM 3.35e12, H200 4.8e12 B/s); ours_bwd_ms: the backward alone, timed like the "
            "forward; hbm_floor_bwd_ms: q, k, v, do read and dq, dk, dv written in bf16, g, beta read and dg, "
            "dbeta written in fp32, once, at the same bandwidth")
    if a.lasp2_ours:
        ours, peer = load(a.lasp2_ours), load(a.lasp2_peer)
        new["lasp2"] = merge_lasp2(by_shape(ours, LASP2_KEY), by_shape(peer, LASP2_KEY),
                                   dict(provenance, bit_identical=a.bit_identical))
        # gated_delta_lasp2's rows carry no method: its schedule is time_in_turns' (examples/src/lib.rs)
        how["lasp2"] = (
            "ours: gated_delta_lasp2 --time, the four modes in turns (6 rounds of 2 untimed and 5 timed "
            "calls per mode, each after an on-stream barrier, CUDA events), per rank the median, the row "
            f"the slowest rank; fla_cp_ms, fla_no_comm_ms: benches/gated_delta_cp_peer.py in the same job, "
            f"{methods(peer)}; each side in its own processes, the row the median over processes "
            "(*_per_process_ms)")

    if a.lasp2_step:
        steps = load(a.lasp2_step)
        new["lasp2_step"] = merge_step(by_shape(steps, LASP2_KEY), dict(provenance, bit_identical=a.bit_identical))
        how["lasp2_step"] = (
            "ours: gated_delta_lasp2 --time --with-backward, a call the training step (the LASP-2 forward "
            "saving the state entering the shard, then the LASP-2 backward from a random do), the four modes "
            "in turns as for lasp2; each process's row the slowest rank, the row the median over processes "
            "(overlapped_per_process_ms)")

    doc = json.loads(a.into.read_text()) if a.into.exists() else {}
    doc.update(provenance)
    # one line per list, `list: how`; a list not merged now keeps its line
    lines = dict(line.split(": ", 1) for line in doc.get("method", "").splitlines())
    lines.update(how)
    doc["method"] = "\n".join(f"{name}: {lines[name]}" for name in LISTS if name in lines)
    doc["single_gpu"] = replace_rows(doc.get("single_gpu", []), new.get("single_gpu", []), SINGLE_KEY)
    doc["lasp2"] = replace_rows(doc.get("lasp2", []), new.get("lasp2", []), LASP2_KEY)
    doc["lasp2_step"] = replace_rows(doc.get("lasp2_step", []), new.get("lasp2_step", []), LASP2_KEY)
    # no LASP-2 row means nothing was checked: the flag is not vacuously true
    doc["bit_identical"] = bool(doc["lasp2"]) and all(r["bit_identical"] for r in doc["lasp2"] + doc["lasp2_step"])
    a.into.write_text(json.dumps(doc, indent=2) + "\n")

    if "single_gpu" in new:
        print(f"### single_gpu rows merged into {a.into}\n")
        print(table(["B", "T", "H", "D", "ours fwd ms", "fla fwd ms", "fla / ours", "HBM floor ms", "floor fraction"],
                    new["single_gpu"], lambda r: (r["B"], r["T"], r["H"], r["D"], r["ours_fwd_ms"], r["fla_fwd_ms"],
                                                  r["fla_over_ours"], r["hbm_floor_fwd_ms"], r["floor_fraction_fwd"])))
    if "lasp2" in new:
        print(f"### lasp2 rows merged into {a.into}\n")
        print(table(["W", "B", "T_local", "H", "D", "overlapped ms", "NCCL ms", "NVSHMEM ms", "no-comm ms",
                     "fla CP ms", "fla no-comm ms", "fla CP / overlapped", "bit-identical"],
                    new["lasp2"], lambda r: (r["W"], r["B"], r["T_local"], r["H"], r["D"], r["overlapped_ms"],
                                             r["sequential_nccl_ms"], r["sequential_nvshmem_ms"], r["no_comm_ms"],
                                             r["fla_cp_ms"], r["fla_no_comm_ms"], r["fla_cp_over_overlapped"],
                                             "yes" if r["bit_identical"] else "no")))
    if "lasp2_step" in new:
        print(f"### lasp2_step rows merged into {a.into}\n")
        print(table(["W", "B", "T_local", "H", "D", "overlapped ms", "NCCL ms", "NVSHMEM ms", "no-comm ms",
                     "NCCL / overlapped", "bit-identical"],
                    new["lasp2_step"], lambda r: (r["W"], r["B"], r["T_local"], r["H"], r["D"], r["overlapped_ms"],
                                                  r["sequential_nccl_ms"], r["sequential_nvshmem_ms"],
                                                  r["no_comm_ms"], r["nccl_over_overlapped"],
                                                  "yes" if r["bit_identical"] else "no")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
