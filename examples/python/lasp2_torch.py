"""LASP-2 forward and backward from PyTorch through lasp-shmem's C ABI (ctypes), launched by
torchrun.

    bash scripts/build-c-examples.sh      # builds target/release/liblasp_shmem.so
    torchrun --nproc-per-node 4 examples/python/lasp2_torch.py [--lib PATH] [--time]

Every rank holds a slice of each sequence as torch tensors on its GPU. Rank 0 makes NVSHMEM's
unique id and torch.distributed broadcasts it, so the library never needs MASTER_PORT (torchrun's
store holds it); every rank then initialises lasp-shmem with the id. The forward runs on torch's
current stream with the tensors' own device pointers. Checks, each of which fails the job:
- the output and the final state against a float64 reference of the whole sequence computed in
  torch (the quadratic form with the decay mask), rel. error <= 5e-3;
- the sequential NCCL mode gives bitwise the overlapped outputs;
- a torch.cuda.graph capture of one call, replayed, gives them too;
- a CPU tensor is rejected with the library's message, before anything is enqueued;
- training: `Lasp2Attention`, a torch.autograd.Function over lasp_lasp2_forward_saving and
  lasp_lasp2_backward, gives every rank's dq, dk, dv, dg (rel. error <= 5e-3) and rank 0's dh0
  against torch.autograd through the float64 reference of the whole sequence; the sequential
  NCCL mode gives bitwise the same gradients;
  a gradient of the final state on a rank other than the last is rejected;
- one `Lasp2Layer` serving two stacked calls (the first's output as the second's queries),
  differentiated in reverse order: the same checks against the stacked reference;
- a forward and a backward captured in one torch.cuda.graph and replayed give bitwise the
  uncaptured step's outputs and gradients;
- the single-GPU pair (lasp_scalar_decay_forward / _backward) as `ScalarDecayAttention`, the same
  gradient checks on each rank's own sequences.
With --time it then times the overlapped call against the sequential NCCL mode and the compute
alone (no exchange) at B=4, T_local=8192, H=16, D=128 (CUDA events, medians), forward and
backward.
"""

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ABI_VERSION = 1
OK, MODE_OVERLAPPED, MODE_SEQUENTIAL_NCCL, MODE_NO_COMM = 0, 0, 1, 3
ERROR_INVALID_ARGUMENT = 1
TOL = 5e-3


class RuntimeOptions(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("symmetric_heap_bytes", ctypes.c_uint64), ("wait_timeout_ms", ctypes.c_uint64),
                ("nvshmem_library", ctypes.c_char_p)]


class Place(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32)
                for name in ("rank", "world_size", "local_rank", "local_world_size")]


class UniqueId(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint8 * 128)]


class ForwardArgs(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("batch", "tokens", "heads", "dk", "dv")]
                + [(n, ctypes.c_void_p) for n in ("q", "k", "v", "g", "h0", "o", "ht")]
                + [("scale", ctypes.c_float), ("reserved", ctypes.c_uint32)])


class BackwardArgs(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("batch", "tokens", "heads", "dk", "dv")]
                + [(n, ctypes.c_void_p) for n in ("q", "k", "v", "g", "h0", "grad_o", "grad_ht",
                                                  "grad_q", "grad_k", "grad_v", "grad_g",
                                                  "grad_h0")]
                + [("scale", ctypes.c_float), ("reserved", ctypes.c_uint32)])


for struct, size in ((RuntimeOptions, 32), (Place, 16), (UniqueId, 128), (ForwardArgs, 104),
                     (BackwardArgs, 144)):
    assert ctypes.sizeof(struct) == size, f"{struct.__name__} does not match lasp_shmem.h"


