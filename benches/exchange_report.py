"""Merges the results of several exchange_bench processes into one exchange.json: per size, the
median over processes of our time and of NCCL's, the speedup as the ratio of those medians, and
every process's value beside them (`*_runs`).

Why several processes: on the 4x H200 node NCCL's all-gather time is set per process and moves by
a few per cent from one to the next (66.1-69.6 us at 4 MiB per rank over 16 processes in
two jobs), while ours stays within 0.3 us; one process's ratio is a
draw from NCCL's spread, the ratio of medians over processes is not.

Usage: python3 benches/exchange_report.py OUT.json RUN.json [RUN.json ...]
       python3 benches/exchange_report.py --self-test
"""
import json
import statistics
import sys

# Per-row keys that are one measurement per process (merged by their median); the speedups and
# bandwidths derived from them are recomputed from the medians.
TIMES = ("device_us", "nccl_us", "nccl_window_us", "nccl_nvshmem_window_us", "harness_floor_us",
         "device_batch_us", "nccl_batch_us")
# Keys every process must agree on: results of different set-ups are never merged.
SETUP = ("device", "commit", "W", "variant", "threads_per_cta")


def egress_gbps(bytes_per_rank, npes, us):
    return bytes_per_rank * (npes - 1) / (us * 1e-6) / 1e9


def merge(runs):
    """The merged results (a dict) of `runs`, each the dict of one exchange_bench file."""
    if not runs:
        raise ValueError("no exchange_bench results to merge")
    first = runs[0]
    for key in SETUP:
        values = {json.dumps(run.get(key)) for run in runs}
        if len(values) > 1:
            raise ValueError(f"runs differ in {key!r} ({', '.join(sorted(values))}): merge only runs of one set-up")
    sizes = [row["bytes_per_rank"] for row in first["rows"]]
    for run in runs:
        if [row["bytes_per_rank"] for row in run["rows"]] != sizes:
            raise ValueError("runs measured different sizes: run every process with the same --sizes")

    npes = first["W"]
    rows = []
    for i, size in enumerate(sizes):
        per_run = [run["rows"][i] for run in runs]
        row = {"bytes_per_rank": size, "ctas": per_run[0]["ctas"]}
        for key in TIMES:
            if all(key in r for r in per_run):
                values = [r[key] for r in per_run]
                row[key] = round(statistics.median(values), 3)
                row[key + "_runs"] = values
        row["speedup_vs_nccl"] = round(row["nccl_us"] / row["device_us"], 4)
        row["egress_gbps"] = round(egress_gbps(size, npes, row["device_us"]), 2)
        if "device_batch_us" in row and "nccl_batch_us" in row:
            row["speedup_vs_nccl_batch"] = round(row["nccl_batch_us"] / row["device_batch_us"], 4)
        rows.append(row)

    def at(size):
        return next((row for row in rows if row["bytes_per_rank"] == size), None)

    def speedup_at(size):
        row = at(size)
        return row["speedup_vs_nccl"] if row else None

    eight = at(8 << 20)
    pingpongs = [run["pingpong_rtt_us"] for run in runs if run.get("pingpong_rtt_us") is not None]
    merged = {key: first[key] for key in (*SETUP, "date")}
    merged["method"] = (
        first["method"]
        + f"; {len(runs)} processes, each measuring ours and NCCL's: every time is the median over"
        " processes of the per-process values in *_runs, every speedup the ratio of those medians"
    )
    merged["processes"] = len(runs)
    merged["gbps_egress_8MiB"] = eight["egress_gbps"] if eight else None
    merged["pingpong_rtt_us"] = round(statistics.median(pingpongs), 4) if pingpongs else None
    merged["speedup_vs_nccl_1MiB"] = speedup_at(1 << 20)
    merged["speedup_vs_nccl_4MiB"] = speedup_at(4 << 20)
    merged["rows"] = rows
    return merged


def self_test():
    def run(device_us, nccl_us, pingpong):
        return {
            "device": "GPU x4", "commit": "abc", "date": "d", "W": 4, "variant": "dynamic",
            "threads_per_cta": 512, "method": "m", "pingpong_rtt_us": pingpong,
            "rows": [{"bytes_per_rank": 4 << 20, "device_us": device_us, "nccl_us": nccl_us, "ctas": 64}],
        }

    merged = merge([run(45.0, 66.0, 1.7), run(44.0, 69.0, 1.8), run(46.0, 68.0, 1.9)])
    row = merged["rows"][0]
    assert row["device_us"] == 45.0 and row["nccl_us"] == 68.0, row
    assert row["device_us_runs"] == [45.0, 44.0, 46.0], row
    assert merged["speedup_vs_nccl_4MiB"] == round(68.0 / 45.0, 4), merged
    assert merged["speedup_vs_nccl_1MiB"] is None and merged["gbps_egress_8MiB"] is None, merged
    assert merged["pingpong_rtt_us"] == 1.8 and merged["processes"] == 3, merged
    other = run(45.0, 66.0, 1.7)
    other["variant"] = "cta-loop"
    for bad in ([], [run(45.0, 66.0, 1.7), other]):
        try:
            merge(bad)
        except ValueError:
            continue
        raise AssertionError(f"merged runs that must be refused: {bad}")
    print("exchange_report self-test: ok")


def main(argv):
    if argv == ["--self-test"]:
        self_test()
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, paths = argv[0], argv[1:]
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    try:
        merged = merge(runs)
    except ValueError as e:
        print(f"exchange_report: {e}", file=sys.stderr)
        return 1
    with open(out, "w") as f:
        json.dump(merged, f, indent=2)
        f.write("\n")
    for row in merged["rows"]:
        print(
            f"all-gather {row['bytes_per_rank'] >> 10:>6} KiB/rank: device {row['device_us']:8.1f} us"
            f" (runs {row['device_us_runs']})  NCCL {row['nccl_us']:8.1f} us (runs {row['nccl_us_runs']})"
            f"  speedup {row['speedup_vs_nccl']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
