"""Gated DeltaNet forward with fla's own context parallelism, on the shards our LASP-2 layer gets: the peer
our GDN LASP-2 forward is compared with.

    torchrun --standalone --nproc-per-node W benches/gated_delta_cp_peer.py
    torchrun --standalone --nproc-per-node W benches/gated_delta_cp_peer.py --shapes 4x8192,8x2048 --out peer.json
    python3 benches/gated_delta_cp_peer.py --self-test    # CPU only, no GPU, no fla (gloo for W = 2, 3)

The layer is o = GDN(q, k, v, g, beta) in fla's chunk_gated_delta_rule semantics (row vectors: k_t is
[K], the state S is [K, V]): S_t = e^g_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,
o_t = scale q_t S_t, with g <= 0 and beta in (0, 1) per token and head, scale = K^-0.5.

The mapping. Each of our W ranks holds T_local consecutive tokens of every one of the B sequences
(rank r holds tokens [r * T_local, (r + 1) * T_local)): q, k, v [B, T_local, H, D], g, beta
[B, T_local, H]. fla's context parallelism (fla.ops.cp.build_cp_context, layout 'contiguous')
instead splits one packed variable-length stream (B = 1, global cu_seqlens) into W equal
contiguous parts: with our B sequences packed one after another it would hand whole sequences to
ranks and exchange nothing. Sequences and heads are independent in GDN, so B sequences of H heads
are one sequence of B * H heads: x[b, t, h] -> x'[0, t, b * H + h] (q, k, v:
x.permute(1, 0, 2, 3).reshape(1, T_local, B * H, D); g, beta: x.permute(1, 0, 2).reshape(1, T_local,
B * H)). With the global cu_seqlens = [0, W * T_local], rank r's part of that stream is exactly its
shard, and its output maps back by the inverse, o'[0, t, b * H + h] -> o[b, t, h]. The permute
copies are made before timing: they are data preparation that a trainer using fla's context
parallelism would arrange in its own layout, not part of the layer.

fla's CP forward (fla-core 0.6.0: fla.ops.gated_delta_rule.chunk, fla.ops.cp): given cp_context,
chunk_gated_delta_rule takes the rank's part (B must be 1) with cu_seqlens = context.cu_seqlens and
cu_seqlens_cpu = context.cu_seqlens_cpu (so that it finds its chunk indices without a device-to-host
copy), and no initial state or final state. After its chunk-local WY pass, every rank but the last
computes the affine summary of its part, S_out = A S_in + b (chunk_cp_fwd_h; A [B * H, K, K] and
b [B * H, K, V], packed in one fp32 buffer [B * H, K, V + K], left zero on the last rank); the
buffers are all-gathered over the context's group by torch.distributed.all_gather_into_tensor
(NCCL, launched from the host, into a new [W, B * H, K, V + K] tensor per call); every rank but the
first folds the summaries of the ranks before it into its initial state in one kernel
(chunk_cp_merge, TF32x3 dots); then the states pass and the output from that state. The first and
the last rank thus do less work than the others: the row takes the slowest rank.

What is measured, per shape (B x T_local; H and D from --heads / --dim, K = V = D; bf16 q and k
drawn N(0, 1) and L2-normalised over D in fp32, bf16 v = N(0, 1), fp32 g = logsigmoid(N(0, 1)) / 16,
fp32 beta = sigmoid(N(0, 1)); every rank its own draw), on the rank's mapped shard:
  fla_cp_ms       the CP call as a whole (the context is built once, before timing);
  fla_no_comm_ms  the same call without cp_context (same cu_seqlens, zero initial state): fla's
                  compute on the shard alone, for context; its output is not the layer's when W > 1.
Each is --warmup untimed calls, then --iters timed calls by gla_lasp2_peer.timed: every timed call
after an on-stream barrier (a one-element all-reduce the stream waits on) and between two CUDA
events, the host synchronising after each call; per rank the median; each column is its slowest
rank; per_rank_ms keeps every rank's median of fla_cp_ms, no_comm_per_rank_ms of fla_no_comm_ms.
fla 0.6.0 would route calls without cp_context to its FlashQLA backend when the flash_qla package is
installed, while the CP call always takes fla's Triton kernels; so that fla_no_comm_ms times the
same kernels, this script sets FLA_FLASH_QLA=0 unless the environment sets it (versions records it).

Correctness, before timing: on --check-shape (B x T_local x H x D, default 2x1000x4x64, a shard
length that is not a multiple of fla's 64-token chunk; g = logsigmoid(N(0, 1) + 6) so that earlier
shards still matter, beta = sigmoid(N(0, 1))), every rank draws the whole sequences with the same
seed, keeps its shard, maps it, runs fla's CP forward and maps the output back; the outputs are
gathered along time and rank 0 compares them with fla's single-GPU chunk_gated_delta_rule on the
whole B sequences of W * T_local tokens: relative error (float64 norms) <= 5e-3. Also reported:
the error of the shard computed without the exchange (the call without cp_context, from a zero
state), which must exceed 10 x 5e-3 when W > 1 for the check to see the exchange. Rank 0
broadcasts both errors, so that every rank reaches the same verdict.

Output (rank 0, stdout): one JSON line for the check ({"check": {W, B, T_local, H, D},
rel_err_vs_fla, rel_err_without_exchange, tolerance, ok, note}) and one per shape with W, B,
T_local, H, D, fla_cp_ms, fla_no_comm_ms, per_rank_ms, no_comm_per_rank_ms and
summary_bytes_per_rank (4 * B * H * K * (K + V): A and b in fp32, the buffer fla all-gathers from
each rank, as it is laid out in fla's source); --out FILE also writes them all as one JSON object
(device, commit from env LASP_COMMIT, date from env LASP_DATE, method, versions, check, errors,
rows).

--self-test runs on the CPU without fla: gloo ranks at W = 2 and 3 with float64 stand-ins for fla's
chunk_gated_delta_rule (the recurrence above) and for its CP mode (all-gather the shards, run the
recurrence on the whole stream, return this rank's part). It checks this script's plumbing (the
mapping into heads and back, the shard slicing, the gather and the comparison, the row's fields),
including that the check fails with a deliberately wrong mapping or shard; it cannot check fla.

Needs torch with CUDA and NCCL, and fla-core 0.6.0 (its wheel unpacked on PYTHONPATH, einops
beside it). Time: on a node whose Triton cache is empty, fla autotunes each of its kernels once,
about 40 s per kernel on an H100 node; see the "Time:" paragraph of gla_lasp2_peer.py's docstring
(a TRITON_CACHE_DIR kept from an earlier run on the same GPU model, Triton and fla avoids it).
Exit status: 0 when the check passed and every shape ran; 1 when the check failed or a rank raised
(torchrun then ends the others); 2 for bad arguments.
"""
import argparse
import json
import math
import os
import sys
import types
from pathlib import Path

