"""LASP-2 forward and backward from PyTorch through lasp-shmem's C ABI (ctypes), launched by
torchrun.

    bash scripts/build-c-examples.sh      # builds target/release/liblasp_shmem.so
    torchrun --nproc-per-node 4 examples/python/lasp2_torch.py [--lib PATH] [--time]

Every rank holds a slice of each sequence as torch tensors on its GPU. Rank 0 makes NVSHMEM's
unique id and torch.distributed broadcasts it, so the library never needs MASTER_PORT (torchrun's
store holds it); every rank then initialises lasp-shmem with the id. Each operation is one
`lasp_op` (`Op`) made from a descriptor (family, kind, layout); its calls run on torch's current
stream with the tensors' own device pointers in named slots. Checks, each of which fails the job:
- the output and the final state against a float64 reference of the whole sequence computed in
  torch (the quadratic form with the decay mask), rel. error <= 5e-3;
- the sequential NCCL mode gives bitwise the overlapped outputs;
- a torch.cuda.graph capture of one call, replayed, gives them too;
- a CPU tensor is rejected with the library's message, before anything is enqueued;
- training: `Lasp2Attention`, a torch.autograd.Function over lasp_op_forward (saving the shard's
  start state) and lasp_op_backward, gives every rank's dq, dk, dv, dg (rel. error <= 5e-3) and rank
  0's dh0
  against torch.autograd through the float64 reference of the whole sequence; the sequential
  NCCL mode gives bitwise the same gradients;
  a gradient of the final state on a rank other than the last is rejected;
- one `Lasp2Layer` serving two stacked calls (the first's output as the second's queries),
  differentiated in reverse order: the same checks against the stacked reference;
- a forward and a backward captured in one torch.cuda.graph and replayed give bitwise the
  uncaptured step's outputs and gradients;
- the single-GPU op (LASP_KIND_SINGLE_GPU) as `ScalarDecayAttention`, the same gradient checks on
  each rank's own sequences.
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

ABI_VERSION = 3
OK, ERROR_INVALID_ARGUMENT = 0, 1
MODE_OVERLAPPED, MODE_SEQUENTIAL_NCCL, MODE_NO_COMM = 0, 1, 3
FAMILY_SCALAR_DECAY = 1
KIND_SINGLE_GPU, KIND_LASP2 = 1, 2
SCHEDULE_ALL_GATHER = 1
OP_WITH_BACKWARD = 1
# LASP_SLOT_* of lasp_shmem.h: where each tensor of a call goes in Tensors.slot.
(SLOT_Q, SLOT_K, SLOT_V, SLOT_G, SLOT_H0, SLOT_O, SLOT_HT, SLOT_START_STATE, SLOT_DO, SLOT_DHT,
 SLOT_DQ, SLOT_DK, SLOT_DV, SLOT_DG, SLOT_DH0) = (0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16)
SLOT_CAPACITY = 32
# LASP_DTYPE_* of the torch dtypes the library names.
DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.int32: 4, torch.int64: 5}
TOL = 5e-3


class SizedStruct(ctypes.Structure):
    """A struct of lasp_shmem.h that begins with struct_size: filled in with this mirror's size;
    every other field is zero unless given (the reserved ones must stay so)."""

    def __init__(self, **fields):
        super().__init__(struct_size=ctypes.sizeof(type(self)), **fields)


class RuntimeOptions(SizedStruct):
    _fields_ = [("struct_size", ctypes.c_uint32), ("abi_version", ctypes.c_uint32),
                ("symmetric_heap_bytes", ctypes.c_uint64), ("wait_timeout_ms", ctypes.c_uint64),
                ("nvshmem_library", ctypes.c_char_p)]


class Place(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32)
                for name in ("rank", "world_size", "local_rank", "local_world_size")]


class UniqueId(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint8 * 128)]


class OpDesc(SizedStruct):
    _fields_ = ([("struct_size", ctypes.c_uint32), ("abi_version", ctypes.c_uint32)]
                + [(n, ctypes.c_int32) for n in ("family", "kind", "schedule", "mode")]
                + [(n, ctypes.c_int64) for n in ("batch", "heads", "dk", "dv", "tokens")]
                + [("flags", ctypes.c_uint64), ("reserved", ctypes.c_uint64 * 8)])


class Call(SizedStruct):
    _fields_ = [("struct_size", ctypes.c_uint32), ("scale", ctypes.c_float),
                ("tokens", ctypes.c_int64), ("shard_start", ctypes.c_int64),
                ("reserved", ctypes.c_uint64 * 5)]


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("numel", ctypes.c_int64), ("dtype", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class Tensors(SizedStruct):
    _fields_ = [("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("slot", Tensor * SLOT_CAPACITY)]


for struct, size in ((RuntimeOptions, 32), (Place, 16), (UniqueId, 128), (OpDesc, 136),
                     (Call, 64), (Tensor, 24), (Tensors, 776)):
    assert ctypes.sizeof(struct) == size, f"{struct.__name__} does not match lasp_shmem.h"


P, HANDLE, OUT = ctypes.POINTER, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
I32, U64 = ctypes.c_int32, ctypes.c_uint64
# Every entry point this script calls, with the argument types of lasp_shmem.h (ctypes would
# otherwise pass Python ints as 32-bit C ints).
SIGNATURES = {
    "unique_id_create": [P(RuntimeOptions), P(Place), P(UniqueId)],
    "runtime_init": [P(RuntimeOptions), P(Place), P(UniqueId), OUT],
    "runtime_shutdown": [HANDLE],
    "op_create": [HANDLE, P(OpDesc), OUT],
    "op_forward": [HANDLE, HANDLE, P(Call), P(Tensors)],
    "op_backward": [HANDLE, HANDLE, P(Call), P(Tensors)],
    "op_set_mode": [HANDLE, I32],
    "op_finish": [HANDLE, HANDLE],
    "op_note_replayed_calls": [HANDLE, U64, U64],
    "op_free": [HANDLE],
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


def tensor_of(x):
    """The lasp_tensor of a contiguous torch tensor on the GPU (an empty slot for None)."""
    if x is None:
        return Tensor()
    if x.dtype not in DTYPES:
        raise ValueError(f"lasp-shmem takes no {x.dtype} tensors")
    return Tensor(x.data_ptr(), x.numel(), DTYPES[x.dtype], 0)


class CallArgs:
    """One call's scalars (`call`: this call's tokens per sequence, the default scale) and its
    tensors by slot (`tensors`)."""

    def __init__(self, tokens, slots):
        self.call = Call(tokens=tokens)
        self.tensors = Tensors()
        for slot, x in slots.items():
            self.tensors.slot[slot] = tensor_of(x)

    def refs(self):
        return ctypes.byref(self.call), ctypes.byref(self.tensors)


def forward_args(q, k, v, g, h0, o, ht, start_state=None):
    """A forward call; LASP-2 writes the state this rank's shard starts from to start_state."""
    return CallArgs(q.shape[1], {SLOT_Q: q, SLOT_K: k, SLOT_V: v, SLOT_G: g, SLOT_H0: h0, SLOT_O: o,
                                 SLOT_HT: ht, SLOT_START_STATE: start_state})


