"""examples/python/train.py on the CPU: gloo ranks train its tiny model (--cpu) with lasp_shmem's
LASP-2 chunk_gla on float64 stand-ins for its kernels (the library needs a GPU) and fla's on the
peer's (benches/gla_lasp2_peer.py). test_train_cpu.py runs it; by hand:

    PYTHONPATH=python python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        python/tests/train_cpu.py --compare --out /tmp/training.json
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import lasp_shmem.torch as lt
from reference import gradients  # this folder's float64 reference (the script's own folder)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "python"))
import train  # noqa: E402

peer = train.peer


def install_standins(group, rank, world):
    """lasp_shmem.torch's LASP-2 chunk_gla on the CPU: a runtime with no library behind it (the
    ops made by the library are never called) and CPU kernels for its custom ops, the peer's
    composition with its float64 stand-ins for fla in the forward and, in the backward, that
    composition's states (P from the earlier ranks, D from the later ones) with the float64
    reference backward of python/tests/reference.py (autograd does not run inside a custom op's
    kernel)."""
    lt._runtime = lt._Runtime(None, group, tuple(dist.get_process_group_ranks(group)), rank, world, 0)
    lt._check_device = lambda *args, **kwargs: None
    # set_exchange_mode loads the library before switching the ops made so far, which are none
    lt._abi.library = lambda: None
    torch.cuda.is_current_stream_capturing = lambda: False
    ops = peer.reference_ops(torch)

    def composition(q, k, v, g, scale):
        return peer.Peer(q, k, v, g, scale, "chunk_fwd_h", dist, torch, ops, group=group)

    @torch.library.register_kernel("lasp_shmem::chunk_gla_fwd", "cpu")
    def _(q, k, v, g, h0, scale, want_ht, lasp2, save_states, cu_seqlens=None, shard_start=0):
        assert lasp2 and h0 is None and not want_ht and cu_seqlens is None, \
            "the model calls LASP-2 without states or packed documents"
        o, ht, states = lt._gla_forward_outputs(q, v, want_ht, save_states)
        o.copy_(composition(q, k, v, g, scale)())
        states.zero_()  # the backward below recomputes its start state instead of reading these
        return o, ht, states

    @torch.library.register_kernel("lasp_shmem::chunk_gla_bwd", "cpu")
    def _(q, k, v, g, h0, states, do, dht, scale, want_dh0, lasp2, cu_seqlens=None,
          shard_start=0):
        c = composition(q, k, v, g, scale)
        c()
        c.do = do
        c.dstates()
        c.dallgather()
        c.dfold()
        outputs = lt._backward_outputs(q, k, v, g, want_dh0)
        for out, grad in zip(outputs[:4], gradients(q, k, v, g, c.P, do, c.D, scale)):
            out.copy_(grad)
        return outputs


if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:] + ["--cpu"], init_ours=install_standins))