# benches/ is not a package: the GLA peer's helpers (shapes, timing, gathers) are imported from it
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gla_lasp2_peer as peer  # noqa: E402

TOL = peer.TOL
SENSITIVITY = peer.SENSITIVITY
DEFAULT_SHAPES = "4x8192,1x32768,8x2048,4x4096"
# The CPU dry-run hook is the GLA peer's (env GLA_PEER_DEVICE), so that its timed() and gathers,
# which read their module's DEVICE, run on the same device as this script.
DEVICE = peer.DEVICE


# ---------------------------------------------------------------------------------------------
# Pure parts: checked by --self-test on CPU.
# ---------------------------------------------------------------------------------------------

def to_heads(x):
    """Our shard [B, T, H, ...] -> fla's one stream of B * H heads [1, T, B * H, ...]:
    x[b, t, h] -> x'[0, t, b * H + h]."""
    B, T, H = x.shape[:3]
    return x.transpose(0, 1).reshape(1, T, B * H, *x.shape[3:]).contiguous()


def from_heads(y, B):
    """The inverse of to_heads: [1, T, B * H, ...] -> [B, T, H, ...]."""
    _, T, BH = y.shape[:3]
    assert BH % B == 0, (y.shape, B)
    return y.reshape(T, B, BH // B, *y.shape[3:]).transpose(0, 1).contiguous()


def own_shard(rank, world):
    return rank


# How a rank cuts and maps its part; the self-test swaps in wrong ones to see the check fail.
MAPPING = types.SimpleNamespace(to_heads=to_heads, from_heads=from_heads, shard=own_shard)


def summary_bytes(B, H, K, V):
    """fla's per-rank affine summary: A [B * H, K, K] and b [B * H, K, V], fp32."""
    return 4 * B * H * K * (K + V)


def naive_gdn(q, k, v, g, beta, scale, h0, torch):
    """The GDN recurrence in float64 (CPU self-test): q, k [B, T, H, K], v [B, T, H, V], g, beta
    [B, T, H], h0 [B, H, K, V] or None -> (o [B, T, H, V], S_T [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, K, V, dtype=torch.float64) if h0 is None else h0.double().clone()
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, dtype=torch.float64)
    for t in range(T):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        # (I - beta k^T k) S = S - beta k^T (k S): rank-one updates, no K x K matrix
        kS = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = torch.exp(g[:, t])[..., None, None] * (S - bt * kt[..., None] * kS[..., None, :])
        S = S + bt * kt[..., None] * v[:, t, :, None, :]
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


def naive_gdn_varlen(q, k, v, g, beta, scale, cu_seqlens, torch):
    """naive_gdn on a packed stream [1, T, ...] of the sequences cu_seqlens delimits, each from zero."""
    o = torch.empty(*v.shape, dtype=torch.float64)
    bounds = [int(x) for x in cu_seqlens]
    for s, e in zip(bounds[:-1], bounds[1:]):
        o[:, s:e] = naive_gdn(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale, None, torch)[0]
    return o


def reference_ops(torch):
    """float64 CPU stand-ins for fla's chunk_gated_delta_rule and build_cp_context, with the
    signatures and the calling contract this script relies on (B = 1 with cu_seqlens; no initial
    or final state under cp_context). The CP mode all-gathers every rank's part of the stream over
    the group, runs the recurrence on the whole stream and returns this rank's part."""
    import torch.distributed as dist

    def build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, cu_seqlens_cpu=None,
                         layout="contiguous", **kwargs):
        assert layout == "contiguous" and group is not None and not kwargs
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        cu = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).cpu().long()
        total = int(cu[-1])
        if total < world or total % world:
            raise ValueError(f"total_tokens ({total}) must be a positive multiple of world_size ({world})")
        part = total // world
        start, end = rank * part, (rank + 1) * part
        local = (cu.clamp(min=start, max=end) - start).unique_consecutive().to(torch.int32)
        return types.SimpleNamespace(group=group, cu_seqlens=local, cu_seqlens_cpu=local, global_cu=cu,
                                     rank=rank, world=world, part_len=part)

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               cp_context=None, **kwargs):
        assert not use_qk_l2norm_in_kernel and not kwargs
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if cp_context is not None:
            assert initial_state is None and not output_final_state, "not supported for CP"
            cu_seqlens = cp_context.cu_seqlens
        if cu_seqlens is not None:
            assert q.shape[0] == 1, "B must be 1 with cu_seqlens"
            assert int(cu_seqlens[-1]) == q.shape[1], (cu_seqlens, q.shape)
        if cp_context is None:
            if cu_seqlens is None:
                o, S = naive_gdn(q, k, v, g, beta, scale, initial_state, torch)
                return o.to(q.dtype), S.float() if output_final_state else None
            assert initial_state is None and not output_final_state
            return naive_gdn_varlen(q, k, v, g, beta, scale, cu_seqlens, torch).to(q.dtype), None
        c = cp_context
        assert q.shape[1] == c.part_len, (q.shape, c.part_len)
        assert dist.get_world_size(c.group) == dist.get_world_size(), "the stand-in gathers over the default group"
        whole = [peer.gather_sequence(x, dist, torch) for x in (q, k, v, g, beta)]
        o = naive_gdn_varlen(*whole, scale, c.global_cu, torch)
        return o[:, c.rank * c.part_len:(c.rank + 1) * c.part_len].to(q.dtype).contiguous(), None

    return types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule, build_cp_context=build_cp_context,
                                 qkv_dtype=torch.float64, gate_dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# fla's CP forward on a rank's mapped shard (GPU).
