"""examples/python/train.py on the CPU (train_cpu.py): two gloo ranks train the tiny GLA model with
each backend (float64 stand-ins for lasp_shmem's kernels and for fla) and write the comparison
JSON."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import lasp_shmem

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_the_training_dry_run_alternates_the_modes_and_compares_the_peer(tmp_path):
    out = tmp_path / "training.json"
    # the lasp_shmem package these tests import, in the ranks too
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(lasp_shmem.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(ROOT / "python/tests/train_cpu.py"), "--compare", "--out", str(out)],
                   env=env, check=True, timeout=120)
    result = json.loads(out.read_text())
    sides = {"overlapped", "sequential_nccl", "fla_peer"}
    runs = {"overlapped_first", "sequential_first", "fla_peer"}
    assert result["W"] == 2 and result["family"] == "gla"
    assert set(result["tokens_per_s"]) == set(result["phase_ms_rank0"]) == sides
    assert all(speed > 0 for speed in result["tokens_per_s"].values())
    assert result["sequential_over_overlapped_paired"] > 0
    for phases in result["phase_ms_rank0"].values():
        assert set(phases) == {"forward", "backward", "gradient_all_reduce", "optimizer"}
        assert all(ms > 0 for ms in phases.values())
    assert result["alternation"] == {"overlapped_first": ["overlapped", "sequential_nccl"],
                                     "sequential_first": ["sequential_nccl", "overlapped"]}
    assert set(result["step_ms_rank0"]) == set(result["losses"]) == runs
    for step_ms in result["step_ms_rank0"].values():
        assert len(step_ms) == result["steps"] and all(ms > 0 for ms in step_ms)
    assert result["loss_bitwise_identical"] and result["weights_bitwise_identical"]
    for losses in result["losses"].values():
        assert len(losses) == result["steps"] and all(map(math.isfinite, losses))
        assert losses[-1] < losses[0]
    # the stand-ins compute the same LASP-2 in float64, so the backends agree to bf16's rounding
    for a, b in zip(result["losses"]["overlapped_first"], result["losses"]["fla_peer"]):
        assert a == pytest.approx(b, rel=1e-3)
