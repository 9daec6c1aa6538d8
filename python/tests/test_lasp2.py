"""LASP-2 through lasp_shmem.torch across the ranks of a torchrun job (skipped with a notice
elsewhere): each rank's shard of o and of the gradients, the last rank's final state and the
initial state's gradient against the single-GPU op on the whole sequences, and torch.compile
without a graph break, forward and backward as in eager mode; GLA's forward likewise, and its
forward and backward against the float64 reference on the whole sequences; both families the same
bits in every exchange mode, the planned one included; the mLSTM's forward and backward against
the float64 reference, bitwise the same in every exchange mode.

    NVSHMEM_DISABLE_NVLS=1 NVSHMEM_REMOTE_TRANSPORT=none \\
        torchrun --nproc-per-node 4 -m pytest python/tests/test_lasp2.py
"""

import os

import pytest
import torch
import torch.distributed as dist
from reference import (bits, delta_inputs, gate_grad_scale, gla_inputs, inputs,
                       mlstm_gate_grad_scale,
                       mlstm_gradients, mlstm_inputs, mlstm_recurrent, recurrent, rel_err)

import lasp_shmem.torch as lt

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or WORLD < 2,
    reason="NOTICE: LASP-2 tests skipped: run them under torchrun with 2 or more GPUs "
           "(torchrun --nproc-per-node N -m pytest python/tests/test_lasp2.py)")
TOL = 5e-3


@pytest.fixture(scope="module")
def group():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    lt.init()
    yield dist.group.WORLD
    lt.shutdown()
    dist.destroy_process_group()


class Sequences:
    """B sequences of H heads, the same on every rank (one seed), cut into contiguous shards of
    `per_rank` tokens, the last one `short` tokens shorter."""

    def __init__(self, seed, per_rank, short, b=2, h=3, dk=64, dv=128):
        rank = dist.get_rank()
        lengths = [per_rank] * (WORLD - 1) + [per_rank - short]
        self.start, self.length, total = sum(lengths[:rank]), lengths[rank], sum(lengths)
        self.last = rank == WORLD - 1
        self.q, self.k, self.v, self.g, self.h0 = inputs(b, total, h, dk, dv, "cuda", seed)
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)
        self.grad_o = (2 * torch.rand(b, total, h, dv, generator=gen, device="cuda") - 1)
        self.grad_o = self.grad_o.bfloat16()
        self.grad_ht = torch.rand(b, h, dk, dv, generator=gen, device="cuda") - 0.5

    def mine(self, x):
        """This rank's shard of a [B, T, ...] tensor of the whole sequences."""
        return x[:, self.tokens()].contiguous()

    def tokens(self):
        """This rank's positions in the whole sequences."""
        return slice(self.start, self.start + self.length)