# ---------------------------------------------------------------------------------------------

def fla_ops():
    """fla's entry points and the dtypes fed to them (imported here: the self-test runs without fla)."""
    # see the docstring: keeps calls without cp_context on the Triton kernels the CP call uses
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    import torch
    from fla.ops.cp import build_cp_context
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule, build_cp_context=build_cp_context,
                                 qkv_dtype=torch.bfloat16, gate_dtype=torch.float32)


def default_ops():
    import torch

    return fla_ops() if DEVICE == "cuda" else reference_ops(torch)


class CPForward:
    """fla's CP forward of one rank's part of the stream of B * H heads (q, k, v [1, T_local, B * H, D],
    g, beta [1, T_local, B * H]); the context is built once, from the global cu_seqlens [0, W * T_local].
    group: the process group of the W ranks (None: the default group)."""

    def __init__(self, q, k, v, g, beta, scale, dist, torch, ops, group=None):
        assert q.shape[0] == 1, "fla's CP takes one packed stream"
        self.args, self.scale, self.ops = (q, k, v, g, beta), scale, ops
        total = dist.get_world_size(group) * q.shape[1]
        cu = torch.tensor([0, total], dtype=torch.long, device=q.device)
        # fla's CP mode does nothing without a group object (context.group None means no CP)
        self.context = ops.build_cp_context(cu, group=dist.group.WORLD if group is None else group,
                                            cu_seqlens_cpu=torch.tensor([0, total], dtype=torch.long))
        assert int(self.context.cu_seqlens_cpu[-1]) == q.shape[1], self.context.cu_seqlens_cpu

    def __call__(self):
        c = self.context
        o, _ = self.ops.chunk_gated_delta_rule(*self.args, scale=self.scale, cu_seqlens=c.cu_seqlens,
                                               cu_seqlens_cpu=c.cu_seqlens_cpu, cp_context=c)
        return o

    def no_comm(self):
        """The same call without the exchange: the shard alone from a zero state."""
        c = self.context
        o, _ = self.ops.chunk_gated_delta_rule(*self.args, scale=self.scale, cu_seqlens=c.cu_seqlens,
                                               cu_seqlens_cpu=c.cu_seqlens_cpu)
        return o


