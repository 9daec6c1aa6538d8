"""benches/training_report.py: train.py --compare results of several processes merged per
configuration (CPU only)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
import training_report  # noqa: E402

SIDES = training_report.SIDES


def result(seq_len, speeds, losses, date="2026-01-02", paired=1.01, **changes):
    """A train.py --compare result (the fields training_report reads): two runs alternating the
    modes (rank 0's step times 500, then 10, 20, 30, 40 ms: the warm-up's step is left out) and
    the peer (500, 10, 30)."""
    runs = ("overlapped_first", "sequential_first", "fla_peer")
    doc = dict(device="GPU", commit="abc", date=date, W=4, family="gla", steps=5, warmup=1,
               model=dict(seq_len=seq_len, batch=1),
               tokens_per_s=dict(zip(SIDES, speeds)), sequential_over_overlapped_paired=paired,
               peak_mem_gib={s: [1.0, 2.0] for s in SIDES},
               loss_bitwise_identical=True, weights_bitwise_identical=True,
               losses={r: list(losses) for r in runs},
               phase_ms_rank0={s: {"forward": speeds[0] / 10} for s in SIDES},
               alternation=dict(overlapped_first=["overlapped", "sequential_nccl"],
                                sequential_first=["sequential_nccl", "overlapped"]),
               step_ms_rank0=dict(overlapped_first=[500.0, 10.0, 20.0, 30.0, 40.0],
                                  sequential_first=[500.0, 10.0, 20.0, 30.0, 40.0],
                                  fla_peer=[500.0, 10.0, 30.0]))
    doc.update(changes)
    return doc


def test_processes_of_one_configuration_give_medians_and_ratios():
    docs = [result(16, (3, 2, 1), (5, 4, 3)), result(16, (5, 4, 2), (5, 4, 3), date="2026-01-01", paired=0.99),
            result(16, (4, 3, 1), (5, 4, 3), paired=1.03), result(32, (8, 9, 4), (6, 5, 4))]
    merged = training_report.merge(docs)
    assert merged["date"] == "2026-01-01" and merged["W"] == 4
    short, long = merged["runs"]
    assert short["processes"] == 3 and short["tokens_per_s"] == dict(zip(SIDES, (4, 3, 1)))
    assert short["overlapped_over_sequential_nccl"] == pytest.approx(4 / 3, abs=1e-4)
    assert short["overlapped_over_fla_peer"] == 4
    assert short["peak_mem_gib"]["fla_peer"] == 2.0
    assert short["loss_bitwise_identical"] and short["losses_identical_across_processes"]
    assert short["sequential_over_overlapped_paired"] == 1.01
    assert short["sequential_over_overlapped_paired_per_process"] == [1.01, 0.99, 1.03]
    assert short["weights_bitwise_identical"]
    # each side's steps of both alternating runs, after the warm-up's (500 ms): overlapped took
    # steps 2 and 4 of the first run and 1 and 3 of the second
    assert short["step_ms_percentiles"]["overlapped"] == {"p10": 10.0, "p50": 30.0, "p90": 40.0}
    assert short["step_ms_percentiles"]["sequential_nccl"] == {"p10": 10.0, "p50": 30.0, "p90": 40.0}
    assert short["step_ms_percentiles"]["fla_peer"] == {"p10": 10.0, "p50": 30.0, "p90": 30.0}
    assert short["phase_ms_rank0"]["overlapped"]["forward"] == pytest.approx(0.4)
    assert long["model"]["seq_len"] == 32 and long["overlapped_over_sequential_nccl"] == pytest.approx(8 / 9, abs=1e-4)


def test_a_process_whose_losses_differ_is_reported():
    docs = [result(16, (3, 2, 1), (5, 4, 3)), result(16, (3, 2, 1), (5, 4, 2.5))]
    [run] = training_report.merge(docs)["runs"]
    assert not run["losses_identical_across_processes"]
    docs[1]["loss_bitwise_identical"] = False
    docs[0]["weights_bitwise_identical"] = False
    [run] = training_report.merge(docs)["runs"]
    assert not run["loss_bitwise_identical"] and not run["weights_bitwise_identical"]


def test_files_of_different_builds_or_single_runs_are_refused():
    with pytest.raises(SystemExit, match="disagree on commit"):
        training_report.merge([result(16, (3, 2, 1), (1,)), result(16, (3, 2, 1), (1,), commit="def")])
    single = result(16, (3, 2, 1), (1,))
    single["tokens_per_s"] = 3.0
    with pytest.raises(SystemExit, match="--compare"):
        training_report.merge([single])