def backward_args(q, k, v, g, h0, grad_o, grad_ht, grad_q, grad_k, grad_v, grad_g, grad_h0,
                  start_state=None):
    """A backward call: one GPU starts from h0, LASP-2 from the forward's start_state (h0 None)."""
    return CallArgs(q.shape[1], {
        SLOT_Q: q, SLOT_K: k, SLOT_V: v, SLOT_G: g, SLOT_H0: h0, SLOT_START_STATE: start_state,
        SLOT_DO: grad_o, SLOT_DHT: grad_ht, SLOT_DQ: grad_q, SLOT_DK: grad_k, SLOT_DV: grad_v,
        SLOT_DG: grad_g, SLOT_DH0: grad_h0})


def current_stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def scalar_decay_desc(kind, b, h, dk, dv, mode=MODE_OVERLAPPED, backward=True):
    """The lasp_op_desc of scalar decay of one layout (the schedule and mode only for LASP-2)."""
    lasp2 = kind == KIND_LASP2
    return OpDesc(abi_version=ABI_VERSION, family=FAMILY_SCALAR_DECAY, kind=kind,
                  schedule=SCHEDULE_ALL_GATHER if lasp2 else 0, mode=mode if lasp2 else 0,
                  batch=b, heads=h, dk=dk, dv=dv, flags=OP_WITH_BACKWARD if backward else 0)