def inputs(B, T, H, D, seed, gate_shift, gate_div, torch, ops):
    """q, k (L2-normalised over D in fp32), v [B, T, H, D]; g, beta [B, T, H]."""
    import torch.nn.functional as F

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device=DEVICE, generator=gen)  # noqa: E731
    q, k = (F.normalize(rnd(B, T, H, D), p=2, dim=-1).to(ops.qkv_dtype) for _ in range(2))
    v = rnd(B, T, H, D).to(ops.qkv_dtype)
    g = (F.logsigmoid(rnd(B, T, H) + gate_shift) / gate_div).to(ops.gate_dtype)
    beta = torch.sigmoid(rnd(B, T, H)).to(ops.gate_dtype)
    return q, k, v, g, beta


def check(shape, dist, torch, ops, mapping=MAPPING):
    """fla's CP forward of every rank's mapped shard, mapped back and gathered, against fla's
    single-GPU forward of the whole sequences (rank 0); every rank returns the same dict."""
    B, Tl, H, D = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    scale = D ** -0.5
    # every rank draws the whole sequences with the same seed and keeps its shard
    whole = inputs(B, world * Tl, H, D, 4321, 6.0, 1.0, torch, ops)
    r = mapping.shard(rank, world)
    sl = slice(r * Tl, (r + 1) * Tl)
    cp = CPForward(*(mapping.to_heads(x[:, sl]) for x in whole), scale, dist, torch, ops)
    with torch.no_grad():
        o = mapping.from_heads(cp(), B)
        o0 = mapping.from_heads(cp.no_comm(), B)
        got = [peer.gather_sequence(x, dist, torch) for x in (o, o0)]
        res = torch.zeros(2, device=DEVICE, dtype=torch.float64)
        if rank == 0:
            ref, _ = ops.chunk_gated_delta_rule(*whole, scale=scale, output_final_state=False)
            res[0], res[1] = peer.rel_err(got[0], ref), peer.rel_err(got[1], ref)
    dist.broadcast(res, 0)
    err, err0 = res.tolist()
    ok = math.isfinite(err) and err <= TOL
    sensitive = world == 1 or err0 > SENSITIVITY
    note = None if sensitive else f"the shard without the exchange is within {SENSITIVITY}: the check cannot see it"
    return dict(check=dict(W=world, B=B, T_local=Tl, H=H, D=D), rel_err_vs_fla=float(f"{err:.4e}"),
                rel_err_without_exchange=float(f"{err0:.4e}"), tolerance=TOL, ok=bool(ok and sensitive), note=note)


