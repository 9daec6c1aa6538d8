"""LASP-2 for GLA (per-key gates) composed from fla's kernels and NCCL: the peer our layer is compared with.

    torchrun --standalone --nproc-per-node W benches/gla_lasp2_peer.py
    torchrun --standalone --nproc-per-node W benches/gla_lasp2_peer.py --shapes 4x8192,8x2048,4x4096 --out peer.json
    torchrun --standalone --nproc-per-node W benches/gla_lasp2_peer.py --with-backward --out peer_fb.json
    python3 benches/gla_lasp2_peer.py --self-test        # CPU only, no GPU, no fla (gloo for W = 2, 3)

Each of the W ranks holds T_local consecutive tokens of every sequence (rank r holds tokens
[r * T_local, (r + 1) * T_local)) and computes its part of o = GLA(q, k, v, g) (fla's chunk_gla
semantics: S_t = diag(e^g_t) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t, g <= 0 per key) in four steps:

  1. states: the shard's summary from a zero state (from h0 on rank 0 when there is one): M = its
     end state [B, H, Dk, Dv] fp32, from fla's states-only pass (chunk_local_cumsum of g in log2
     units, then fla.ops.common.chunk_h.chunk_fwd_h with gk = that cumsum and one split per shard,
     so it stores no per-chunk states; --states chunk_gla takes M from chunk_gla(...,
     output_final_state=True) instead), and Λ = the sum of g over the shard per key dim
     [B, H, Dk] fp32; both packed in one fp32 buffer;
  2. all-gather: torch.distributed.all_gather_into_tensor of the packed (M, Λ) summaries (NCCL);
  3. fold: P = diag(e^Λ_w) P + M_w over the ranks w < me in rank order, from P = 0 (rank 0: P = h0);
  4. forward: fla's chunk_gla(q, k, v, g, scale, initial_state=P) on the shard.

The training step (--with-backward) is the forward above with chunk_gla recording its autograd graph
and returning its final state on every rank (P carries no autograd edges: D below accounts for every
path through the later ranks), then, from do (and dht, the final state's gradient, on the last rank):

  5. states: X = the gradient w.r.t. the state entering the shard from its own tokens,
     sum_t diag(e^G_t) scale q_t^T do_t with G_t the inclusive cumsum of g from the shard start
     (plus diag(e^Λ) dht on the last rank), fp32 [B, H, Dk, Dv], from fla's backward states pass
     (fla.ops.common.chunk_h.chunk_bwd_dh with gk = the chunk-local log2 cumsum of g, dht on the
     last rank, one split per shard so it stores one dh, not one per chunk; its dh0 is X);
  6. all-gather of the X (NCCL; Λ is already here from step 2);
  7. fold: D = diag(e^Λ_u) D + X_u over the ranks u > me in descending order, from D = 0: the
     gradient w.r.t. the state leaving the shard (the last rank: D = dht, or 0 without one);
  8. backward: torch.autograd.grad through fla's chunk_gla on the shard with grad_outputs (do, D):
     dq, dk, dv, dg of the shard (and dh0 on rank 0 when h0 is given).

What is measured, per shape (B x T_local, H and D from --heads / --dim, Dk = Dv = D, bf16 q, k, v,
fp32 g = logsigmoid(N(0, 1)) / 16, no h0): the whole composition per call and each step alone, each as
--warmup untimed calls then --iters timed calls, every timed call after an on-stream barrier (a
one-element NCCL all-reduce the stream waits on) and between two CUDA events, the host
synchronising after each call (so the host's launch time shows where it exceeds the GPU's work,
as it would for a user of fla); per rank the median; each column of the row is its slowest rank
(so the parts need not add up to the whole), per_rank_ms keeps every rank's median of the whole
composition and parts_per_rank_ms every rank's median of each part. With --with-backward also the
training step (steps 1 to 8, bf16 do = N(0, 1), no dht, as our gla_lasp2 --with-backward times it)
and each of its parts alone, the same way: forward (steps 1 to 4 recording the graph), dstates
(step 5), allgather (step 6), fold (step 7), backward (step 8).

Correctness, before timing: on --check-shape (B x T_local x H x D, default 2x1000x4x64, a shard
length that is not a multiple of fla's 64-token chunk, gates logsigmoid(N(0, 1) + 6) so that
earlier shards still matter), every rank runs the composition, the outputs are gathered and rank 0
compares their concatenation with fla's chunk_gla on the whole W * T_local sequence: relative
error (float64 norms) <= 5e-3. Also printed: the error with P = 0 (no earlier shards), which
must exceed 10 x 5e-3 when W > 1 for the check to mean something. With --with-backward every rank
runs the training step instead, with an fp32 N(0, 1) h0 on rank 0, a bf16 N(0, 1) do and an fp32
N(0, 1) dht on the last rank; rank 0 compares the gathered dq, dk, dv (relative error <= 5e-3) and
dg (<= 1e-2: dg is a reverse cumsum over time of q * dq - k * dk, whose terms largely cancel, so
bf16's rounding of the terms is a larger part of the sum than in dq, dk, dv) and its dh0 (<= 5e-3)
with fla's backward of the whole sequence (from h0, with do and dht); also printed: dk, dv, dg and
dh0's errors with D = 0 (no later shards), dk's and dv's of which must exceed 10 x 5e-3 when W > 1.

Output (rank 0, stdout): one JSON line for the check ({"check": ..., rel_err_vs_fla,
rel_err_without_prefix, with --with-backward also grad_rel_err_vs_fla {dq, dk, dv, dg, dh0},
grad_rel_err_without_D {dk, dv, dg, dh0} and grad_tolerance}) and one per shape with W, B, T_local,
H, D, fla_peer_ms, states_ms, allgather_ms, fold_ms, forward_ms, per_rank_ms, parts_per_rank_ms,
states (which states pass), summary_bytes_per_rank; with --with-backward also fla_peer_step_ms
(the training step, slowest rank), step_per_rank_ms (every rank's median of it), step_parts_ms
{forward, dstates, allgather, fold, backward} (each part's slowest rank) and
step_parts_per_rank_ms (every rank's median of each part); --out FILE also writes them all as one
JSON object (device, commit from env LASP_COMMIT, date from env LASP_DATE, method, versions, check,
rows).

Needs torch with CUDA and NCCL, and fla-core 0.6.0 (its wheel unpacked on PYTHONPATH, einops beside it).
Time: on a node whose Triton cache is empty, fla autotunes each kernel once per (chunk size, Dk, Dv)
by compiling and timing every configuration, about 40 s per kernel on a 4x H100 node: over three
minutes for the forward, and for --with-backward more than the seven minutes (420 s over two
processes sharing one cache) that one job gave it (the check's D and the timed D each autotune).
fla keeps the winners in Triton's cache (FLA_CACHE_RESULTS, on by default), so a run with the
TRITON_CACHE_DIR of an earlier one on the same GPU model, Triton and fla starts at once.
Exit status: 0 when the check passed and every shape ran; 1 when the check failed or a rank raised
(torchrun then ends the others); 2 for bad arguments.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import types

TOL = 5e-3
# dg is a reverse cumsum of nearly cancelling terms (see the docstring)
TOL_DG = 1e-2
SENSITIVITY = 10 * TOL
DEFAULT_SHAPES = "4x8192,1x32768,1x131072"
# A hook for a CPU dry run (gloo, the host's clock for CUDA events, float64 stand-ins for fla's
# functions: reference_ops); leave it unset for measurements.
DEVICE = os.environ.get("GLA_PEER_DEVICE", "cuda")


# ---------------------------------------------------------------------------------------------
# Pure parts: checked by --self-test on CPU.
# ---------------------------------------------------------------------------------------------

def parse_shapes(text, heads, dim):
    """'4x8192,8x2048' (B x T_local, H = heads, D = dim) or 'BxTxHxD' items -> [(B, T, H, D)]."""
    shapes = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.lower().split("x")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"bad shape {item!r}: expected BxT_local or BxT_localxHxD") from None
        if len(nums) == 2:
            nums += [heads, dim]
        if len(nums) != 4 or min(nums) <= 0:
            raise ValueError(f"bad shape {item!r}: expected BxT_local or BxT_localxHxD, positive")
        shapes.append(tuple(nums))
    if not shapes:
        raise ValueError("no shapes given")
    return shapes


def summary_layout(B, H, K, V):
    """Sizes of the packed summary: M [B, H, K, V] then Λ [B, H, K], fp32."""
    return B * H * K * V, B * H * K


def pack_summary(M, lam, out):
    """Write M and Λ into the flat fp32 buffer `out` (one all-gather carries both)."""
    nm = M.numel()
    out[:nm].view_as(M).copy_(M)
    out[nm:].view_as(lam).copy_(lam)
    return out


def unpack_summaries(gathered, B, H, K, V):
    """Views of the gathered buffers [W, n]: Mg [W, B, H, K, V], Lg [W, B, H, K]."""
    W = gathered.shape[0]
    nm, nl = summary_layout(B, H, K, V)
    assert gathered.shape[1] == nm + nl, (gathered.shape, nm, nl)
    return gathered[:, :nm].view(W, B, H, K, V), gathered[:, nm:].view(W, B, H, K)


def fold_prefix(Mg, Lg, rank, torch):
    """P = diag(e^Λ_w) P + M_w for w = 0 .. rank - 1 in order, from P = 0: the state the shard
    `rank` starts from. Mg [W, B, H, K, V], Lg [W, B, H, K], fp32."""
    P = torch.zeros_like(Mg[0])
    for w in range(rank):
        P = torch.addcmul(Mg[w], torch.exp(Lg[w]).unsqueeze(-1), P)
    return P


def fold_suffix(Xg, Lg, rank, torch):
    """D = diag(e^Λ_u) D + X_u for u = W - 1 down to rank + 1, from D = 0: the gradient w.r.t. the
    state leaving the shard `rank`, X_u being the gradient w.r.t. the state entering shard u from
    its own tokens (and from dht for u = W - 1). Xg [W, B, H, K, V], Lg [W, B, H, K], fp32."""
    D = torch.zeros_like(Xg[0])
    for u in range(Xg.shape[0] - 1, rank, -1):
        D = torch.addcmul(Xg[u], torch.exp(Lg[u]).unsqueeze(-1), D)
    return D


def gate_sum(g, torch):
    """Λ: the sum of the shard's log-gates over time, per key dim, fp32: [B, T, H, K] -> [B, H, K]."""
    return g.sum(dim=1, dtype=torch.float32)


