"""The fla peers of the benchmarks (benches/gla_lasp2_peer.py, gated_delta_cp_peer.py, short_conv_peer.py) on
the CPU: each one's --self-test runs its composition under gloo with float64 stand-ins for fla and
fails where the plumbing (fold order, mapping, shard slicing) is broken."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.parametrize("script", ["gla_lasp2_peer.py", "gated_delta_cp_peer.py", "short_conv_peer.py"])
def test_the_peer_passes_its_self_test(script):
    run = subprocess.run([sys.executable, str(ROOT / "benches" / script), "--self-test"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
