"""The schedule matrix: LASP-2 rows timed with the planner (lasp2_forward / lasp2_backward --plan)
merged into schedules.json, with each row checked against the planner's bounds.

    python3 benches/schedules_report.py --forward fwd_w4.json fwd_w2.json \\
        --backward bwd_w4.json bwd_w2.json --family scalar_decay --out schedules.json
    python3 benches/schedules_report.py --forward gla_w4.json --family gla --into schedules.json
    python3 benches/schedules_report.py --plot schedules.json schedules.png   # needs matplotlib
    python3 benches/schedules_report.py --self-test    # CPU only, no files

Each input is what `lasp-run -n W lasp2_forward --no-check --plan --time ... --json FILE` (or
lasp2_backward) wrote: rows of W, B, T_local, H, D, every mode's slowest-rank median, planner_ms,
planner_choice, link. A row of schedules.json names its family, direction, the all-gather
schedule's time (`allgather_ms`, the overlapped mode), the pipelined chain's (`chain_ms`, null
where the family has none), `sequential_nccl_ms`, `no_comm_ms`, the planner's time and choice,
`link` ("nvlink" or the emulated links' label), and the bounds (`--into FILE` replaces the rows of
an existing file with the same family, direction, W, shape and link, and keeps the others):
  planner_ms <= 1.03 x min(allgather_ms, chain_ms, sequential_nccl_ms)       (never loses)
  where the exchange is >= 10 % of the layer (sequential_nccl_ms >= 1.10 x no_comm_ms):
      sequential_nccl_ms / planner_ms >= 1.15                                (wins where it matters)
  where it is < 20 %: planner_ms <= 1.05 x no_comm_ms                        (hides it)
Under emulated links the sequential modes' host gathers still run at NVLink's rate, so their
times are kept as `sequential_nccl_unpaced_ms` and the bounds take the all-gather in NCCL's place.
NCCL at its best: `--plain-forward` / `--plain-backward` take the same programs' rows run with
LASP_NCCL_WINDOW=0 (NCCL's all-gather on plain memory) beside the default run's (on a symmetric
NCCL window); a row then keeps both, `sequential_nccl_window_ms` and `sequential_nccl_plain_ms`,
and `sequential_nccl_ms` is the faster.
Device, commit and date come from LASP_DEVICE, LASP_COMMIT and LASP_DATE; every row names its own."""
import argparse
import json
import os
import sys
from pathlib import Path

NEVER_LOSES = 1.03
EXCHANGE_MATTERS = 1.10
WINS_BY = 1.15
EXCHANGE_SMALL = 1.20
HIDES_WITHIN = 1.05


def provenance():
    """The run's device, commit and date, as the environment names them."""
    return {key: os.environ.get(f"LASP_{key.upper()}", "unknown") for key in ("device", "commit", "date")}