def step(seqs, q, k, v, g, grad_o, cp_group, attention=lt.chunk_simple_gla):
    """o, the final state (or None) and dq, dk, dv, dg, dh0 of <o, grad_o> + <ht, grad_ht>."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, seqs.h0)]
    o, ht = attention(*leaves[:4], initial_state=leaves[4], output_final_state=True,
                      cp_group=cp_group)
    outputs, grads = ([o], [grad_o]) if ht is None else ([o, ht], [grad_o, seqs.grad_ht])
    return (o, ht, *torch.autograd.grad(outputs, leaves, grads))


def test_lasp2_matches_one_gpu_on_the_whole_sequences(group):
    seqs = Sequences(seed=21, per_rank=300, short=37)
    whole = (seqs.q, seqs.k, seqs.v, seqs.g, seqs.grad_o)
    o1, ht1, *grads1 = step(seqs, *whole, cp_group=None)
    o, ht, dq, dk, dv, dg, dh0 = step(seqs, *(seqs.mine(x) for x in whole), cp_group=group)
    lt.synchronize()
    # Every collective before the first assertion, so that a failing rank stops no other.
    summed_dh0 = dh0.clone()
    dist.all_reduce(summed_dh0)
    assert (ht is not None) == seqs.last
    if dist.get_rank() != 0:
        assert torch.count_nonzero(dh0) == 0, "the initial state's gradient off rank 0"
    errors = {"o": rel_err(o, seqs.mine(o1)), "dh0 (summed)": rel_err(summed_dh0, grads1[4])}
    for name, x, y in zip(("dq", "dk", "dv", "dg"), (dq, dk, dv, dg), grads1):
        errors[name] = rel_err(x, seqs.mine(y))
    if seqs.last:
        errors["ht"] = rel_err(ht, ht1)
    assert max(errors.values()) <= TOL, f"rank {dist.get_rank()}: {errors}"


@pytest.mark.parametrize("delta_rule", [False, True])
def test_packed_documents_across_ranks_match_one_gpu(group, delta_rule):
    """cu_seqlens with LASP-2 over unequal slices (shard_start given): documents that start,
    end or span any rank's slice, one ending on a slice boundary; every rank's o, dq, dk, dv,
    dg (and dbeta) against the same packed call on one GPU over the whole sequences."""
    per_rank, short = 300, 37
    lengths = [per_rank] * (WORLD - 1) + [per_rank - short]
    total = sum(lengths)
    rank = dist.get_rank()
    start, length = sum(lengths[:rank]), lengths[rank]
    doc_starts = sorted({0, 1, 64, 130, per_rank, per_rank + 5, total - 90} - {total})
    doc_starts = [s for s in doc_starts if s < total]
    cu = torch.tensor(doc_starts + [total, total], dtype=torch.int32, device="cuda")
    b, h, d = 2, 2, 128
    q, k, v, g, beta, _ = delta_inputs(b, total, h, d, d, "cuda", seed=41)
    gen = torch.Generator(device="cuda").manual_seed(42)
    grad_o = (2 * torch.rand(b, total, h, d, generator=gen, device="cuda") - 1).bfloat16()
    attention = lt.chunk_gated_delta_rule if delta_rule else lt.chunk_simple_gla
    whole = (q, k, v, g, beta) if delta_rule else (q, k, v, g)

    def run(tensors, do, **kwargs):
        leaves = [x.clone().requires_grad_() for x in tensors]
        o, _ = attention(*leaves, cu_seqlens=cu, **kwargs)
        return (o, *torch.autograd.grad(o, leaves, do))

    one_gpu = run(whole, grad_o)
    mine = slice(start, start + length)
    shard = run([x[:, mine].contiguous() for x in whole], grad_o[:, mine].contiguous(),
                cp_group=group, shard_start=start)
    lt.synchronize()
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    errors = {n: rel_err(x, y[:, mine]) for n, x, y in zip(names, shard, one_gpu)}
    tol = {"dg": 1e-2, "dbeta": 1e-2}
    bad = {n: e for n, e in errors.items() if e > tol.get(n, TOL)}
    assert not bad, f"rank {rank}: {errors}"


def test_a_compiled_lasp2_block_has_no_graph_break_and_the_eager_results(group):
    seqs = Sequences(seed=31, per_rank=200, short=11)
    q, k, v, g = (seqs.mine(x) for x in (seqs.q, seqs.k, seqs.v, seqs.g))
    # A weight that bf16 holds exactly: the gradient reaching the ops is the same bits in both.
    w_o = seqs.mine(seqs.grad_o).float()

    def block(q, k, v, g):
        o, _ = lt.chunk_simple_gla(q, k, v, g, cp_group=group)
        return (o.float() * w_o).sum()

    explained = torch._dynamo.explain(block)(q, k, v, g)

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
        fn(*leaves).backward()
        return [x.grad for x in leaves]

    eager = run(block)
    compiled = run(torch.compile(block, fullgraph=True))
    lt.synchronize()
    assert explained.graph_break_count == 0, explained.break_reasons
    for x, y in zip(compiled, eager):
        assert torch.equal(bits(x), bits(y))


def test_gla_lasp2_matches_one_gpu_on_the_whole_sequences(group):
    """GLA's forward (per-key gates) through the C ABI's LASP-2 op: each rank's shard of o and the
    last rank's final state against the one-GPU op on the whole sequences, bitwise repeats."""
    seqs = Sequences(seed=41, per_rank=300, short=37)
    dk = seqs.q.shape[-1]
    g = (seqs.g[..., None] * torch.linspace(0.0, 2.0, dk, device="cuda")).contiguous()
    with torch.no_grad():
        o1, ht1 = lt.chunk_gla(seqs.q, seqs.k, seqs.v, g, initial_state=seqs.h0,
                               output_final_state=True)
        mine = [seqs.mine(x) for x in (seqs.q, seqs.k, seqs.v, g)]
        o, ht = lt.chunk_gla(*mine, initial_state=seqs.h0, output_final_state=True, cp_group=group)
        again, _ = lt.chunk_gla(*mine, initial_state=seqs.h0, cp_group=group)
    lt.synchronize()
    assert (ht is not None) == seqs.last
    errors = {"o": rel_err(o, seqs.mine(o1))}
    if seqs.last:
        errors["ht"] = rel_err(ht, ht1)
    assert max(errors.values()) <= TOL, f"rank {dist.get_rank()}: {errors}"
    assert torch.equal(bits(o), bits(again))