def measure(shape, args, dist, torch, ops):
    B, Tl, H, D = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    # the mapping's copies happen here, outside the timing (see the docstring)
    mapped = [to_heads(x) for x in inputs(B, Tl, H, D, 1234 + rank, 0.0, 16.0, torch, ops)]
    cp = CPForward(*mapped, D ** -0.5, dist, torch, ops)
    with torch.no_grad():
        cp()  # compile / autotune
        cp.no_comm()
        t = {name: peer.timed(fn, args.warmup, args.iters, dist, torch)
             for name, fn in (("fla_cp_ms", cp), ("fla_no_comm_ms", cp.no_comm))}
    per_rank = {name: peer.gather_floats(ms, dist, torch) for name, ms in t.items()}
    row = dict(W=world, B=B, T_local=Tl, H=H, D=D)
    row.update({name: round(peer.slowest(ms), 5) for name, ms in per_rank.items()})
    row["per_rank_ms"] = [round(x, 5) for x in per_rank["fla_cp_ms"]]
    row["no_comm_per_rank_ms"] = [round(x, 5) for x in per_rank["fla_no_comm_ms"]]
    row["summary_bytes_per_rank"] = summary_bytes(B, H, D, D)
    return row


def main(argv=None):
    ap = peer.run_arguments(__doc__, DEFAULT_SHAPES, "K = V",
                            "check the mapping and, under gloo with W = 2 and 3, the check and timing on CPU, then exit")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    method = (f"fla's context parallelism for Gated DeltaNet (build_cp_context, layout contiguous, on "
              f"one stream of B*H heads from global cu_seqlens [0, W*T_local]; chunk_gated_delta_rule "
              f"with cp_context: affine summaries A, b all-gathered by NCCL, merged, then the shard's "
              f"forward), on each rank's mapped shard, the mapping's copies outside the timing; "
              f"fla_no_comm_ms the same call without cp_context; per rank {args.warmup} warm-up calls "
              f"then the median of {args.iters} calls, each after an on-stream barrier, CUDA events, "
              f"host sync after each; row = slowest rank.")
    return peer.run_ranks("gated_delta_cp_peer", ap, args, method, default_ops, versions,
                          check, measure)


def versions(torch):
    if DEVICE != "cuda":
        return {"torch": torch.__version__}
    import importlib.util

    import fla
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "fla": getattr(fla, "__version__", "unknown"),
            "flash_qla_installed": importlib.util.find_spec("flash_qla") is not None,
            "FLA_FLASH_QLA": os.environ.get("FLA_FLASH_QLA")}


def self_test():
    """CPU checks: the mapping into heads and back, the stand-in recurrence against the dense
    matrix form; then, under gloo in W = 2 and W = 3 processes with the stand-ins for fla, the check
    (which must pass, and fail with a wrong mapping or shard) and the timing of one small shape."""
    import torch

    assert peer.parse_shapes(DEFAULT_SHAPES, 16, 128) == [(4, 8192, 16, 128), (1, 32768, 16, 128),
                                                           (8, 2048, 16, 128), (4, 4096, 16, 128)]
    assert summary_bytes(4, 16, 128, 128) == 4 * 64 * 128 * 256

    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 3, 5, 4, 2
    x4, x3 = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, generator=gen)
    for x in (x4, x3):
        y = to_heads(x)
        assert y.shape == (1, T, B * H, *x.shape[3:]) and y.is_contiguous()
        for b in range(B):
            for t in range(T):
                for h in range(H):
                    assert torch.equal(y[0, t, b * H + h], x[b, t, h])
        assert torch.equal(from_heads(y, B), x)
        assert torch.equal(y, x.permute(1, 0, *range(2, x.dim())).reshape(1, T, B * H, *x.shape[3:]))

    # the stand-in recurrence against the dense matrix form, one (b, h) at a time
    import torch.nn.functional as F

    B, T, H, K, V = 2, 9, 3, 4, 5
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    o, ST = naive_gdn(q, k, v, g, beta, 0.7, h0, torch)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = h0[b, h]
            for t in range(T):
                kt, bt = k[b, t, h][None], beta[b, t, h]  # kt: a row vector [1, K]
                S = math.exp(g[b, t, h]) * (eye - bt * kt.T @ kt) @ S + bt * kt.T @ v[b, t, h][None]
                assert torch.allclose(o[b, t, h], 0.7 * (q[b, t, h][None] @ S)[0], rtol=1e-12, atol=1e-12)
            assert torch.allclose(ST[b, h], S, rtol=1e-12, atol=1e-12)
    # packed sequences are independent: the varlen stand-in on a packed stream = each sequence alone
    cu = torch.tensor([0, 4, T])
    o_var = naive_gdn_varlen(*(x[:1] for x in (q, k, v, g, beta)), 0.7, cu, torch)
    for s, e in ((0, 4), (4, T)):
        want, _ = naive_gdn(*(x[:1, s:e] for x in (q, k, v, g, beta)), 0.7, None, torch)
        assert torch.allclose(o_var[:, s:e], want, rtol=1e-12, atol=1e-12)
    print("gated_delta_cp_peer self-test: ok (mapping round trip and index order; stand-in recurrence "
          "against the dense matrix form; varlen sequences independent)", flush=True)

    import tempfile

    import torch.multiprocessing as mp

    # the spawned processes import this file (and the GLA peer) afresh: the environment makes them CPU dry runs
    os.environ["GLA_PEER_DEVICE"] = "cpu"
    for world in (2, 3):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(self_test_rank, args=(world, f"file://{tmp}/store"), nprocs=world)
    return 0