def row(family, direction, r, origin=None, plain=None):
    """One schedules.json row from a --plan row (and the same shape's row with NCCL on plain
    memory, where given), with its bounds and where it was measured."""
    variants = {}
    if plain is not None:
        variants = {f"sequential_nccl_{r.get('nccl_baseline', 'window')}_ms": r["sequential_nccl_ms"],
                    f"sequential_nccl_{plain.get('nccl_baseline', 'plain')}_ms": plain["sequential_nccl_ms"]}
        r = dict(r, sequential_nccl_ms=min(r["sequential_nccl_ms"], plain["sequential_nccl_ms"]))
    link = r.get("link", "nvlink")
    paced = link == "nvlink"  # every mode's exchange moved at the link's rate
    chain = r.get("pipelined_chain_ms")
    # The sequential baseline: NCCL where it ran over the same links, else the all-gather.
    baseline = r["sequential_nccl_ms"] if paced else r["overlapped_ms"]
    best = min(t for t in (r["overlapped_ms"], chain, r["sequential_nccl_ms"] if paced else None) if t is not None)
    exchange_share = baseline / r["no_comm_ms"]
    out = {
        "family": family, "direction": direction, **(origin or {}),
        "W": r["W"], "B": r["B"], "T_local": r["T_local"], "H": r["H"], "D": r["D"],
        "planner_ms": r["planner_ms"], "planner_choice": r["planner_choice"],
        "allgather_ms": r["overlapped_ms"], "chain_ms": chain,
        "sequential_nccl_ms": r["sequential_nccl_ms"] if paced else None,
        "sequential_nvshmem_ms": r["sequential_nvshmem_ms"] if paced else None,
        **(variants if paced else {}),
        "no_comm_ms": r["no_comm_ms"], "link": link,
        "planner_over_best": round(r["planner_ms"] / best, 4),
        "sequential_nccl_over_planner": round(baseline / r["planner_ms"], 4),
        "planner_over_no_comm": round(r["planner_ms"] / r["no_comm_ms"], 4),
    }
    if not paced:
        out["sequential_nccl_unpaced_ms"] = r["sequential_nccl_ms"]
        out["baseline"] = "allgather_ms (the sequential modes' gathers are not paced)"
    bounds = {"never_loses": out["planner_over_best"] <= NEVER_LOSES}
    if exchange_share >= EXCHANGE_MATTERS:
        bounds["wins_where_exchange_matters"] = out["sequential_nccl_over_planner"] >= WINS_BY
    if exchange_share < EXCHANGE_SMALL:
        bounds["hides_small_exchange"] = out["planner_over_no_comm"] <= HIDES_WITHIN
    out["bounds_met"] = bounds
    if "planner_measured_ms" in r:
        out["planner_measured_ms"] = r["planner_measured_ms"]
    return out


def key(r):
    """What a new row replaces in an earlier file: the same family, direction, W, shape and link."""
    return (r["family"], r["direction"], r["W"], r["B"], r["T_local"], r["H"], r["D"], r.get("link", "nvlink"))


def shape_key(r):
    return (r["W"], r["B"], r["T_local"], r["H"], r["D"], r.get("link", "nvlink"))


def merge(family, forward, backward, origin=None, others=(), plain_forward=(), plain_backward=()):
    """The rows of `others` (an earlier file's) that no input replaces, then every input's rows,
    forward first, each as timed, each with its shape's row of the plain-memory NCCL runs where
    there is one."""
    plain = {direction: {shape_key(r): r for doc in docs for r in doc}
             for direction, docs in (("forward", plain_forward), ("backward", plain_backward))}
    new = [row(family, direction, r, origin, plain[direction].get(shape_key(r)))
           for direction, docs in (("forward", forward), ("backward", backward)) for doc in docs for r in doc]
    replaced = {key(r) for r in new}
    return [r for r in others if key(r) not in replaced] + new


def summary(rows):
    """Per bound: rows where it applies and rows that meet it."""
    out = {}
    for r in rows:
        for bound, met in r["bounds_met"].items():
            s = out.setdefault(bound, {"rows": 0, "met": 0})
            s["rows"] += 1
            s["met"] += int(met)
    return out