P, HANDLE, OUT = ctypes.POINTER, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
I64, I32 = ctypes.c_int64, ctypes.c_int32
# Every entry point this script calls, with the argument types of lasp_shmem.h (ctypes would
# otherwise pass Python ints as 32-bit C ints).
SIGNATURES = {
    "unique_id_create": [P(RuntimeOptions), P(Place), P(UniqueId)],
    "runtime_init": [P(RuntimeOptions), P(Place), P(UniqueId), OUT],
    "runtime_shutdown": [HANDLE],
    "lasp2_create": [HANDLE, I64, I64, I64, I64, I32, OUT],
    "lasp2_set_mode": [HANDLE, I32],
    "lasp2_forward": [HANDLE, HANDLE, P(ForwardArgs)],
    "lasp2_forward_saving": [HANDLE, HANDLE, P(ForwardArgs), HANDLE],
    "lasp2_finish": [HANDLE, HANDLE],
    "lasp2_note_replayed_calls": [HANDLE, ctypes.c_uint64],
    "lasp2_free": [HANDLE],
    "lasp2_grad_create": [HANDLE, I64, I64, I64, I64, I32, OUT],
    "lasp2_grad_set_mode": [HANDLE, I32],
    "lasp2_backward": [HANDLE, HANDLE, P(BackwardArgs)],
    "lasp2_grad_finish": [HANDLE, HANDLE],
    "lasp2_grad_note_replayed_calls": [HANDLE, ctypes.c_uint64],
    "lasp2_grad_free": [HANDLE],
    "scalar_decay_create": [HANDLE, OUT],
    "scalar_decay_forward": [HANDLE, HANDLE, P(ForwardArgs)],
    "scalar_decay_free": [HANDLE],
    "scalar_decay_grad_create": [HANDLE, OUT],
    "scalar_decay_backward": [HANDLE, HANDLE, P(BackwardArgs)],
    "scalar_decay_grad_free": [HANDLE],
}


class Lasp:
    """The C ABI, with every status turned into an exception carrying the library's message."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.lasp_last_error.restype = ctypes.c_char_p
        self.lib.lasp_abi_version.restype = ctypes.c_uint32
        for name, argtypes in SIGNATURES.items():
            fn = getattr(self.lib, "lasp_" + name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int32
        if self.lib.lasp_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} implements ABI {self.lib.lasp_abi_version()}, "
                               f"this script ABI {ABI_VERSION}")

    def __getattr__(self, name):
        fn = getattr(self.lib, "lasp_" + name)

        def call(*args):
            status = fn(*args)
            if status != OK:
                raise LaspError(status, self.lib.lasp_last_error().decode())
        return call


class LaspError(RuntimeError):
    def __init__(self, status, message):
        super().__init__(f"status {status}: {message}")
        self.status = status


def say(line):
    """One write per line, so the ranks' lines do not interleave on a shared pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def ptr(x):
    return None if x is None else x.data_ptr()


def forward_args(q, k, v, g, h0, o, ht):
    b, t, h, dk = q.shape
    return ForwardArgs(b, t, h, dk, v.shape[-1], ptr(q), ptr(k), ptr(v), ptr(g), ptr(h0), ptr(o),
                       ptr(ht), 0.0, 0)


def backward_args(q, k, v, g, h0, grad_o, grad_ht, grad_q, grad_k, grad_v, grad_g, grad_h0):
    b, t, h, dk = q.shape
    return BackwardArgs(b, t, h, dk, v.shape[-1], *(ptr(x) for x in (
        q, k, v, g, h0, grad_o, grad_ht, grad_q, grad_k, grad_v, grad_g, grad_h0)), 0.0, 0)


def current_stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


class Lasp2Layer:
    """One LASP-2 attention layout on every rank: a forward and a backward operation (each
    created collectively), called through `Lasp2Attention`."""

    def __init__(self, lasp, runtime, b, h, dk, dv, rank, world, mode=MODE_OVERLAPPED):
        self.lasp, self.rank, self.world = lasp, rank, world
        self.forward_op, self.grad_op = ctypes.c_void_p(), ctypes.c_void_p()
        lasp.lasp2_create(runtime, b, h, dk, dv, mode, ctypes.byref(self.forward_op))
        lasp.lasp2_grad_create(runtime, b, h, dk, dv, mode, ctypes.byref(self.grad_op))

    def set_mode(self, mode):
        self.lasp.lasp2_set_mode(self.forward_op, mode)
        self.lasp.lasp2_grad_set_mode(self.grad_op, mode)

    def finish(self):
        self.lasp.lasp2_finish(self.forward_op, current_stream())
        self.lasp.lasp2_grad_finish(self.grad_op, current_stream())

    def free(self):
        self.lasp.lasp2_free(self.forward_op)
        self.lasp.lasp2_grad_free(self.grad_op)

    def __call__(self, q, k, v, g, h0=None):
        """This rank's shard of o, and the sequence's final state on the last rank (None on the
        others). h0, the sequence's initial state, is the same on every rank; its gradient lands
        on rank 0, the others return zeros (a sum over the ranks gives the gradient)."""
        return Lasp2Attention.apply(self, q, k, v, g, h0)


