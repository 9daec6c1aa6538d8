"""Merges the results of examples/python/train.py --compare (one JSON per process; any number of
configurations: sequence length and batch) into training.json and its PNG.

    python3 benches/training_report.py out/training_16384_*.json out/training_32768_*.json \\
        --out benches/results/training.json

The processes must agree on device, commit, W, family, steps and warmup (the file's top level;
date is the earliest). One `runs` entry per configuration (the model), with:
tokens_per_s, the median over its processes of each side's (overlapped, sequential_nccl, fla_peer)
and tokens_per_s_per_process beside it (step times vary between processes, as fla's kernel times
do); overlapped_over_sequential_nccl and overlapped_over_fla_peer, ratios of those medians;
sequential_over_overlapped_paired, the median over processes of train.py's paired step ratio (and
per process); peak_mem_gib, each side's largest over processes and ranks (None from CPU runs); loss_bitwise_identical
and weights_bitwise_identical, true where they hold in every process;
losses_identical_across_processes (the training is deterministic, so a process whose losses differ
from the first's is a finding); step_ms_percentiles, each side's 10th, 50th and 90th percentile of
rank 0's step times after the warm-up, over all processes; phase_ms_rank0, each side's phases'
medians over processes; losses, the first process's, by run. The PNG has one row per
configuration: the loss curves and the tokens/s.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

SIDES = ("overlapped", "sequential_nccl", "fla_peer")
COMMON = ("device", "commit", "W", "family", "steps", "warmup")


def percentiles(values, points=(10, 50, 90)):
    ordered = sorted(values)
    return {f"p{p}": round(ordered[min(len(ordered) - 1, len(ordered) * p // 100)], 1) for p in points}


def side_steps(doc, side):
    """Rank 0's step times (ms) of `side` after the warm-up in one process's runs."""
    steps = []
    for name, ms in doc["step_ms_rank0"].items():
        modes = doc["alternation"].get(name, (name,))
        steps += [t for i, t in enumerate(ms) if i >= doc["warmup"] and modes[i % len(modes)] == side]
    return steps


def merge_run(docs):
    """One `runs` entry from the processes of one configuration."""
    first = docs[0]
    speed = {s: [d["tokens_per_s"][s] for d in docs] for s in SIDES}
    median = {s: round(statistics.median(v), 1) for s, v in speed.items()}
    paired = [d["sequential_over_overlapped_paired"] for d in docs]
    phases = [d["phase_ms_rank0"] for d in docs]
    return dict(
        model=first["model"], processes=len(docs),
        tokens_per_s=median, tokens_per_s_per_process=speed,
        overlapped_over_sequential_nccl=round(median["overlapped"] / median["sequential_nccl"], 4),
        overlapped_over_fla_peer=round(median["overlapped"] / median["fla_peer"], 4),
        sequential_over_overlapped_paired=round(statistics.median(paired), 4),
        sequential_over_overlapped_paired_per_process=paired,
        peak_mem_gib={s: max(max(d["peak_mem_gib"][s]) for d in docs)
                      if all(d["peak_mem_gib"][s] for d in docs) else None for s in SIDES},
        loss_bitwise_identical=all(d["loss_bitwise_identical"] for d in docs),
        weights_bitwise_identical=all(d["weights_bitwise_identical"] for d in docs),
        losses_identical_across_processes=all(d["losses"] == first["losses"] for d in docs),
        step_ms_percentiles={s: percentiles([ms for d in docs for ms in side_steps(d, s)]) for s in SIDES},
        phase_ms_rank0={
            s: {name: round(statistics.median(p[s][name] for p in phases), 3) for name in phases[0][s]}
            for s in SIDES},
        losses=first["losses"],
    )


def merge(docs):
    for d in docs:
        if "tokens_per_s" not in d or not isinstance(d["tokens_per_s"], dict):
            raise SystemExit("training_report: every file must come from train.py --compare")
        for k in COMMON:
            if d[k] != docs[0][k]:
                raise SystemExit(f"training_report: the files disagree on {k}: {d[k]!r} and {docs[0][k]!r}")
    groups = {}
    for d in docs:
        key = json.dumps(d["model"], sort_keys=True)
        groups.setdefault(key, []).append(d)
    runs = sorted((merge_run(g) for g in groups.values()),
                  key=lambda r: (r["model"]["seq_len"], r["model"]["batch"]))
    out = {k: docs[0][k] for k in COMMON}
    out["date"] = min(d["date"] for d in docs)
    out["method"] = (
        "examples/python/train.py --compare, one torchrun job per process: ours trained twice from "
        "the same seed with the overlapped and sequential_nccl modes alternating step by step (one "
        "run starting with each), then the fla peer from the same seed; tokens/s = batch x seq_len "
        "over the median of rank 0's step times after the warm-up (a step: forward, backward, "
        "gradient all-reduce, AdamW, the loss's all-reduce and the host's wait for the GPU; the "
        "batch drawn before it), ours' modes over their steps of both runs; per configuration the "
        "median over processes")
    out["runs"] = runs
    return out


def plot(path, result):
    try:
        import matplotlib
    except ImportError:
        print("training_report: matplotlib does not import here, so no plot was written", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for (left, right), run in zip(axes, runs):
        m = run["model"]
        what = f"T = {m['seq_len'] // 1024}K, B = {m['batch']}"
        # dashed over solid: bitwise-equal curves stay visible
        for (name, losses), style in zip(run["losses"].items(), ("-", "--", ":")):
            left.plot(range(len(losses)), losses, style, label=name)
        left.set(xlabel="step", ylabel="loss", title=f"GLA LM, W = {result['W']}, {what}")
        left.legend()
        speeds = run["tokens_per_s"]
        bars = right.bar(list(speeds), list(speeds.values()))
        right.bar_label(bars, labels=[f"{v / speeds['fla_peer']:.2f}x" for v in speeds.values()])
        right.margins(y=0.12)
        right.set(ylabel="tokens/s", title=f"median over {run['processes']} process(es); x = vs fla_peer")
    fig.tight_layout()
    fig.savefig(path)
    print(f"training_report: wrote {path}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="train.py --compare --out files")
    ap.add_argument("--out", required=True, help="training.json to write (its .png beside it)")
    args = ap.parse_args(argv)
    result = merge([json.loads(Path(f).read_text()) for f in args.results])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for run in result["runs"]:
        m = run["model"]
        print(f"T={m['seq_len']} B={m['batch']}: tokens/s {run['tokens_per_s']}, "
              f"overlapped / sequential_nccl {run['overlapped_over_sequential_nccl']}, "
              f"overlapped / fla_peer {run['overlapped_over_fla_peer']}, "
              f"paired sequential / overlapped {run['sequential_over_overlapped_paired']}, "
              f"losses bitwise {run['loss_bitwise_identical']}, "
              f"weights bitwise {run['weights_bitwise_identical']}", flush=True)
    plot(Path(args.out).with_suffix(".png"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
