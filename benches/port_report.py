#!/usr/bin/env python3
"""Builds benches/results/port.json: a refactoring of the code compared with the commit before it,
on the same GPU node in one job.

  port_report.py OUT.json --device NAME --commit C --baseline-commit B \
      --digests-before DIR --digests-after DIR \
      --single-before F.json... --single-after F.json... \
      --lasp2-forward-before F.json... --lasp2-forward-after F.json... \
      --lasp2-backward-before F.json... --lasp2-backward-after F.json...

Digests: the `digest` program's per-PE files (`digest.pe{N}.json`, FNV-1a of every output of
every case) from each build; `bitwise_equal` is true only if both builds recorded the same keys
and every digest agrees. Timings: `forward_bench --backward --out` files (single GPU) and
`lasp2_forward` / `lasp2_backward --json` files (LASP-2), several per build, run in turns (before,
after, before, ...); each figure is the median over the runs of each build's per-run median.
`ratio` is after / before; `within` says whether it is within the stated bound.

  port_report.py --self-test
"""

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

BOUND = 0.02  # the speed must be unchanged within 2 %


def read_digests(folder):
    digests = {}
    for path in sorted(Path(folder).glob("digest.pe*.json")):
        digests.update(json.loads(path.read_text()))
    if not digests:
        raise SystemExit(f"port_report: no digest.pe*.json in {folder}")
    return digests


def compare_digests(before, after):
    """Per case (the key without its tensor name): the tensors compared and whether all agree."""
    cases = {}
    for key in sorted(set(before) | set(after)):
        case, tensor = key.rsplit(" ", 1)
        entry = cases.setdefault(case, {"case": case, "tensors": [], "equal": True})
        entry["tensors"].append(tensor)
        if before.get(key) is None or before.get(key) != after.get(key):
            entry["equal"] = False
    return list(cases.values())


def timing(before, after):
    b, a = statistics.median(before), statistics.median(after)
    ratio = a / b
    return {
        "before_ms": round(b, 4),
        "after_ms": round(a, 4),
        "ratio": round(ratio, 4),
        "within": bool(ratio <= 1 + BOUND),
        "runs": [len(before), len(after)],
    }


def single_gpu(before_files, after_files):
    """Per shape, forward and backward medians over the runs of each build."""
    def load(files):
        per = {}
        for path in files:
            for s in json.loads(Path(path).read_text())["shapes"]:
                row = per.setdefault(s["dir"], {"forward": [], "backward": []})
                row["forward"].append(s["ours_ms"])
                row["backward"].append(s["backward_ms"])
        return per

    before, after = load(before_files), load(after_files)
    return [
        {
            "shape": shape,
            "forward": timing(before[shape]["forward"], after[shape]["forward"]),
            "backward": timing(before[shape]["backward"], after[shape]["backward"]),
        }
        for shape in before
    ]


def lasp2(before_files, after_files):
    """Per shape and exchange mode, the slowest rank's medians over the runs of each build."""
    modes = ["overlapped_ms", "sequential_nccl_ms", "sequential_nvshmem_ms", "no_comm_ms"]

    def load(files):
        per = {}
        for path in files:
            for r in json.loads(Path(path).read_text()):
                key = f"W={r['W']} B={r['B']} T_local={r['T_local']} H={r['H']} D={r['D']}"
                row = per.setdefault(key, {m: [] for m in modes})
                for m in modes:
                    row[m].append(r[m])
        return per

    before, after = load(before_files), load(after_files)
    return [
        {"shape": key, **{m[:-3]: timing(before[key][m], after[key][m]) for m in modes}}
        for key in before
    ]


def build(args):
    cases = compare_digests(read_digests(args.digests_before), read_digests(args.digests_after))
    report = {
        "device": args.device,
        "commit": args.commit,
        "baseline_commit": args.baseline_commit,
        "date": datetime.date.today().isoformat(),
        "method": (
            "digest: FNV-1a of every output of the single-GPU and LASP-2 scalar-decay forward "
            "and backward on fixed inputs (examples/src/bin/digest.rs), both builds on the same "
            "node; timings: forward_bench --backward (single GPU) and lasp2_forward / "
            "lasp2_backward (every mode, slowest rank) run in turns, before and after; "
            "medians of the per-run medians (CUDA events, warm-up)"
        ),
        "bitwise_equal": all(c["equal"] for c in cases),
        "cases": cases,
        "single_gpu": single_gpu(args.single_before, args.single_after),
        "lasp2_forward": lasp2(args.lasp2_forward_before, args.lasp2_forward_after),
        "lasp2_backward": lasp2(args.lasp2_backward_before, args.lasp2_backward_after),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    slow = [
        f"{part} {row['shape']} {name}"
        for part in ("single_gpu", "lasp2_forward", "lasp2_backward")
        for row in report[part]
        for name, t in row.items()
        if isinstance(t, dict) and not t["within"]
    ]
    print(
        f"port: bitwise_equal {report['bitwise_equal']} over {len(cases)} cases; "
        f"{len(slow)} timings beyond {BOUND:.0%}: {slow}"
    )


def self_test():
    before = {"single B1 o": "a", "single B1 dq": "b", "lasp2 W4 PE0 B2 o": "c"}
    after = dict(before)
    assert all(c["equal"] for c in compare_digests(before, after))
    after["single B1 dq"] = "x"
    cases = compare_digests(before, after)
    assert [c["equal"] for c in cases] == [True, False], cases
    del after["lasp2 W4 PE0 B2 o"]
    assert not compare_digests(before, after)[0]["equal"]
    t = timing([1.0, 1.1, 0.9], [1.05, 1.0, 1.01])
    assert t["before_ms"] == 1.0 and t["after_ms"] == 1.01 and t["within"], t
    assert not timing([1.0], [1.03])["within"]
    print("port_report: self-test passed")


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    for name in ("device", "commit", "baseline-commit", "digests-before", "digests-after"):
        p.add_argument(f"--{name}", required=True)
    for name in ("single", "lasp2-forward", "lasp2-backward"):
        p.add_argument(f"--{name}-before", nargs="+", required=True)
        p.add_argument(f"--{name}-after", nargs="+", required=True)
    build(p.parse_args())


if __name__ == "__main__":
    main()