class Lasp2Attention(torch.autograd.Function):
    """LASP-2 linear attention with scalar decay over the shards of the ranks: the forward keeps
    the state its shard starts from, which the backward starts from; the gradients of the state
    travel from the last rank down inside lasp_lasp2_backward. Every rank calls the forward, and
    later the backward, of the same layers in the same order."""

    @staticmethod
    def forward(ctx, layer, q, k, v, g, h0):
        require_contiguous(q, k, v, g, h0)
        b, t, h, dk = q.shape
        dv = v.shape[-1]
        o = torch.empty(b, t, h, dv, dtype=torch.bfloat16, device=q.device)
        last = layer.rank == layer.world - 1
        ht = torch.empty(b, h, dk, dv, device=q.device) if last else None
        start = torch.empty(b, h, dk, dv, device=q.device)
        args = forward_args(q, k, v, g, h0, o, ht)
        layer.lasp.lasp2_forward_saving(layer.forward_op, current_stream(), ctypes.byref(args),
                                        start.data_ptr())
        ctx.layer, ctx.has_h0 = layer, h0 is not None
        ctx.save_for_backward(q, k, v, g, start)
        if ht is None:
            return o
        return o, ht

    @staticmethod
    def backward(ctx, grad_o, grad_ht=None):
        layer = ctx.layer
        q, k, v, g, start = ctx.saved_tensors
        grads = [torch.empty_like(x) for x in (q, k, v, g)]
        grad_h0 = torch.zeros_like(start) if ctx.has_h0 else None
        args = backward_args(q, k, v, g, start, grad_o.contiguous(), contiguous(grad_ht), *grads,
                             grad_h0 if layer.rank == 0 else None)
        layer.lasp.lasp2_backward(layer.grad_op, current_stream(), ctypes.byref(args))
        return (None, *grads, grad_h0)


class ScalarDecayAttention(torch.autograd.Function):
    """The same attention over whole sequences on one GPU (lasp_scalar_decay_forward and
    _backward): (o, ht)."""

    @staticmethod
    def forward(ctx, ops, q, k, v, g, h0):
        require_contiguous(q, k, v, g, h0)
        lasp, forward_op, _ = ops
        b, t, h, dk = q.shape
        dv = v.shape[-1]
        o = torch.empty(b, t, h, dv, dtype=torch.bfloat16, device=q.device)
        ht = torch.empty(b, h, dk, dv, device=q.device)
        args = forward_args(q, k, v, g, h0, o, ht)
        lasp.scalar_decay_forward(forward_op, current_stream(), ctypes.byref(args))
        ctx.ops = ops
        ctx.save_for_backward(q, k, v, g, h0)
        return o, ht

    @staticmethod
    def backward(ctx, grad_o, grad_ht):
        lasp, _, grad_op = ctx.ops
        q, k, v, g, h0 = ctx.saved_tensors
        grads = [torch.empty_like(x) for x in (q, k, v, g)]
        grad_h0 = None if h0 is None else torch.empty_like(h0)
        args = backward_args(q, k, v, g, h0, grad_o.contiguous(), contiguous(grad_ht), *grads,
                             grad_h0)
        lasp.scalar_decay_backward(grad_op, current_stream(), ctypes.byref(args))
        return (None, *grads, grad_h0)


def contiguous(x):
    return None if x is None else x.contiguous()


def require_contiguous(*tensors):
    """The library takes bare pointers in fla's contiguous layout."""
    if any(x is not None and not x.is_contiguous() for x in tensors):
        raise ValueError("lasp-shmem takes contiguous q, k, v, g and h0; call .contiguous()")