class Op:
    """One scalar-decay lasp_op of a layout: on this rank's GPU (KIND_SINGLE_GPU) or across the
    ranks (KIND_LASP2: created, switched and freed collectively), forward and, unless
    backward=False, backward. Calls run on `stream`, by default torch's current stream."""

    def __init__(self, lasp, runtime, kind, b, h, dk, dv, mode=MODE_OVERLAPPED, backward=True):
        desc = scalar_decay_desc(kind, b, h, dk, dv, mode, backward)
        self.lasp, self.handle = lasp, ctypes.c_void_p()
        lasp.op_create(runtime, ctypes.byref(desc), ctypes.byref(self.handle))

    def forward(self, args, stream=None):
        self.lasp.op_forward(self.handle, current_stream() if stream is None else stream,
                             *args.refs())

    def backward(self, args, stream=None):
        self.lasp.op_backward(self.handle, current_stream() if stream is None else stream,
                              *args.refs())

    def set_mode(self, mode):
        self.lasp.op_set_mode(self.handle, mode)

    def finish(self):
        self.lasp.op_finish(self.handle, current_stream())

    def note_replayed_calls(self, forward_calls, backward_calls):
        self.lasp.op_note_replayed_calls(self.handle, forward_calls, backward_calls)

    def free(self):
        self.lasp.op_free(self.handle)


class Lasp2Layer:
    """One LASP-2 attention layout on every rank: a forward and backward operation (created
    collectively), called through `Lasp2Attention`."""

    def __init__(self, lasp, runtime, b, h, dk, dv, rank, world, mode=MODE_OVERLAPPED):
        self.lasp, self.rank, self.world = lasp, rank, world
        self.op = Op(lasp, runtime, KIND_LASP2, b, h, dk, dv, mode)

    def set_mode(self, mode):
        self.op.set_mode(mode)

    def finish(self):
        self.op.finish()

    def free(self):
        self.op.free()

    def __call__(self, q, k, v, g, h0=None):
        """This rank's shard of o, and the sequence's final state on the last rank (None on the
        others). h0, the sequence's initial state, is the same on every rank; its gradient lands
        on rank 0, the others return zeros (a sum over the ranks gives the gradient)."""
        return Lasp2Attention.apply(self, q, k, v, g, h0)