def slowest(per_rank):
    return max(per_rank)


def rel_err(got, want):
    """|got - want| / |want|, float64 norms, as a float."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm()).item()


def naive_gla(q, k, v, g, scale, h0, torch):
    """Reference GLA recurrence in float64 (CPU self-test), differentiable: returns
    (o [B, T, H, V], S_T [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, K, V, dtype=torch.float64) if h0 is None else h0.double().clone()
    q, k, v, g = (x.double() for x in (q, k, v, g))
    o = torch.empty(B, T, H, V, dtype=torch.float64)
    for t in range(T):
        S = torch.exp(g[:, t]).unsqueeze(-1) * S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


def reference_ops(torch):
    """float64 CPU stand-ins for the fla functions the composition calls, with their signatures and
    semantics (the parts the composition uses): chunk_gla by the differentiable recurrence
    (naive_gla), chunk_local_cumsum, and chunk_fwd_h / chunk_bwd_dh chunk by chunk from the
    chunk-local log2 gate cumsum, storing the state (its gradient) at every split's start."""

    def chunk_local_cumsum(g, chunk_size, reverse=False, scale=None, cu_seqlens=None, **kwargs):
        assert not reverse and cu_seqlens is None
        B, T = g.shape[:2]
        n = -(-T // chunk_size) * chunk_size
        gp = torch.zeros(B, n, *g.shape[2:], dtype=torch.float64)
        gp[:, :T] = g
        gc = gp.view(B, n // chunk_size, chunk_size, *g.shape[2:]).cumsum(2).view_as(gp)[:, :T]
        return gc if scale is None else gc * scale

    def chunks(T, chunk_size, split_size):
        bs = chunk_size if split_size is None else split_size
        assert bs % chunk_size == 0
        return [(s, min(s + chunk_size, T), s % bs == 0) for s in range(0, T, chunk_size)]

    def chunk_fwd_h(k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None, output_final_state=False,
                    state_v_first=False, cu_seqlens=None, chunk_size=64, split_size=None,
                    states_in_fp32=False):
        assert g is None and g_gamma is None and gv is None and not state_v_first and cu_seqlens is None
        B, T, H, K = k.shape
        h = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if h0 is None else h0.double()
        hs = []
        for s, e, split in chunks(T, chunk_size, split_size):
            if split:
                hs.append(h)
            last = gk[:, e - 1]
            kd = k[:, s:e].double() * torch.exp2(last.unsqueeze(1) - gk[:, s:e])
            h = torch.exp2(last).unsqueeze(-1) * h + torch.einsum("bthk,bthv->bhkv", kd, v[:, s:e].double())
        hs = torch.stack(hs, 1).to(torch.float32 if states_in_fp32 else k.dtype)
        return hs, h.float() if output_final_state else None

    def chunk_bwd_dh(q, k, v, do, h0, dht, scale, g=None, g_gamma=None, gk=None, gv=None,
                     state_v_first=False, cu_seqlens=None, chunk_size=64, split_size=None,
                     states_in_fp32=False):
        assert g is None and g_gamma is None and gv is None and not state_v_first and cu_seqlens is None
        B, T, H, K = k.shape
        dh = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if dht is None else dht.double()
        dhs = []
        for s, e, split in reversed(chunks(T, chunk_size, split_size)):
            if split:
                dhs.insert(0, dh)
            qd = scale * q[:, s:e].double() * torch.exp2(gk[:, s:e])
            dh = torch.exp2(gk[:, e - 1]).unsqueeze(-1) * dh + torch.einsum("bthk,bthv->bhkv", qd, do[:, s:e].double())
        dhs = torch.stack(dhs, 1).to(torch.float32 if states_in_fp32 else k.dtype)
        return dhs, dh.float() if h0 is not None else None

    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                  state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None):
        assert not state_v_first and cu_seqlens is None
        o, S = naive_gla(q, k, v, g, q.shape[-1] ** -0.5 if scale is None else scale, initial_state, torch)
        return o.to(q.dtype), S.float() if output_final_state else None

    return types.SimpleNamespace(chunk_gla=chunk_gla, chunk_fwd_h=chunk_fwd_h, chunk_bwd_dh=chunk_bwd_dh,
                                 chunk_local_cumsum=chunk_local_cumsum, RCP_LN2=1 / math.log(2),
                                 qkv_dtype=torch.float64, gate_dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# The composition, with fla and NCCL (GPU).
# ---------------------------------------------------------------------------------------------

def fla_ops():
    """fla's functions the composition calls, and the dtypes it feeds them (imported here: the
    CPU self-test runs without fla)."""
    import torch
    from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
    from fla.ops.gla import chunk_gla
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    return types.SimpleNamespace(chunk_gla=chunk_gla, chunk_fwd_h=chunk_fwd_h, chunk_bwd_dh=chunk_bwd_dh,
                                 chunk_local_cumsum=chunk_local_cumsum, RCP_LN2=RCP_LN2,
                                 qkv_dtype=torch.bfloat16, gate_dtype=torch.float32)


def default_ops():
    import torch

    return fla_ops() if DEVICE == "cuda" else reference_ops(torch)


def fla_chunk_size(T):
    # chunk_gla's own choice (fla/ops/gla/chunk.py, ChunkGLAFunction.forward)
    return min(64, max(16, 1 << max(0, (T - 1).bit_length())))


def one_split(T, bt):
    """A split size covering the whole shard: the states passes then store only one state."""
    return math.ceil(T / bt) * bt


def make_states_fn(kind, ops):
    """The states-only pass: (q, k, v, g) of a shard and h0 (or None) -> its end state from h0 (or
    zero), fp32 [B, H, K, V]."""
    if kind == "chunk_fwd_h":
        def states(q, k, v, g, scale, h0):
            T = k.shape[1]
            bt = fla_chunk_size(T)
            gc = ops.chunk_local_cumsum(g, chunk_size=bt, scale=ops.RCP_LN2)
            _, M = ops.chunk_fwd_h(k=k, v=v, gk=gc, h0=h0, output_final_state=True, chunk_size=bt,
                                   split_size=one_split(T, bt))
            return M
    elif kind == "chunk_gla":
        def states(q, k, v, g, scale, h0):
            import torch

            with torch.no_grad():
                _, M = ops.chunk_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True)
            return M
    else:
        raise ValueError(kind)
    return states


def make_dstates_fn(ops):
    """The backward's states-only pass: (q, g, do) of a shard and dht (or None) -> the gradient
    w.r.t. the state entering the shard, fp32 [B, H, K, V]."""
    import torch

    def dstates(q, k, v, g, do, dht, scale):
        B, T, H, K = k.shape
        bt = fla_chunk_size(T)
        # the cumsum again, as fla's own backward recomputes it: one read of g
        gc = ops.chunk_local_cumsum(g, chunk_size=bt, scale=ops.RCP_LN2)
        # chunk_bwd_dh writes dh0 only when given an h0, which it reads for dh0's shape alone
        like = torch.empty(B, H, K, v.shape[-1], device=k.device, dtype=torch.float32)
        _, X = ops.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=like, dht=dht, scale=scale, gk=gc, chunk_size=bt,
                                split_size=one_split(T, bt))
        return X
    return dstates


class Peer:
    """One rank's LASP-2 composition on its shard, with its buffers preallocated. h0 is rank 0's
    initial state (or None); given do (and dht on the last rank, or None) also the training step.
    group: the process group of the W ranks (None: the default group)."""

    def __init__(self, q, k, v, g, scale, states_kind, dist, torch, ops, h0=None, do=None, dht=None,
                 group=None):
        self.q, self.k, self.v, self.g, self.scale = q, k, v, g, scale
        self.h0, self.do, self.dht = h0, do, dht
        self.torch, self.dist, self.ops, self.group = torch, dist, ops, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        assert h0 is None or self.rank == 0, "h0 is rank 0's"
        assert dht is None or self.rank == self.world - 1, "dht is the last rank's"
        B, _, H, K = k.shape
        V = v.shape[-1]
        self.dims = (B, H, K, V)
        n = sum(summary_layout(B, H, K, V))
        self.send = torch.empty(n, device=k.device, dtype=torch.float32)
        # flat, so that every rank's part has the send buffer's shape (gloo insists; NCCL doesn't mind)
        self.recv_flat = torch.empty(self.world * n, device=k.device, dtype=torch.float32)
        self.recv = self.recv_flat.view(self.world, n)
        self.states_fn = make_states_fn(states_kind, ops)
        self.P = None
        # The training step's buffers, also when do comes later (set self.do before dstates): a
        # differentiable wrapper has do only in its backward.
        self.dstates_fn = make_dstates_fn(ops)
        self.drecv_flat = torch.empty(self.world * B * H * K * V, device=k.device, dtype=torch.float32)
        self.drecv = self.drecv_flat.view(self.world, B, H, K, V)
        self.D_last = dht if dht is not None else torch.zeros(B, H, K, V, device=k.device, dtype=torch.float32)
        self.grad_inputs = (q, k, v, g) + ((h0,) if h0 is not None else ())
        self.o = self.ht = self.X = self.D = None

    def states(self):
        M = self.states_fn(self.q, self.k, self.v, self.g, self.scale, self.h0)
        pack_summary(M.float(), gate_sum(self.g, self.torch), self.send)

    def allgather(self):
        self.dist.all_gather_into_tensor(self.recv_flat, self.send, group=self.group)

    def fold(self):
        Mg, Lg = unpack_summaries(self.recv, *self.dims)
        # rank 0 starts from h0 itself (its M carries h0 to the later ranks), so that dh0 flows to it
        self.P = self.h0 if self.rank == 0 and self.h0 is not None else fold_prefix(Mg, Lg, self.rank, self.torch)

    def forward(self, P=None):
        o, _ = self.ops.chunk_gla(self.q, self.k, self.v, self.g, scale=self.scale,
                                  initial_state=self.P if P is None else P, output_final_state=False)
        return o

    def __call__(self):
        self.states()
        self.allgather()
        self.fold()
        return self.forward()

    def train_forward(self):
        """Steps 1 to 4 with chunk_gla recording its graph; the final state is an output on every
        rank, so that its gradient D can be fed to the backward."""
        self.o = self.ht = None  # the previous step's graph goes before the next one is recorded
        with self.torch.no_grad():
            # P without autograd edges: D accounts for every path through the later ranks
            self.states()
            self.allgather()
            self.fold()
        self.o, self.ht = self.ops.chunk_gla(self.q, self.k, self.v, self.g, scale=self.scale,
                                             initial_state=self.P, output_final_state=True)

    def dstates(self):
        self.X = self.dstates_fn(self.q, self.k, self.v, self.g, self.do, self.dht, self.scale).reshape(-1)

    def dallgather(self):
        # no_grad: gloo writes into views of the output, which grad mode refuses (the collective has
        # no gradient anyway)
        with self.torch.no_grad():
            self.dist.all_gather_into_tensor(self.drecv_flat, self.X, group=self.group)

    def dfold(self):
        _, Lg = unpack_summaries(self.recv, *self.dims)
        self.D = self.D_last if self.rank == self.world - 1 else fold_suffix(self.drecv, Lg, self.rank, self.torch)

    def backward(self, D=None):
        """fla's chunk_gla backward on the shard from (do, D): (dq, dk, dv, dg), then dh0 when h0 is
        given. The graph is kept, so that the backward alone can be timed over and over; the next
        train_forward lets it go."""
        return self.torch.autograd.grad((self.o, self.ht), self.grad_inputs,
                                        grad_outputs=(self.do, self.D if D is None else D), retain_graph=True)

    def step(self):
        self.train_forward()
        self.dstates()
        self.dallgather()
        self.dfold()
        return self.backward()


class HostEvent:
    """torch.cuda.Event's timing on the host's clock, for the CPU dry run."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def timed(fn, warmup, iters, dist, torch):
    """This rank's median ms of fn over `iters` calls, each after an on-stream barrier and between
    two CUDA events, the host synchronising after each."""
    cuda = DEVICE == "cuda"
    event = torch.cuda.Event if cuda else HostEvent
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    token = torch.zeros(1, device=DEVICE)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        dist.all_reduce(token)  # the stream waits for every rank to get here
        a = event(enable_timing=True)
        b = event(enable_timing=True)
        a.record()
        fn()
        b.record()
        sync()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def gather_floats(x, dist, torch):
    """Every rank's float x, on every rank, in rank order."""
    t = torch.tensor([float(x)], device=DEVICE, dtype=torch.float64)
    out = torch.empty(dist.get_world_size(), device=DEVICE, dtype=torch.float64)
    dist.all_gather_into_tensor(out, t)
    return out.tolist()


def gather_sequence(x, dist, torch):
    """Every rank's shard x [B, T_local, ...], concatenated along time: [B, W * T_local, ...]."""
    world = dist.get_world_size()
    out = torch.empty(world * x.numel(), device=x.device, dtype=x.dtype)
    dist.all_gather_into_tensor(out, x.contiguous().view(-1))
    return torch.cat(out.view(world, *x.shape).unbind(0), dim=1)


def inputs(B, T, H, D, seed, gate_shift, gate_div, torch, ops):
    import torch.nn.functional as F

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rnd = lambda: torch.randn(B, T, H, D, device=DEVICE, generator=gen)  # noqa: E731
    q, k, v = (rnd().to(ops.qkv_dtype) for _ in range(3))
    g = (F.logsigmoid(rnd() + gate_shift) / gate_div).to(ops.gate_dtype)
    return q, k, v, g


def check(shape, states_kind, with_backward, dist, torch, ops):
    """The composition (with_backward: the training step) against fla's chunk_gla (its backward) on
    the whole sequence (rank 0); every rank returns the same dict."""
    B, Tl, H, D = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    scale = D ** -0.5
    # every rank draws the whole sequence with the same seed and keeps its shard
    q, k, v, g = inputs(B, world * Tl, H, D, 4321, 6.0, 1.0, torch, ops)
    sl = slice(rank * Tl, (rank + 1) * Tl)
    shard = lambda x: x[:, sl].contiguous()  # noqa: E731
    names = ["o", "o_without_prefix"]
    if with_backward:
        gen = torch.Generator(device=DEVICE).manual_seed(8765)
        do = torch.randn(B, world * Tl, H, D, device=DEVICE, generator=gen).to(ops.qkv_dtype)
        h0, dht = (torch.randn(B, H, D, D, device=DEVICE, generator=gen) for _ in range(2))
        peer = Peer(*(shard(x).requires_grad_() for x in (q, k, v, g)), scale, states_kind, dist, torch, ops,
                    h0=h0.clone().requires_grad_() if rank == 0 else None, do=shard(do),
                    dht=dht if rank == world - 1 else None)
        grads = peer.step()
        grads0 = peer.backward(torch.zeros_like(peer.D))
        o = peer.o.detach()
        grad_names = ["dq", "dk", "dv", "dg", "dh0"]
        names += grad_names + [f"{n}_without_D" for n in grad_names[1:]]
    else:
        peer = Peer(*(shard(x) for x in (q, k, v, g)), scale, states_kind, dist, torch, ops)
        with torch.no_grad():
            o = peer()
    with torch.no_grad():
        o0 = peer.forward(torch.zeros_like(peer.P))
        got = {"o": gather_sequence(o, dist, torch), "o_without_prefix": gather_sequence(o0, dist, torch)}
        if with_backward:
            for n, x, x0 in zip(grad_names[:4], grads, grads0):
                got[n] = gather_sequence(x, dist, torch)
                got[f"{n}_without_D"] = gather_sequence(x0, dist, torch)
        res = torch.zeros(len(names), device=DEVICE, dtype=torch.float64)
    if rank == 0:
        if with_backward:
            got["dh0"], got["dh0_without_D"] = grads[4], grads0[4]
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, h0)]
            ref, ref_ht = ops.chunk_gla(*leaves[:4], scale=scale, initial_state=leaves[4], output_final_state=True)
            want = dict(zip(grad_names, torch.autograd.grad((ref, ref_ht), leaves, grad_outputs=(do, dht))))
            ref = ref.detach()
        else:
            with torch.no_grad():
                ref, _ = ops.chunk_gla(q, k, v, g, scale=scale, output_final_state=False)
            want = {}
        for i, n in enumerate(names):
            res[i] = rel_err(got[n], ref if n.startswith("o") else want[n.removesuffix("_without_D")])
    dist.broadcast(res, 0)
    errs = dict(zip(names, res.tolist()))
    err, err0 = errs["o"], errs["o_without_prefix"]
    ok = math.isfinite(err) and err <= TOL
    sensitive = world == 1 or err0 > SENSITIVITY
    notes = [] if sensitive else [f"P = 0 is within {SENSITIVITY}: the check cannot see the prefix"]
    out = dict(check=dict(W=world, B=B, T_local=Tl, H=H, D=D, states=states_kind, with_backward=with_backward),
               rel_err_vs_fla=float(f"{err:.4e}"), rel_err_without_prefix=float(f"{err0:.4e}"), tolerance=TOL)
    if with_backward:
        tols = {n: TOL_DG if n == "dg" else TOL for n in grad_names}
        ok = ok and all(math.isfinite(errs[n]) and errs[n] <= tols[n] for n in grad_names)
        if world > 1 and not all(errs[f"{n}_without_D"] > SENSITIVITY for n in ("dk", "dv")):
            sensitive = False
            notes.append(f"D = 0 is within {SENSITIVITY} for dk or dv: the check cannot see the later shards")
        out.update(grad_rel_err_vs_fla={n: float(f"{errs[n]:.4e}") for n in grad_names},
                   grad_rel_err_without_D={n: float(f"{errs[n + '_without_D']:.4e}") for n in grad_names[1:]},
                   grad_tolerance=tols)
    out.update(ok=bool(ok and sensitive), note="; ".join(notes) or None)
    return out