def reference(q, k, v, g, h0):
    """o and the final state of whole sequences in float64 (differentiable: torch.autograd
    through it gives the reference gradients): o = s ((Q K^T) * D) V + s e^{G} Q h0 with
    D_ij = e^{G_i - G_j} for j <= i, G the cumulative log-decay. Inputs that are float64
    already are used as they are, so gradients reach them."""
    q, k, v, g, h0 = (x.double() for x in (q, k, v, g, h0))
    b, t, h, dk = q.shape
    scale = dk ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    o_heads, ht_heads = [], []
    for bi in range(b):
        for hi in range(h):
            G = g[bi, :, hi].cumsum(0)
            # Masked before the exponential, so no clamp cuts the gradient where gates are 0.
            D = torch.where(causal, G[:, None] - G[None, :], float("-inf")).exp()
            Q, K, V = q[bi, :, hi], k[bi, :, hi], v[bi, :, hi]
            o_heads.append(scale * (((Q @ K.T) * D) @ V + G.exp()[:, None] * (Q @ h0[bi, hi])))
            w = (G[-1] - G).exp()
            ht_heads.append(G[-1].exp() * h0[bi, hi] + (K * w[:, None]).T @ V)
    o = torch.stack(o_heads, 1).unflatten(1, (b, h)).permute(1, 0, 2, 3)  # [B, T, H, Dv]
    ht = torch.stack(ht_heads).unflatten(0, (b, h))
    return o, ht


def reference_grads(q, k, v, g, h0, grad_o, grad_ht):
    """torch.autograd's gradients of <o, grad_o> + <ht, grad_ht> through `reference`."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, g, h0)]
    o, ht = reference(*leaves)
    torch.autograd.backward((o, ht), (grad_o.double(), grad_ht.double()))
    return tuple(x.grad for x in leaves)


class Bf16Boundary(torch.autograd.Function):
    """What happens between two of our calls: the output is bf16, and so is its gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.bfloat16().double()

    @staticmethod
    def backward(ctx, grad):
        return grad.bfloat16().double()


def stacked_reference_grads(q, k, v, g, h0, grad_o):
    """Two calls of one layer, the first's output as the second's queries (through
    `Bf16Boundary`), h0 only into the first: torch.autograd's gradients of <o2, grad_o>."""
    q1, h0_ = (x.detach().double().requires_grad_() for x in (q, h0))
    k1, v1, g1, k2, v2, g2 = (x.detach().double().requires_grad_() for x in (k, v, g, k, v, g))
    o1, _ = reference(q1, k1, v1, g1, h0_)
    q2 = Bf16Boundary.apply(o1)
    o2, _ = reference(q2, k2, v2, g2, torch.zeros_like(h0_))
    dq1, dk1, dv1, dg1, dh0, dq2, dk2, dv2, dg2 = torch.autograd.grad(
        o2, (q1, k1, v1, g1, h0_, q2, k2, v2, g2), grad_o.double())
    return dq1, dk1 + dk2, dv1 + dv2, dg1 + dg2, dh0


def bits(x):
    """x's bit patterns, so that a comparison tells -0.0 from 0.0 and sees NaNs."""
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def shard(x, start, length):
    return x[:, start:start + length].contiguous()


def gradient_checks(rank, got, want, names, start, length):
    """Checks this rank's gradients against the reference's (shards of the whole sequence) by
    relative error, printing the errors."""
    line = []
    for name, x, y in zip(names, got, want):
        if name == "dh0":
            err = rel_err(x, y)
        else:
            err = rel_err(x, shard(y, start, length))
        line.append(f"{name} {err:.2e}")
        assert err <= TOL, f"rank {rank}: {name} does not match: {err:.2e} > {TOL:g}"
    return ", ".join(line)