def test_gla_lasp2_gradients_match_the_float64_reference(group):
    """chunk_gla with cp_group, forward and backward, against float64 autograd through the
    recurrence on the whole sequences (every rank computes it from the same seed): each rank's
    shard of o, dq, dk and dv, the last rank's final state and the initial state's gradient
    (rank 0's; zeros elsewhere) within 5e-3 relative error; dg to within 5e-3 of its scale, as
    the single-GPU GLA test measures it. A second training step gives the same bits."""
    seqs = Sequences(seed=51, per_rank=300, short=37)
    b, t, h, dk = seqs.q.shape
    # GLA's gates as fla's layer makes them (logsigmoid / 16), one per key dimension.
    g = gla_inputs(b, t, h, dk, seqs.v.shape[-1], "cuda", seed=52)[3]
    mine = [seqs.mine(x) for x in (seqs.q, seqs.k, seqs.v, g, seqs.grad_o)]
    first = step(seqs, *mine, cp_group=group, attention=lt.chunk_gla)
    second = step(seqs, *mine, cp_group=group, attention=lt.chunk_gla)
    lt.synchronize()
    o, ht, dq, dk_, dv, dg, dh0 = first
    # Every collective before the first assertion, so that a failing rank stops no other.
    summed_dh0 = dh0.clone()
    dist.all_reduce(summed_dh0)
    wide = [x.double().requires_grad_() for x in (seqs.q, seqs.k, seqs.v, g, seqs.h0)]
    o64, ht64 = recurrent(*wide)
    want = torch.autograd.grad((o64, ht64), wide, (seqs.grad_o.double(), seqs.grad_ht.double()))
    want = dict(zip(("dq", "dk", "dv", "dg", "dh0"), want))
    assert (ht is not None) == seqs.last
    assert dg.dtype == torch.float32
    if dist.get_rank() != 0:
        assert torch.count_nonzero(dh0) == 0, "the initial state's gradient off rank 0"
    errors = {"o": rel_err(o, seqs.mine(o64)), "dh0 (summed)": rel_err(summed_dh0, want["dh0"])}
    for name, x in (("dq", dq), ("dk", dk_), ("dv", dv)):
        errors[name] = rel_err(x, seqs.mine(want[name]))
    want_dg = seqs.mine(want["dg"])
    dg_scale = max(want_dg.norm().item(),
                   gate_grad_scale(seqs.q, seqs.k, want["dq"], want["dk"], seqs.tokens()))
    errors["dg"] = (dg.double() - want_dg).norm().item() / dg_scale
    if seqs.last:
        errors["ht"] = rel_err(ht, ht64)
    assert max(errors.values()) <= TOL, f"rank {dist.get_rank()}: {errors}"
    for x, y in zip(first, second):
        if x is not None:
            assert torch.equal(bits(x), bits(y))


def test_every_exchange_mode_gives_the_same_bits(group):
    """chunk_simple_gla and chunk_gla with cp_group, forward and backward, in every exchange mode
    a trainer may choose, the planner's included: the same bits of o, the final state and every
    gradient. The first mode is set before this test's layouts (Dv = 64) are made, so their ops
    start in it, and the earlier tests' ops are switched along; two steps per mode use both halves
    of the sequential modes' buffers."""
    seqs = Sequences(seed=61, per_rank=200, short=29, dv=64)
    b, t, h, dk = seqs.q.shape
    gla_g = gla_inputs(b, t, h, dk, seqs.v.shape[-1], "cuda", seed=62)[3]
    q, k, v, g, grad_o, gla_g = (seqs.mine(x) for x in (seqs.q, seqs.k, seqs.v, seqs.g,
                                                         seqs.grad_o, gla_g))
    results = {}
    try:
        for mode in ("sequential_nccl", "overlapped", "sequential_nvshmem", "planned"):
            lt.set_exchange_mode(mode)
            assert lt.exchange_mode() == mode
            results[mode] = [step(seqs, q, k, v, g, grad_o, cp_group=group) for _ in range(2)]
            results[mode] += [step(seqs, q, k, v, gla_g, grad_o, cp_group=group,
                                   attention=lt.chunk_gla) for _ in range(2)]
            lt.synchronize()
        # The planner ran once per op and direction of this test's layouts, with the same choice
        # on every rank.
        planned = lt.planned_modes()
        assert len(planned) == 4 and set(planned.values()) <= set(lt.EXCHANGE_MODES), planned
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, sorted(planned.items()))
        assert all(p == every_rank[0] for p in every_rank), every_rank
    finally:
        # The module's other tests run in the default mode.
        lt.set_exchange_mode("overlapped")
    names = ("o", "ht", "dq", "dk", "dv", "dg", "dh0")
    differ = [f"{mode} {'gla' if n >= 2 else 'simple_gla'} step {n % 2} {name}"
              for mode, steps in results.items() for n, outputs in enumerate(steps)
              for name, x, y in zip(names, outputs, results["overlapped"][n])
              if x is not None and not torch.equal(bits(x), bits(y))]
    assert not differ, f"rank {dist.get_rank()}: bits differ from the overlapped mode's: {differ}"