def measure(shape, args, dist, torch, ops):
    B, Tl, H, D = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, g = inputs(B, Tl, H, D, 1234 + rank, 0.0, 16.0, torch, ops)
    do = None
    if args.with_backward:
        for x in (q, k, v, g):
            x.requires_grad_()
        gen = torch.Generator(device=DEVICE).manual_seed(5678 + rank)
        do = torch.randn(B, Tl, H, D, device=DEVICE, generator=gen).to(ops.qkv_dtype)
    peer = Peer(q, k, v, g, D ** -0.5, args.states, dist, torch, ops, do=do)
    with torch.no_grad():
        peer()  # compile / autotune, and set P for the forward alone
        t = {name: timed(fn, args.warmup, args.iters, dist, torch)
             for name, fn in (("fla_peer_ms", peer), ("states_ms", peer.states), ("allgather_ms", peer.allgather),
                              ("fold_ms", peer.fold), ("forward_ms", peer.forward))}
    per_rank = {name: gather_floats(ms, dist, torch) for name, ms in t.items()}
    row = dict(W=world, B=B, T_local=Tl, H=H, D=D)
    row.update({name: round(slowest(ms), 5) for name, ms in per_rank.items()})
    row["per_rank_ms"] = [round(x, 5) for x in per_rank["fla_peer_ms"]]
    row["parts_per_rank_ms"] = {name: [round(x, 5) for x in ms]
                                for name, ms in per_rank.items() if name != "fla_peer_ms"}
    if args.with_backward:
        peer.step()  # compile / autotune the backward's kernels
        # in this order, so that each part finds what it needs from the one before
        t = {name: timed(fn, args.warmup, args.iters, dist, torch)
             for name, fn in (("step", peer.step), ("forward", peer.train_forward), ("dstates", peer.dstates),
                              ("allgather", peer.dallgather), ("fold", peer.dfold), ("backward", peer.backward))}
        per_rank = {name: gather_floats(ms, dist, torch) for name, ms in t.items()}
        row["fla_peer_step_ms"] = round(slowest(per_rank["step"]), 5)
        row["step_per_rank_ms"] = [round(x, 5) for x in per_rank["step"]]
        row["step_parts_ms"] = {name: round(slowest(ms), 5) for name, ms in per_rank.items() if name != "step"}
        row["step_parts_per_rank_ms"] = {name: [round(x, 5) for x in ms]
                                         for name, ms in per_rank.items() if name != "step"}
    row["states"] = args.states
    row["summary_bytes_per_rank"] = 4 * sum(summary_layout(B, H, D, D))
    return row