class Sequences:
    """B sequences of H heads (Dk = Dv = d), the same on every rank (one seed), cut into shards
    of `per_rank` tokens, the last one `short` tokens shorter; this rank's shard starts at
    `start`. `rand` draws more of the same stream (e.g. output gradients)."""

    def __init__(self, rank, world, dev, seed, per_rank, short, b=2, h=4, d=128):
        self.b, self.h, self.d = b, h, d
        self.lengths = [per_rank] * (world - 1) + [per_rank - short if world > 1 else per_rank]
        self.length = self.lengths[rank]
        self.start, self.total = sum(self.lengths[:rank]), sum(self.lengths)
        self.last = rank == world - 1
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.rand = lambda *s: torch.rand(*s, generator=gen, device=dev)  # noqa: E731
        rand, total = self.rand, self.total
        self.q, self.k, self.v = ((2 * rand(b, total, h, d) - 1).bfloat16() for _ in range(3))
        self.g = torch.where(rand(b, total, h) < 0.05, 0.0, -0.5 * rand(b, total, h))
        self.h0 = rand(b, h, d, d) - 0.5

    def mine(self, x):
        """This rank's shard of a [B, T, ...] tensor of the whole sequences."""
        return shard(x, self.start, self.length)


def check(lasp, runtime, rank, world, dev):
    seqs = Sequences(rank, world, dev, seed=11, per_rank=1000, short=37)
    b, h, d, q, k, v, g, h0 = seqs.b, seqs.h, seqs.d, seqs.q, seqs.k, seqs.v, seqs.g, seqs.h0
    total, last = seqs.total, seqs.last
    want_o, want_ht = reference(q, k, v, g, h0)

    mine = [seqs.mine(x) for x in (q, k, v, g)]
    o = torch.empty(b, seqs.length, h, d, dtype=torch.bfloat16, device=dev)
    ht = torch.empty(b, h, d, d, device=dev) if last else None
    args = forward_args(*mine, h0, o, ht)
    op = ctypes.c_void_p()
    lasp.lasp2_create(runtime, b, h, d, d, MODE_OVERLAPPED, ctypes.byref(op))

    def run():
        o.fill_(float("nan"))
        if ht is not None:
            ht.fill_(float("nan"))
        lasp.lasp2_forward(op, current_stream(), ctypes.byref(args))
        lasp.lasp2_finish(op, current_stream())
        return o.clone(), None if ht is None else ht.clone()

    o1, ht1 = run()
    err = rel_err(o1, seqs.mine(want_o))
    line = f"rank {rank}: shard of {seqs.length} of {total} tokens: o rel err {err:.2e}"
    if last:
        line += f", final state rel err {rel_err(ht1, want_ht):.2e}"
    say(line + f" (tolerance {TOL:g})")
    assert err <= TOL and (not last or rel_err(ht1, want_ht) <= TOL), "does not match"

    lasp.lasp2_set_mode(op, MODE_SEQUENTIAL_NCCL)
    o2, ht2 = run()
    assert torch.equal(bits(o1), bits(o2)), "sequential NCCL differs"
    assert not last or torch.equal(bits(ht1), bits(ht2))
    lasp.lasp2_set_mode(op, MODE_OVERLAPPED)
    say(f"rank {rank}: sequential NCCL gives bitwise the overlapped outputs")

    graph, replays = torch.cuda.CUDAGraph(), 50
    o.fill_(float("nan"))
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        lasp.lasp2_forward(op, current_stream(), ctypes.byref(args))
    for _ in range(replays):
        graph.replay()
    lasp.lasp2_note_replayed_calls(op, replays)
    lasp.lasp2_finish(op, current_stream())
    assert torch.equal(bits(o1), bits(o)), "graph replays differ"
    say(f"rank {rank}: {replays} replays of a torch.cuda.graph capture: bitwise identical")

    bad = forward_args(*mine, h0, o, ht)
    bad.q = q.cpu().data_ptr()
    try:
        lasp.lasp2_forward(op, current_stream(), ctypes.byref(bad))
        raise AssertionError("a CPU tensor for q was accepted")
    except LaspError as e:
        assert e.status == ERROR_INVALID_ARGUMENT and "q at 0x" in str(e), str(e)
        say(f"rank {rank}: a CPU tensor is rejected: {str(e)[:110]}...")
    lasp.lasp2_free(op)