def plot(doc, path):
    """Each schedule's time over the no-comm time, against the exchange-to-compute ratio
    (sequential NCCL's exchange time over the compute time), one panel per direction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = sorted({r["direction"] for r in doc["rows"]}, reverse=True)
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions), 4.5), squeeze=False)
    series = (("allgather_ms", "all-gather (overlapped)", "o"), ("chain_ms", "pipelined chain", "^"),
              ("sequential_nccl_ms", "sequential NCCL", "s"), ("planner_ms", "planner's choice", "x"))
    for ax, direction in zip(axes[0], directions):
        rows = [r for r in doc["rows"] if r["direction"] == direction and r["link"] == "nvlink"]
        for name, label, marker in series:
            have = [r for r in rows if r[name] is not None]
            ratio = [r["sequential_nccl_ms"] / r["no_comm_ms"] - 1 for r in have]
            ax.scatter(ratio, [r[name] / r["no_comm_ms"] for r in have], label=label, marker=marker, s=28)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("exchange / compute (sequential NCCL's exchange time over no-comm)")
        ax.set_ylabel("time / no-comm time")
        families = ", ".join(sorted({r["family"] for r in rows}))
        ax.set_title(f"{direction}, NVLink: {families}; W = 2, 4")
        ax.legend()
    fig.suptitle(f"LASP-2 schedules, {', '.join(doc['device'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def self_test():
    """The bounds on made-up rows: a planner at the best mode, one that lost, a row where the exchange
    is small and one where it is large."""
    def plan_row(ovl, seq, nc, planner, w=4):
        return dict(W=w, B=4, T_local=8192, H=16, D=128, overlapped_ms=ovl, sequential_nccl_ms=seq,
                    sequential_nvshmem_ms=seq * 1.02, no_comm_ms=nc, planner_ms=planner,
                    planner_choice="overlapped, 1 head group(s), 2 CTA/SM")

    big = row("sd", "forward", plan_row(0.30, 0.40, 0.25, 0.30))
    assert big["bounds_met"] == {"never_loses": True, "wins_where_exchange_matters": True}, big
    lost = row("sd", "forward", plan_row(0.30, 0.31, 0.20, 0.33))
    assert lost["bounds_met"] == {"never_loses": False, "wins_where_exchange_matters": False}, lost
    small = row("sd", "backward", plan_row(1.00, 1.02, 0.99, 1.01))
    assert small["bounds_met"] == {"never_loses": True, "hides_small_exchange": True}, small
    mid = row("sd", "forward", plan_row(0.36, 0.40, 0.35, 0.36))
    assert set(mid["bounds_met"]) == {"never_loses", "wins_where_exchange_matters", "hides_small_exchange"}
    assert mid["chain_ms"] is None and mid["link"] == "nvlink"
    chained = row("sd", "forward", dict(plan_row(0.30, 0.40, 0.25, 0.26), pipelined_chain_ms=0.26))
    assert chained["chain_ms"] == 0.26 and chained["planner_over_best"] == 1.0
    lost_to_chain = row("sd", "forward", dict(plan_row(0.30, 0.40, 0.25, 0.30), pipelined_chain_ms=0.26))
    assert lost_to_chain["bounds_met"]["never_loses"] is False
    # Emulated links: the all-gather is the baseline, the unpaced NCCL time is kept aside.
    ib = dict(plan_row(0.85, 0.41, 0.33, 0.55), pipelined_chain_ms=0.55, link="ib-emulated: 1 GPU per node")
    emulated = row("sd", "forward", ib)
    assert emulated["sequential_nccl_ms"] is None and emulated["sequential_nccl_unpaced_ms"] == 0.41
    assert emulated["bounds_met"] == {"never_loses": True, "wins_where_exchange_matters": True}, emulated
    rows = merge("sd", [[plan_row(0.30, 0.40, 0.25, 0.30)]], [[plan_row(0.30, 0.31, 0.20, 0.33, w=2)]])
    assert [r["direction"] for r in rows] == ["forward", "backward"] and rows[1]["W"] == 2
    assert summary(rows) == {"never_loses": {"rows": 2, "met": 1},
                             "wins_where_exchange_matters": {"rows": 2, "met": 1}}
    gla = merge("gla", [[plan_row(0.5, 0.6, 0.45, 0.5)]], [], {"commit": "b"}, others=rows)
    assert [r["family"] for r in gla] == ["sd", "sd", "gla"] and gla[2]["commit"] == "b"
    # Both NCCL baselines: the faster one is the row's, both are kept.
    window = dict(plan_row(0.30, 0.40, 0.25, 0.30), nccl_baseline="window")
    on_plain = dict(plan_row(0.31, 0.45, 0.25, 0.31), nccl_baseline="plain")
    both = merge("sd", [[window]], [], plain_forward=[[on_plain]])[0]
    assert (both["sequential_nccl_window_ms"], both["sequential_nccl_plain_ms"]) == (0.40, 0.45)
    assert both["sequential_nccl_ms"] == 0.40 and both["sequential_nccl_over_planner"] == round(0.40 / 0.30, 4)
    faster_plain = merge("sd", [[dict(window, sequential_nccl_ms=0.5)]], [], plain_forward=[[on_plain]])[0]
    assert faster_plain["sequential_nccl_ms"] == 0.45
    again = merge("sd", [[plan_row(0.30, 0.40, 0.25, 0.30)]], [ [ib] ], others=gla)
    assert [(r["family"], r["direction"]) for r in again] == [("sd", "backward"), ("gla", "forward"),
                                                              ("sd", "forward"), ("sd", "backward")]
    print("schedules_report: self-test passed")
    return 0


def main(argv=None):
    if argv is None and sys.argv[1:] == ["--self-test"]:
        return self_test()
    if argv is None and sys.argv[1:2] == ["--plot"] and len(sys.argv) == 4:
        plot(json.loads(Path(sys.argv[2]).read_text()), sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forward", nargs="*", type=Path, default=[], metavar="F")
    ap.add_argument("--backward", nargs="*", type=Path, default=[], metavar="F")
    ap.add_argument("--plain-forward", nargs="*", type=Path, default=[], metavar="F",
                    help="the forward's rows run with LASP_NCCL_WINDOW=0")
    ap.add_argument("--plain-backward", nargs="*", type=Path, default=[], metavar="F",
                    help="the backward's rows run with LASP_NCCL_WINDOW=0")
    ap.add_argument("--family", required=True)
    ap.add_argument("--method", default=(
        "lasp2_forward / lasp2_backward --no-check --plan: per shape the planner times its candidates "
        "(one untimed round, then 3 rounds of 2 untimed and 3 timed calls each, slowest rank's median) "
        "and picks one; then every mode and the planner's choice take turns (6 rounds of 2 untimed "
        "and 5 timed calls, each call after an on-stream barrier, CUDA events); slowest rank's median"))
    out = ap.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", type=Path, help="write a new file")
    out.add_argument("--into", type=Path, help="replace this family's rows of an existing file")
    args = ap.parse_args(argv)
    load = lambda paths: [json.loads(p.read_text()) for p in paths]
    previous = json.loads(args.into.read_text()) if args.into else {}
    others = previous.get("rows", [])
    rows = merge(args.family, load(args.forward), load(args.backward), provenance(), others,
                 load(args.plain_forward), load(args.plain_backward))
    origins = sorted({(r.get("device"), r.get("commit"), r.get("date")) for r in rows}, key=str)
    doc = {
        "device": sorted({o[0] for o in origins if o[0]}),
        "commit": sorted({o[1] for o in origins if o[1]}),
        "date": max((o[2] for o in origins if o[2]), default="unknown"),
        "config": ("H = 16, Dk = Dv = 128, bf16, per-GPU shapes; W GPUs of one node over NVLink, or with "
                   "LASP_EMULATE_LINKS (link: the emulated nodes, latency and rate)"),
        "method": args.method,
        "bit_identical_across_schedules": (
            "every family: the all-gather, the pipelined chain and the sequential modes give bitwise "
            "the same outputs and gradients (the checks of lasp2_forward, lasp2_backward, gla_lasp2, "
            "gated_delta_lasp2, forward and backward, and mlstm_lasp2, the forward; for scalar decay "
            "also head groups 1, 3 and 6 under both device schedules and graph replays, and under "
            "emulated links); the planner offers only launch plans that keep the bits"),
        "projected_weak_scaling_8_to_64": previous.get("projected_weak_scaling_8_to_64"),
        "model": previous.get("model"),
        "bounds": {"never_loses": NEVER_LOSES, "exchange_matters_from": EXCHANGE_MATTERS,
                   "wins_by": WINS_BY, "exchange_small_below": EXCHANGE_SMALL, "hides_within": HIDES_WITHIN},
        "summary": summary(rows),
        "rows": rows,
    }
    (args.out or args.into).write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        chain = "-" if r["chain_ms"] is None else f"{r['chain_ms']:.4f}"
        print(f"{r['direction']:8} W={r['W']} B={r['B']:2} T={r['T_local']:6} {r['link'][:11]}: planner "
              f"{r['planner_ms']:.4f} ({r['planner_choice']}) all-gather {r['allgather_ms']:.4f} chain {chain} "
              f"baseline {r['sequential_nccl_over_planner']:.3f}x no-comm {r['no_comm_ms']:.4f} {r['bounds_met']}")
    print(json.dumps(doc["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