def run_arguments(doc, default_shapes, dim_help, self_test_help):
    """The parser of a peer's command line, with the options run_ranks reads."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=default_shapes,
                    help=f"comma-separated BxT_local (or BxT_localxHxD) per rank (default {default_shapes})")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help=dim_help)
    ap.add_argument("--check-shape", default="2x1000x4x64", help="BxT_localxHxD of the correctness check")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None, help="also write the rows and the check as one JSON file (rank 0)")
    ap.add_argument("--self-test", action="store_true", help=self_test_help)
    return ap


def main(argv=None):
    ap = run_arguments(__doc__, DEFAULT_SHAPES, "Dk = Dv",
                       "check the pure parts and, under gloo with W = 2 and 3, the composition on CPU, then exit")
    ap.add_argument("--states", choices=("chunk_fwd_h", "chunk_gla"), default="chunk_fwd_h",
                    help="fla function giving the shard's end state (default: the states-only chunk_fwd_h)")
    ap.add_argument("--with-backward", action="store_true",
                    help="also check and time the training step (forward + backward)")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    step = (" Training step (--with-backward): the forward recording chunk_gla's graph, chunk_bwd_dh "
            "states pass from do (dht on the last rank), NCCL all_gather_into_tensor, fold in descending "
            "rank order, torch.autograd.grad through chunk_gla with (do, D); timed as a whole and each part "
            "alone the same way." if args.with_backward else "")
    method = (f"fla + NCCL LASP-2 for GLA ({args.states} states pass, packed (M, Lambda) NCCL "
              f"all_gather_into_tensor, fold in rank order, chunk_gla with initial_state); per rank "
              f"{args.warmup} warm-up calls then the median of {args.iters} calls, each after an "
              f"on-stream barrier, CUDA events, host sync after each; row = slowest rank; each part "
              f"timed alone the same way.{step}")
    return run_ranks("gla_lasp2_peer", ap, args, method, default_ops, versions,
                     lambda shape, dist, torch, ops: check(shape, args.states, args.with_backward, dist, torch, ops),
                     measure)


def run_ranks(script, ap, args, method, make_ops, versions, check, measure):
    """What a peer's main does after parsing, the same for every peer: the shapes and counts
    checked (ap.error otherwise), this rank's GPU and process group (NCCL; gloo for the CPU dry
    run), the check, every shape measured, rank 0's JSON (--out) and the exit status (0, or 1 when
    the check failed). check(shape, dist, torch, ops) -> dict with "ok"; measure(shape, args, dist,
    torch, ops) -> row; make_ops() -> the functions the composition calls; method: the JSON's
    method text; versions(torch) -> the JSON's versions."""
    try:
        shapes = parse_shapes(args.shapes, args.heads, args.dim)
        [check_shape] = parse_shapes(args.check_shape, args.heads, args.dim)
    except ValueError as e:
        ap.error(str(e))
    if args.warmup < 0 or args.iters < 1:
        ap.error("--warmup must be >= 0 and --iters >= 1")

    import torch
    import torch.distributed as dist

    if DEVICE == "cuda":
        if not torch.cuda.is_available():
            print(f"{script}: torch sees no GPU: run this on the GPU node under torchrun", file=sys.stderr)
            return 1
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    ops = make_ops()

    failures = []
    t0 = time.time()
    # no try/except around the collectives: a rank that fails alone would leave the others waiting
    # in NCCL, while an exception ends this process and torchrun ends the rest
    chk = check(check_shape, dist, torch, ops)
    say(json.dumps(chk))
    if not chk["ok"]:
        failures.append(f"check failed: {chk}")
    rows = []
    for shape in shapes:
        row = measure(shape, args, dist, torch, ops)
        rows.append(row)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        say(json.dumps(row))
    if rank == 0 and args.out:
        result = {
            "device": torch.cuda.get_device_name() if DEVICE == "cuda" else f"{DEVICE} (float64 stand-ins for fla)",
            "commit": os.environ.get("LASP_COMMIT", "unknown"),
            "date": os.environ.get("LASP_DATE", "unknown"),
            "method": method,
            "versions": versions(torch),
            "check": chk,
            "errors": failures,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
        say(f"{script}: wrote {args.out} ({time.time() - t0:.0f} s)")
    if failures and rank == 0:
        print(f"{script}: FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    # every rank waits for rank 0's output: torchrun ends the others when one exits non-zero
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


def versions(torch):
    if DEVICE != "cuda":
        return {"torch": torch.__version__}
    import fla
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "fla": getattr(fla, "__version__", "unknown")}


def self_test():
    """CPU checks: shapes, packing, both folds against naive loops, the stand-ins for fla against the
    recurrence, the whole forward composition (a stack for the all-gather) against one sequence;
    then the forward and the training step under gloo in W = 2 and W = 3 processes, with the
    stand-ins for fla, against the float64 recurrence and its autograd on the whole sequence."""
    import torch

    assert parse_shapes("4x8192,8x2048, 4x4096", 16, 128) == [(4, 8192, 16, 128), (8, 2048, 16, 128),
                                                                (4, 4096, 16, 128)]
    assert parse_shapes("2x1000x4x64", 16, 128) == [(2, 1000, 4, 64)]
    for bad in ("", "4", "4x0", "4x8x16", "ax8", "4x8x1x2x3"):
        try:
            parse_shapes(bad, 16, 128)
        except ValueError:
            pass
        else:
            raise AssertionError(f"parse_shapes accepted {bad!r}")
    assert [fla_chunk_size(t) for t in (1, 16, 17, 33, 64, 65, 1000)] == [16, 16, 32, 64, 64, 64, 64]
    assert summary_layout(4, 16, 128, 128) == (4 * 16 * 128 * 128, 4 * 16 * 128)

    gen = torch.Generator().manual_seed(0)
    W, B, H, K, V = 5, 2, 3, 4, 6
    Mg = torch.randn(W, B, H, K, V, generator=gen)
    Lg = -torch.rand(W, B, H, K, generator=gen) * 2
    # pack / unpack round trip through a "gathered" [W, n] buffer
    bufs = torch.stack([pack_summary(Mg[w], Lg[w], torch.empty(sum(summary_layout(B, H, K, V))))
                        for w in range(W)])
    Mu, Lu = unpack_summaries(bufs, B, H, K, V)
    assert torch.equal(Mu, Mg) and torch.equal(Lu, Lg)
    # both folds against naive element-by-element loops
    for r in range(W):
        P, Dr = fold_prefix(Mu, Lu, r, torch).double(), fold_suffix(Mu, Lu, r, torch).double()
        want, want_d = torch.zeros(B, H, K, V, dtype=torch.float64), torch.zeros(B, H, K, V, dtype=torch.float64)
        for b in range(B):
            for h in range(H):
                for i in range(K):
                    for w in range(r):
                        want[b, h, i] = math.exp(Lg[w, b, h, i].item()) * want[b, h, i] + Mg[w, b, h, i].double()
                    for u in range(W - 1, r, -1):
                        want_d[b, h, i] = math.exp(Lg[u, b, h, i].item()) * want_d[b, h, i] + Mg[u, b, h, i].double()
        assert torch.allclose(P, want, rtol=1e-5, atol=1e-5), (r, (P - want).abs().max())
        assert torch.allclose(Dr, want_d, rtol=1e-5, atol=1e-5), (r, (Dr - want_d).abs().max())
    assert torch.equal(fold_prefix(Mu, Lu, 0, torch), torch.zeros(B, H, K, V))
    assert torch.equal(fold_suffix(Mu, Lu, W - 1, torch), torch.zeros(B, H, K, V))

    import torch.nn.functional as F

    # the stand-ins' states passes against the recurrence and its autograd: a shard of 37 tokens,
    # 16-token chunks, one split per shard and one per chunk
    ops = reference_ops(torch)
    B, T, H, K, V = 2, 37, 3, 4, 5
    scale = K ** -0.5
    q, k, g = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    v, do = (torch.randn(B, T, H, V, generator=gen, dtype=torch.float64) for _ in range(2))
    g = F.logsigmoid(g + 1)
    h0 = torch.randn(B, H, K, V, generator=gen).requires_grad_()
    dht = torch.randn(B, H, K, V, generator=gen)
    o, ST = naive_gla(q, k, v, g, scale, h0, torch)
    dh0_o, = torch.autograd.grad(o, h0, do, retain_graph=True)
    dh0_all, = torch.autograd.grad((o, ST), h0, (do, dht))
    gc = ops.chunk_local_cumsum(g, chunk_size=16, scale=ops.RCP_LN2)
    assert torch.allclose(gc[:, 16:32] / ops.RCP_LN2, g[:, 16:32].cumsum(1))
    for split in (16, one_split(T, 16)):
        hs, M = ops.chunk_fwd_h(k=k, v=v, gk=gc, h0=h0.detach(), output_final_state=True, chunk_size=16,
                                split_size=split, states_in_fp32=True)
        assert hs.shape == (B, -(-T // split), H, K, V)
        assert torch.allclose(M.double(), ST.detach(), rtol=1e-5, atol=1e-5)
        for dht_, want in ((None, dh0_o), (dht, dh0_all)):
            _, X = ops.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=M, dht=dht_, scale=scale, gk=gc, chunk_size=16,
                                    split_size=split)
            assert torch.allclose(X.double(), want.double(), rtol=1e-5, atol=1e-5)

    # the forward composition, W ranks simulated in turn, against one sequence
    W, B, Tl, H, K, V = 4, 2, 7, 3, 4, 5
    scale = K ** -0.5
    q, k = torch.randn(B, W * Tl, H, K, generator=gen), torch.randn(B, W * Tl, H, K, generator=gen)
    v = torch.randn(B, W * Tl, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, W * Tl, H, K, generator=gen) + 2)
    ref, _ = naive_gla(q, k, v, g, scale, None, torch)
    shards = [tuple(x[:, w * Tl:(w + 1) * Tl] for x in (q, k, v, g)) for w in range(W)]
    sends = []
    for (qs, ks, vs, gs) in shards:  # step 1 on every rank
        _, M = naive_gla(qs, ks, vs, gs, scale, None, torch)
        sends.append(pack_summary(M.float(), gate_sum(gs, torch), torch.empty(sum(summary_layout(B, H, K, V)))))
    gathered = torch.stack(sends)  # step 2
    outs, outs0 = [], []
    for r, (qs, ks, vs, gs) in enumerate(shards):  # steps 3 and 4 on every rank
        P = fold_prefix(*unpack_summaries(gathered, B, H, K, V), r, torch)
        outs.append(naive_gla(qs, ks, vs, gs, scale, P, torch)[0])
        outs0.append(naive_gla(qs, ks, vs, gs, scale, torch.zeros_like(P), torch)[0])
    got = torch.cat(outs, dim=1)
    err = ((got - ref).norm() / ref.norm()).item()
    err0 = ((torch.cat(outs0, dim=1) - ref).norm() / ref.norm()).item()
    assert err < 1e-6, err
    assert err0 > SENSITIVITY, err0
    print(f"gla_lasp2_peer self-test: ok (composition rel err {err:.1e}, without the prefix {err0:.2f})", flush=True)

    import tempfile

    import torch.multiprocessing as mp

    # the spawned processes import this file afresh: the environment makes them CPU dry runs
    os.environ["GLA_PEER_DEVICE"] = "cpu"
    for world in (2, 3):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(self_test_rank, args=(world, f"file://{tmp}/store"), nprocs=world)
    return 0


# the check's default shape for the states pass the GPU run uses (its sensitivities are the GPU
# check's), a smaller one for the other
SELF_TEST_CHECKS = (("chunk_fwd_h", (2, 1000, 4, 64)), ("chunk_gla", (1, 200, 2, 16)))


def self_test_rank(rank, world, init):
    """One rank of the distributed self-test: every check of SELF_TEST_CHECKS, forward and training
    step, with the stand-ins for fla; the errors well below the GPU's tolerances (the summaries
    travel in fp32); then the timing of one small shape, forward and training step."""
    import torch
    import torch.distributed as dist

    assert DEVICE == "cpu", DEVICE
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ops = default_ops()
    for states_kind, shape in SELF_TEST_CHECKS:
        for with_backward in (False, True):
            chk = check(shape, states_kind, with_backward, dist, torch, ops)
            errs = [chk["rel_err_vs_fla"], *chk.get("grad_rel_err_vs_fla", {}).values()]
            assert chk["ok"] and max(errs) < 1e-5, chk
            if rank == 0:
                print(f"gla_lasp2_peer self-test W={world}: ok {json.dumps(chk)}", flush=True)
    args = argparse.Namespace(states="chunk_fwd_h", with_backward=True, warmup=1, iters=2)
    row = measure((1, 40, 2, 8), args, dist, torch, ops)
    assert set(row["step_parts_ms"]) == {"forward", "dstates", "allgather", "fold", "backward"}, row
    assert len(row["step_per_rank_ms"]) == world and row["fla_peer_step_ms"] > 0, row
    if rank == 0:
        print(f"gla_lasp2_peer self-test W={world}: timing ok {json.dumps(row)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