def check_training(lasp, runtime, rank, world, dev):
    """The LASP-2 forward and backward through torch.autograd against the float64 reference."""
    seqs = Sequences(rank, world, dev, seed=23, per_rank=700, short=45)
    b, h, d, q, k, v, g, h0 = seqs.b, seqs.h, seqs.d, seqs.q, seqs.k, seqs.v, seqs.g, seqs.h0
    start, total, last, rand = seqs.start, seqs.total, seqs.last, seqs.rand
    grad_o = (2 * rand(b, total, h, d) - 1).bfloat16()
    grad_ht = rand(b, h, d, d) - 0.5
    want = reference_grads(q, k, v, g, h0, grad_o, grad_ht)

    layer = Lasp2Layer(lasp, runtime, b, h, d, d, rank, world)

    def step():
        inputs = [seqs.mine(x).requires_grad_() for x in (q, k, v, g)]
        h0_leaf = h0.clone().requires_grad_()
        out = layer(*inputs, h0_leaf)
        o, ht = out if last else (out, None)
        outputs, grads = [o], [seqs.mine(grad_o)]
        if last:
            outputs.append(ht)
            grads.append(grad_ht)
        torch.autograd.backward(outputs, grads)
        layer.finish()
        return [x.grad.clone() for x in inputs] + [h0_leaf.grad.clone()]

    got = step()
    names = ("dq", "dk", "dv", "dg", "dh0")
    if rank == 0:
        errors = gradient_checks(rank, got, want, names, start, seqs.length)
    else:
        errors = gradient_checks(rank, got[:4], want[:4], names[:4], start, seqs.length)
        assert torch.count_nonzero(got[4]) == 0, "dh0 on a rank other than 0 is not zero"
    say(f"rank {rank}: LASP-2 through torch.autograd, shard of {seqs.length} of {total} "
        f"tokens: {errors} (tolerance {TOL:g})")

    layer.set_mode(MODE_SEQUENTIAL_NCCL)
    again = step()
    layer.set_mode(MODE_OVERLAPPED)
    for name, x, y in zip(names, got, again):
        assert torch.equal(bits(x), bits(y)), f"rank {rank}: sequential NCCL gives another {name}"
    say(f"rank {rank}: sequential NCCL gives bitwise the overlapped gradients")

    # One layer object serves every layer of its layout: two stacked calls, the first's output
    # as the second's queries, differentiated in reverse order as a model's layers are.
    want2 = stacked_reference_grads(q, k, v, g, h0, grad_o)
    inputs = [seqs.mine(x).requires_grad_() for x in (q, k, v, g)]
    h0_leaf = h0.clone().requires_grad_()
    first = layer(*inputs, h0_leaf)
    second = layer(first[0] if last else first, *inputs[1:])
    torch.autograd.backward(second[0] if last else second, seqs.mine(grad_o))
    layer.finish()
    got2 = [x.grad for x in inputs] + [h0_leaf.grad]
    n = 5 if rank == 0 else 4
    errors = gradient_checks(rank, got2[:n], want2[:n], names[:n], start, seqs.length)
    say(f"rank {rank}: two stacked calls of one layer through torch.autograd: {errors}")

    check_captured_training_step(lasp, layer, rank, last, [
        seqs.mine(x) for x in (q, k, v, g, grad_o)], h0, grad_ht)

    if not last:
        mine = [seqs.mine(x) for x in (q, k, v, g)]
        start_state = torch.empty_like(h0)
        outs = [torch.empty_like(x) for x in mine]
        bad = backward_args(*mine, start_state, seqs.mine(grad_o), grad_ht,
                            *outs, None)
        try:
            lasp.lasp2_backward(layer.grad_op, current_stream(), ctypes.byref(bad))
            raise AssertionError("a final-state gradient on a rank other than the last was accepted")
        except LaspError as e:
            assert e.status == ERROR_INVALID_ARGUMENT and "only the last PE" in str(e), str(e)
            say(f"rank {rank}: grad_ht off the last rank is rejected: {str(e)[:100]}...")
    layer.free()