class Lasp2Attention(torch.autograd.Function):
    """LASP-2 linear attention with scalar decay over the shards of the ranks: the forward keeps
    the state its shard starts from, which the backward starts from; the gradients of the state
    travel from the last rank down inside lasp_op_backward. Every rank calls the forward, and
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
        layer.op.forward(forward_args(q, k, v, g, h0, o, ht, start_state=start))
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
        args = backward_args(q, k, v, g, None, grad_o.contiguous(), contiguous(grad_ht), *grads,
                             grad_h0 if layer.rank == 0 else None, start_state=start)
        layer.op.backward(args)
        return (None, *grads, grad_h0)


class ScalarDecayAttention(torch.autograd.Function):
    """The same attention over whole sequences on one GPU (`op`, a KIND_SINGLE_GPU `Op` of the
    layout): (o, ht)."""

    @staticmethod
    def forward(ctx, op, q, k, v, g, h0):
        require_contiguous(q, k, v, g, h0)
        b, t, h, dk = q.shape
        dv = v.shape[-1]
        o = torch.empty(b, t, h, dv, dtype=torch.bfloat16, device=q.device)
        ht = torch.empty(b, h, dk, dv, device=q.device)
        op.forward(forward_args(q, k, v, g, h0, o, ht))
        ctx.op = op
        ctx.save_for_backward(q, k, v, g, h0)
        return o, ht

    @staticmethod
    def backward(ctx, grad_o, grad_ht):
        q, k, v, g, h0 = ctx.saved_tensors
        grads = [torch.empty_like(x) for x in (q, k, v, g)]
        grad_h0 = None if h0 is None else torch.empty_like(h0)
        args = backward_args(q, k, v, g, h0, grad_o.contiguous(), contiguous(grad_ht), *grads,
                             grad_h0)
        ctx.op.backward(args)
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
    op = Op(lasp, runtime, KIND_LASP2, b, h, d, d, backward=False)

    def run():
        o.fill_(float("nan"))
        if ht is not None:
            ht.fill_(float("nan"))
        op.forward(args)
        op.finish()
        return o.clone(), None if ht is None else ht.clone()

    o1, ht1 = run()
    err = rel_err(o1, seqs.mine(want_o))
    line = f"rank {rank}: shard of {seqs.length} of {total} tokens: o rel err {err:.2e}"
    if last:
        line += f", final state rel err {rel_err(ht1, want_ht):.2e}"
    say(line + f" (tolerance {TOL:g})")
    assert err <= TOL and (not last or rel_err(ht1, want_ht) <= TOL), "does not match"

    op.set_mode(MODE_SEQUENTIAL_NCCL)
    o2, ht2 = run()
    assert torch.equal(bits(o1), bits(o2)), "sequential NCCL differs"
    assert not last or torch.equal(bits(ht1), bits(ht2))
    op.set_mode(MODE_OVERLAPPED)
    say(f"rank {rank}: sequential NCCL gives bitwise the overlapped outputs")

    graph, replays = torch.cuda.CUDAGraph(), 50
    o.fill_(float("nan"))
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        op.forward(args)
    for _ in range(replays):
        graph.replay()
    op.note_replayed_calls(replays, 0)
    op.finish()
    assert torch.equal(bits(o1), bits(o)), "graph replays differ"
    say(f"rank {rank}: {replays} replays of a torch.cuda.graph capture: bitwise identical")

    bad = forward_args(*mine, h0, o, ht)
    bad.tensors.slot[SLOT_Q].data = q.cpu().data_ptr()
    try:
        op.forward(bad)
        raise AssertionError("a CPU tensor for q was accepted")
    except LaspError as e:
        assert e.status == ERROR_INVALID_ARGUMENT and "LASP_SLOT_Q at 0x" in str(e), str(e)
        say(f"rank {rank}: a CPU tensor is rejected: {str(e)[:110]}...")
    op.free()


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
        bad = backward_args(*mine, None, seqs.mine(grad_o), grad_ht, *outs, None,
                            start_state=start_state)
        try:
            layer.op.backward(bad)
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
    fwd = forward_args(q, k, v, g, h0, o, ht, start_state=start_state)
    bwd = backward_args(q, k, v, g, None, grad_o, grad_ht if last else None, *grads, dh0,
                        start_state=start_state)
    written = [x for x in (o, start_state, ht, *grads, dh0) if x is not None]

    def training_step():
        layer.op.forward(fwd)
        layer.op.backward(bwd)

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
    layer.op.note_replayed_calls(replays, replays)
    layer.finish()
    for x, y in zip(written, want):
        assert torch.equal(bits(x), bits(y)), f"rank {rank}: a replayed training step differs"
    say(f"rank {rank}: {replays} replays of a captured forward + backward: bitwise identical")


def check_single_gpu_training(lasp, runtime, rank, dev):
    """A single-GPU lasp_op (forward and backward) through torch.autograd on this rank's own
    sequences (Dk 64, Dv 128, ragged T), against the float64 reference."""
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
    op = Op(lasp, runtime, KIND_SINGLE_GPU, b, h, dk, dv)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, ht = ScalarDecayAttention.apply(op, *leaves)
    torch.autograd.backward((o, ht), (grad_o, grad_ht))
    torch.cuda.synchronize()
    errors = gradient_checks(rank, [x.grad for x in leaves], want,
                             ("dq", "dk", "dv", "dg", "dh0"), 0, t)
    say(f"rank {rank}: one GPU through torch.autograd (B={b} T={t} H={h} Dk={dk} Dv={dv}): "
        f"{errors} (tolerance {TOL:g})")
    op.free()


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
    fwd = forward_args(q, k, v, g, None, o, None, start_state=start_state)
    bwd = backward_args(q, k, v, g, None, grad_o, grad_ht, *grads, None, start_state=start_state)
    layer = Lasp2Layer(lasp, runtime, b, h, d, d, rank, world)
    stream = current_stream()
    calls = {
        "forward": lambda: layer.op.forward(fwd, stream),
        "backward": lambda: layer.op.backward(bwd, stream),
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
    options = RuntimeOptions(abi_version=ABI_VERSION, symmetric_heap_bytes=256 << 20)
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