def test_mlstm_lasp2_matches_the_float64_reference_in_every_mode(group):
    """lt.mlstm with cp_group, forward and backward, against the stabilised recurrence and
    mlstm_kernels' gradient in closed form on the whole sequences (every rank computes them from
    the same seed): each rank's shard of h, dq, dk and dv, the last rank's final C and the
    initial state's gradient (rank 0's; zeros elsewhere) within 5e-3 relative error, the gates'
    gradients to 5e-3 of their terms' scale; the same bits in every exchange mode and step."""
    seqs = Sequences(seed=81, per_rank=300, short=37)
    b, t, h, dk = seqs.q.shape
    dv = seqs.v.shape[-1]
    q, k, v, i, f, state = mlstm_inputs(b, t, h, dk, dv, "cuda", seed=82)
    mine = [seqs.mine(x) for x in (q, k, v, i, f, seqs.grad_o)]

    def training_step():
        leaves = [x.clone().requires_grad_() for x in mine[:5]]
        c0 = state[0].clone().requires_grad_()
        out, ht = lt.mlstm(*leaves, scale=0.1, initial_state=(c0, *state[1:]),
                           output_final_state=True, cp_group=group)
        outputs, grads = ([out], [mine[5]]) if ht is None else ([out, ht[0]],
                                                                 [mine[5], seqs.grad_ht])
        return (out, None if ht is None else ht[0],
                *torch.autograd.grad(outputs, leaves + [c0], grads))

    results = {}
    try:
        for mode in ("overlapped", "sequential_nccl", "sequential_nvshmem"):
            lt.set_exchange_mode(mode)
            results[mode] = [training_step() for _ in range(2)]
            lt.synchronize()
    finally:
        lt.set_exchange_mode("overlapped")
    out, c_t, dq, dk_, dv_, di, df, dc0 = results["overlapped"][0]
    summed_dc0 = dc0.clone()
    dist.all_reduce(summed_dc0)
    want_h, (want_c, _, _) = mlstm_recurrent(q, k, v, i, f, state, 0.1)
    want = mlstm_gradients(q, k, v, i, f, state, seqs.grad_o, seqs.grad_ht, 0.1)
    assert (c_t is not None) == seqs.last
    if dist.get_rank() != 0:
        assert torch.count_nonzero(dc0) == 0, "the initial state's gradient off rank 0"
    errors = {"h": rel_err(out, seqs.mine(want_h)), "dC0 (summed)": rel_err(summed_dc0, want[5])}
    for name, x, y in (("dq", dq, want[0]), ("dk", dk_, want[1]), ("dv", dv_, want[2])):
        errors[name] = rel_err(x, seqs.mine(y))
    scale = mlstm_gate_grad_scale(q, k, want[0], want[1], seqs.tokens())
    for name, x, y in (("di", di, want[3]), ("df", df, want[4])):
        errors[name] = (x.double() - seqs.mine(y)).norm().item() / scale
    if seqs.last:
        errors["C_T"] = rel_err(c_t, want_c)
    assert max(errors.values()) <= TOL, f"rank {dist.get_rank()}: {errors}"
    names = ("h", "C_T", "dq", "dk", "dv", "di", "df", "dC0")
    differ = [f"{mode} step {n} {name}" for mode, steps in results.items()
              for n, outputs in enumerate(steps)
              for name, x, y in zip(names, outputs, results["overlapped"][0])
              if x is not None and not torch.equal(bits(x), bits(y))]
    assert not differ, f"rank {dist.get_rank()}: bits differ from the overlapped mode's: {differ}"