def check_captured_training_step(lasp, layer, rank, last, shard_tensors, h0, grad_ht, replays=50):
    """A forward (saving its start state) and a backward captured together in one
    torch.cuda.graph and replayed: every output and gradient bitwise as the uncaptured step's."""
    q, k, v, g, grad_o = shard_tensors
    o = torch.empty_like(v)
    start_state = torch.empty_like(h0)
    ht = torch.empty_like(h0) if last else None
    grads = [torch.empty_like(x) for x in (q, k, v, g)]
    dh0 = torch.empty_like(h0) if rank == 0 else None
    fwd = forward_args(q, k, v, g, h0, o, ht)
    bwd = backward_args(q, k, v, g, start_state, grad_o, grad_ht if last else None, *grads, dh0)
    written = [x for x in (o, start_state, ht, *grads, dh0) if x is not None]

    def training_step():
        lasp.lasp2_forward_saving(layer.forward_op, current_stream(), ctypes.byref(fwd),
                                  start_state.data_ptr())
        lasp.lasp2_backward(layer.grad_op, current_stream(), ctypes.byref(bwd))

    training_step()  # uncaptured first: it sizes the workspaces
    layer.finish()
    want = [x.clone() for x in written]
    for x in written:
        x.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        training_step()
    for _ in range(replays):
        graph.replay()
    lasp.lasp2_note_replayed_calls(layer.forward_op, replays)
    lasp.lasp2_grad_note_replayed_calls(layer.grad_op, replays)
    layer.finish()
    for x, y in zip(written, want):
        assert torch.equal(bits(x), bits(y)), f"rank {rank}: a replayed training step differs"
    say(f"rank {rank}: {replays} replays of a captured forward + backward: bitwise identical")


def check_single_gpu_training(lasp, runtime, rank, dev):
    """lasp_scalar_decay_forward / _backward through torch.autograd on this rank's own sequences
    (Dk 64, Dv 128, ragged T), against the float64 reference."""
    b, t, h, dk, dv = 2, 333, 3, 64, 128
    gen = torch.Generator(device=dev).manual_seed(300 + rank)
    rand = lambda *s: torch.rand(*s, generator=gen, device=dev)  # noqa: E731
    q, k = ((2 * rand(b, t, h, dk) - 1).bfloat16() for _ in range(2))
    v = (2 * rand(b, t, h, dv) - 1).bfloat16()
    g = -rand(b, t, h)
    h0 = rand(b, h, dk, dv) - 0.5
    grad_o = (2 * rand(b, t, h, dv) - 1).bfloat16()
    grad_ht = rand(b, h, dk, dv) - 0.5
    want = reference_grads(q, k, v, g, h0, grad_o, grad_ht)
    forward_op, grad_op = ctypes.c_void_p(), ctypes.c_void_p()
    lasp.scalar_decay_create(runtime, ctypes.byref(forward_op))
    lasp.scalar_decay_grad_create(runtime, ctypes.byref(grad_op))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, ht = ScalarDecayAttention.apply((lasp, forward_op, grad_op), *leaves)
    torch.autograd.backward((o, ht), (grad_o, grad_ht))
    torch.cuda.synchronize()
    errors = gradient_checks(rank, [x.grad for x in leaves], want,
                             ("dq", "dk", "dv", "dg", "dh0"), 0, t)
    say(f"rank {rank}: one GPU through torch.autograd (B={b} T={t} H={h} Dk={dk} Dv={dv}): "
        f"{errors} (tolerance {TOL:g})")
    lasp.scalar_decay_free(forward_op)
    lasp.scalar_decay_grad_free(grad_op)