def heads_h_major(x):
    """A wrong mapping into heads (h * B + b order), for the self-test's negative case."""
    B, T, H = x.shape[:3]
    return x.permute(1, 2, 0, *range(3, x.dim())).reshape(1, T, H * B, *x.shape[3:]).contiguous()


WRONG_MAPPINGS = {
    "heads in h*B+b order, back in b*H+h order": types.SimpleNamespace(to_heads=heads_h_major,
                                                                      from_heads=from_heads, shard=own_shard),
    "the next rank's shard": types.SimpleNamespace(to_heads=to_heads, from_heads=from_heads,
                                                   shard=lambda rank, world: (rank + 1) % world),
}


def self_test_rank(rank, world, init):
    """One rank of the distributed self-test: the check at the default check shape with the
    stand-ins (error well below the tolerance, the exchange visible), the check with each wrong
    mapping (must fail on every rank), then the timing of one small shape."""
    import torch
    import torch.distributed as dist

    assert DEVICE == "cpu" and peer.DEVICE == "cpu", (DEVICE, peer.DEVICE)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ops = default_ops()
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    chk = check((2, 1000, 4, 64), dist, torch, ops)
    assert chk["ok"] and chk["rel_err_vs_fla"] < 1e-10 and chk["rel_err_without_exchange"] > SENSITIVITY, chk
    say(f"gated_delta_cp_peer self-test W={world}: check ok {json.dumps(chk)}")
    for what, mapping in WRONG_MAPPINGS.items():
        bad = check((2, 100, 3, 8), dist, torch, ops, mapping=mapping)
        assert not bad["ok"] and bad["rel_err_vs_fla"] > SENSITIVITY, (what, bad)
        say(f"gated_delta_cp_peer self-test W={world}: check fails with {what} as it must "
            f"(rel err {bad['rel_err_vs_fla']:.3f})")
    args = argparse.Namespace(warmup=1, iters=2)
    row = measure((2, 24, 3, 8), args, dist, torch, ops)
    assert set(row) == {"W", "B", "T_local", "H", "D", "fla_cp_ms", "fla_no_comm_ms", "per_rank_ms",
                        "no_comm_per_rank_ms", "summary_bytes_per_rank"}, row
    assert (row["W"], row["B"], row["T_local"], row["H"], row["D"]) == (world, 2, 24, 3, 8), row
    assert len(row["per_rank_ms"]) == len(row["no_comm_per_rank_ms"]) == world, row
    assert row["fla_cp_ms"] == max(row["per_rank_ms"]) > 0 and row["fla_no_comm_ms"] > 0, row
    assert row["summary_bytes_per_rank"] == 4 * 2 * 3 * 8 * 16, row
    say(f"gated_delta_cp_peer self-test W={world}: timing ok {json.dumps(row)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
