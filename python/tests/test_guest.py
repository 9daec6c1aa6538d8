"""Guest mode across the ranks of a torchrun job: PyTorch's SymmetricMemory NVSHMEM backend
initialises NVSHMEM (a symmetric tensor allocated and rendezvoused through torch), then
lasp_shmem.torch.init joins it, and LASP-2 runs beside torch's symmetric tensor: every rank's
output equals the single-GPU op's on the whole sequences, and torch's tensor keeps its contents.
It needs a process of its own (NVSHMEM starts once per process), so it runs only when asked:

    LASP_TEST_GUEST=1 NVSHMEM_DISABLE_NVLS=1 NVSHMEM_REMOTE_TRANSPORT=none \\
        torchrun --nproc-per-node 4 -m pytest python/tests/test_guest.py
"""

import os

import pytest
import torch
import torch.distributed as dist
from reference import inputs, rel_err

import lasp_shmem.torch as lt
from lasp_shmem import _abi

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or WORLD < 2 or os.environ.get("LASP_TEST_GUEST") != "1",
    reason="NOTICE: guest-mode test skipped: run it alone under torchrun with 2 or more GPUs "
           "and LASP_TEST_GUEST=1")
TOL = 5e-3


def test_lasp2_joins_the_nvshmem_of_torch_symmetric_memory():
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    symm_mem.set_backend("NVSHMEM")
    theirs = symm_mem.empty(1 << 16, dtype=torch.float32, device="cuda")
    symm_mem.rendezvous(theirs, dist.group.WORLD)
    theirs.fill_(dist.get_rank() + 0.5)
    assert _abi.nvshmem_initialized(), "torch's NVSHMEM backend did not initialise NVSHMEM"

    lt.init()
    rank, per_rank = dist.get_rank(), 300
    q, k, v, g, h0 = inputs(2, per_rank * WORLD, 3, 64, 128, "cuda", seed=5)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    shard = [x[:, mine].contiguous() for x in (q, k, v, g)]
    o, _ = lt.chunk_simple_gla(*shard, initial_state=h0, cp_group=dist.group.WORLD)
    whole, _ = lt.chunk_simple_gla(q, k, v, g, initial_state=h0)
    err = rel_err(o, whole[:, mine])
    torch.cuda.synchronize()
    assert err <= TOL, f"rank {rank}: o rel err {err:.2e} beside torch's NVSHMEM"
    assert bool((theirs == rank + 0.5).all()), "torch's symmetric tensor changed"
    lt.shutdown()  # never finalizes torch's NVSHMEM: torch's tensor is still usable
    theirs.add_(1.0)
    torch.cuda.synchronize()
    dist.destroy_process_group()