def time_modes(lasp, runtime, rank, world, dev, iters=50, warmup=10):
    """Forward and backward of one layout in every mode, enqueued back to back as a training
    step would: CUDA-event medians, and the host's enqueue cost per call."""
    b, t, h, d = 4, 8192, 16, 128
    last = rank == world - 1
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    q, k, v, grad_o = ((torch.rand(b, t, h, d, generator=gen, device=dev) - 0.5).bfloat16()
                       for _ in range(4))
    g = -0.1 * torch.rand(b, t, h, generator=gen, device=dev)
    o = torch.empty(b, t, h, d, dtype=torch.bfloat16, device=dev)
    start_state = torch.empty(b, h, d, d, device=dev)
    grad_ht = torch.rand(b, h, d, d, generator=gen, device=dev) - 0.5 if last else None
    grads = [torch.empty_like(x) for x in (q, k, v, g)]
    fwd = forward_args(q, k, v, g, None, o, None)
    bwd = backward_args(q, k, v, g, start_state, grad_o, grad_ht, *grads, None)
    layer = Lasp2Layer(lasp, runtime, b, h, d, d, rank, world)
    stream = current_stream()
    calls = {
        "forward": lambda: lasp.lasp2_forward_saving(layer.forward_op, stream, ctypes.byref(fwd),
                                                     start_state.data_ptr()),
        "backward": lambda: lasp.lasp2_backward(layer.grad_op, stream, ctypes.byref(bwd)),
    }
    results = {}
    for name, mode in (("overlapped", MODE_OVERLAPPED), ("sequential_nccl", MODE_SEQUENTIAL_NCCL),
                       ("no_comm", MODE_NO_COMM)):
        layer.set_mode(mode)
        for direction, call in calls.items():
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(warmup + iters)]
            host = time.perf_counter()
            for begin, end in events:
                begin.record()
                call()
                end.record()
            host = time.perf_counter() - host
            layer.finish()
            key = f"{direction}_{name}"
            results[key] = statistics.median(s.elapsed_time(e) for s, e in events[warmup:])
            # The host's enqueue cost per call (ctypes, argument checks, launches, two events);
            # it stays hidden while the GPU queue is ahead of the host.
            results[key + "_host"] = 1e3 * host / len(events)
    layer.free()
    say(f"rank {rank}: B={b} T_local={t} H={h} D={d}, W={world}, median of {iters} (ms; "
        "_host: host ms per call while enqueuing): "
        + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))


def default_lib():
    """liblasp_shmem.so of a bundle or a release build of this checkout (None if neither), unless
    LASP_SHMEM_LIB names one."""
    repo = Path(__file__).resolve().parents[2]
    built = next((p for p in (repo / ".bundle/bin/liblasp_shmem.so",
                              repo / "target/release/liblasp_shmem.so") if p.exists()), None)
    return os.environ.get("LASP_SHMEM_LIB", built)


def init_runtime(lasp):
    """The library's runtime on every rank of the torch.distributed job (init_process_group done):
    rank 0 makes the unique id, the process group broadcasts it (128 bytes), every rank joins."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    options = RuntimeOptions(ABI_VERSION, 0, 256 << 20, 0, None)
    place = Place(rank, world, local_rank, local_world)
    uid = UniqueId()
    if rank == 0:
        lasp.unique_id_create(ctypes.byref(options), ctypes.byref(place), ctypes.byref(uid))
    id_bytes = torch.tensor(list(bytes(uid.bytes)), dtype=torch.uint8)
    dist.broadcast(id_bytes, src=0)
    uid.bytes[:] = id_bytes.tolist()
    runtime = ctypes.c_void_p()
    lasp.runtime_init(ctypes.byref(options), ctypes.byref(place), ctypes.byref(uid),
                      ctypes.byref(runtime))
    return runtime


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", default=default_lib())
    parser.add_argument("--time", action="store_true")
    opts = parser.parse_args()
    if opts.lib is None:
        sys.exit("liblasp_shmem.so not found: run bash scripts/build-c-examples.sh or pass --lib")

    dist.init_process_group("gloo")  # CPU only: it carries just the 128-byte id
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    lasp = Lasp(opts.lib)
    runtime = init_runtime(lasp)

    check(lasp, runtime, rank, world, dev)
    check_training(lasp, runtime, rank, world, dev)
    check_single_gpu_training(lasp, runtime, rank, dev)
    if opts.time:
        time_modes(lasp, runtime, rank, world, dev)
    lasp.runtime_shutdown(runtime)
    dist.destroy_process_group()
    say(f"rank {rank}: lasp2_torch: every check passed")


if __name__ == "__main__":
    main()
