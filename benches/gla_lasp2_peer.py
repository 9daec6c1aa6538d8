"""LASP-2 for GLA (per-key gates) composed from fla's kernels and NCCL: the peer our layer is compared with.

    torchrun --standalone --nproc-per-node W benches/gla_lasp2_peer.py
    torchrun --standalone --nproc-per-node W benches/gla_lasp2_peer.py --shapes 4x8192,8x2048,4x4096 --out peer.json
    python3 benches/gla_lasp2_peer.py --self-test        # CPU only: the fold and the composition, no GPU, no fla

Each of the W ranks holds T_local consecutive tokens of every sequence (rank r holds tokens
[r * T_local, (r + 1) * T_local)) and computes its part of o = GLA(q, k, v, g) (fla's chunk_gla
semantics: S_t = diag(e^g_t) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t, g <= 0 per key) in four steps:

  1. states: the shard's summary from a zero state: M = its end state [B, H, Dk, Dv] fp32, from
     fla's states-only pass (chunk_local_cumsum of g in log2 units, then
     fla.ops.common.chunk_h.chunk_fwd_h with gk = that cumsum and one split per shard, so it stores
     no per-chunk states; --states chunk_gla takes M from chunk_gla(..., output_final_state=True)
     instead), and Λ = the sum of g over the shard per key dim [B, H, Dk] fp32; both packed in
     one fp32 buffer;
  2. all-gather: torch.distributed.all_gather_into_tensor of the packed (M, Λ) summaries (NCCL);
  3. fold: P = diag(e^Λ_w) P + M_w over the ranks w < me in rank order, from P = 0;
  4. forward: fla's chunk_gla(q, k, v, g, scale, initial_state=P) on the shard.

What is measured, per shape (B x T_local, H and D from --heads / --dim, Dk = Dv = D, bf16 q, k, v,
fp32 g = logsigmoid(N(0, 1)) / 16): the whole composition per call and each step alone, each as
--warmup untimed calls then --iters timed calls, every timed call after an on-stream barrier (a
one-element NCCL all-reduce the stream waits on) and between two CUDA events, the host
synchronising after each call (so the host's launch time shows where it exceeds the GPU's work,
as it would for a user of fla); per rank the median; each column of the row is its slowest rank
(so the parts need not add up to the whole), per_rank_ms keeps every rank's median of the whole
composition and parts_per_rank_ms every rank's median of each part.

Correctness, before timing: on --check-shape (B x T_local x H x D, default 2x1000x4x64, a shard
length that is not a multiple of fla's 64-token chunk, gates logsigmoid(N(0, 1) + 6) so that
earlier shards still matter), every rank runs the composition, the outputs are gathered and rank 0
compares their concatenation with fla's chunk_gla on the whole W * T_local sequence: relative
error (float64 norms) <= 5e-3. Also printed: the error with P = 0 (no earlier shards), which
must exceed 10 x 5e-3 when W > 1 for the check to mean something.

Output (rank 0, stdout): one JSON line for the check ({"check": ...}) and one per shape with W, B,
T_local, H, D, fla_peer_ms, states_ms, allgather_ms, fold_ms, forward_ms, per_rank_ms, states
(which states pass); --out FILE also writes them all as one JSON object (device, commit from env
LASP_COMMIT, date from env LASP_DATE, method, versions, check, rows).

Needs torch with CUDA and NCCL, and fla-core 0.6.0 (its wheel unpacked on PYTHONPATH, einops beside it).
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

TOL = 5e-3
SENSITIVITY = 10 * TOL
DEFAULT_SHAPES = "4x8192,1x32768,1x131072"
# A hook for a CPU dry run of the plumbing (gloo, torch.cuda's events and fla stubbed); leave it
# unset for measurements.
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


def gate_sum(g, torch):
    """Λ: the sum of the shard's log-gates over time, per key dim, fp32: [B, T, H, K] -> [B, H, K]."""
    return g.sum(dim=1, dtype=torch.float32)


def slowest(per_rank):
    return max(per_rank)


def naive_gla(q, k, v, g, scale, h0, torch):
    """Reference GLA recurrence in float64 (CPU self-test): returns (o [B, T, H, V], S_T [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, K, V, dtype=torch.float64) if h0 is None else h0.double().clone()
    q, k, v, g = (x.double() for x in (q, k, v, g))
    o = torch.empty(B, T, H, V, dtype=torch.float64)
    for t in range(T):
        S = torch.exp(g[:, t]).unsqueeze(-1) * S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


# ---------------------------------------------------------------------------------------------
# The composition, with fla and NCCL (GPU).
# ---------------------------------------------------------------------------------------------

def fla_chunk_size(T):
    # chunk_gla's own choice (fla/ops/gla/chunk.py, ChunkGLAFunction.forward)
    return min(64, max(16, 1 << max(0, (T - 1).bit_length())))


def make_states_fn(kind):
    """The states-only pass: (q, k, v, g) of a shard -> its end state from zero, fp32 [B, H, K, V]."""
    import torch
    from fla.ops.common.chunk_h import chunk_fwd_h
    from fla.ops.gla import chunk_gla
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    if kind == "chunk_fwd_h":
        def states(q, k, v, g, scale):
            T = k.shape[1]
            bt = fla_chunk_size(T)
            gc = chunk_local_cumsum(g, chunk_size=bt, scale=RCP_LN2)
            # one split per shard: the kernel stores only its (zero) starting state, not one per chunk
            split = math.ceil(T / bt) * bt
            _, M = chunk_fwd_h(k=k, v=v, gk=gc, h0=None, output_final_state=True, chunk_size=bt,
                               split_size=split)
            return M
    elif kind == "chunk_gla":
        def states(q, k, v, g, scale):
            with torch.no_grad():
                _, M = chunk_gla(q, k, v, g, scale=scale, output_final_state=True)
            return M
    else:
        raise ValueError(kind)
    return states


class Peer:
    """One rank's LASP-2 composition on its shard, with its buffers preallocated."""

    def __init__(self, q, k, v, g, scale, states_kind, dist, torch):
        from fla.ops.gla import chunk_gla

        self.q, self.k, self.v, self.g, self.scale = q, k, v, g, scale
        self.torch, self.dist, self.chunk_gla = torch, dist, chunk_gla
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        B, _, H, K = k.shape
        V = v.shape[-1]
        self.dims = (B, H, K, V)
        n = sum(summary_layout(B, H, K, V))
        self.send = torch.empty(n, device=k.device, dtype=torch.float32)
        # flat, so that every rank's part has the send buffer's shape (gloo insists; NCCL doesn't mind)
        self.recv_flat = torch.empty(self.world * n, device=k.device, dtype=torch.float32)
        self.recv = self.recv_flat.view(self.world, n)
        self.states_fn = make_states_fn(states_kind)
        self.P = None

    def states(self):
        M = self.states_fn(self.q, self.k, self.v, self.g, self.scale)
        pack_summary(M.float(), gate_sum(self.g, self.torch), self.send)

    def allgather(self):
        self.dist.all_gather_into_tensor(self.recv_flat, self.send)

    def fold(self):
        Mg, Lg = unpack_summaries(self.recv, *self.dims)
        self.P = fold_prefix(Mg, Lg, self.rank, self.torch)

    def forward(self, P=None):
        o, _ = self.chunk_gla(self.q, self.k, self.v, self.g, scale=self.scale,
                              initial_state=self.P if P is None else P, output_final_state=False)
        return o

    def __call__(self):
        self.states()
        self.allgather()
        self.fold()
        return self.forward()


def timed(fn, warmup, iters, dist, torch):
    """This rank's median ms of fn over `iters` calls, each after an on-stream barrier and between
    two CUDA events, the host synchronising after each."""
    token = torch.zeros(1, device=DEVICE)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        dist.all_reduce(token)  # the stream waits for every rank to get here
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def gather_floats(x, dist, torch):
    """Every rank's float x, on every rank, in rank order."""
    t = torch.tensor([float(x)], device=DEVICE, dtype=torch.float64)
    out = torch.empty(dist.get_world_size(), device=DEVICE, dtype=torch.float64)
    dist.all_gather_into_tensor(out, t)
    return out.tolist()


def inputs(B, T, H, D, seed, gate_shift, gate_div, torch):
    import torch.nn.functional as F

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rnd = lambda: torch.randn(B, T, H, D, device=DEVICE, generator=gen)  # noqa: E731
    q, k, v = (rnd().to(torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(rnd() + gate_shift) / gate_div
    return q, k, v, g


def check(shape, states_kind, dist, torch):
    """The composition against fla's chunk_gla on the whole sequence (rank 0); every rank returns
    the same dict."""
    from fla.ops.gla import chunk_gla

    B, Tl, H, D = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    scale = D ** -0.5
    # every rank draws the whole sequence with the same seed and keeps its shard
    q, k, v, g = inputs(B, world * Tl, H, D, 4321, 6.0, 1.0, torch)
    sl = slice(rank * Tl, (rank + 1) * Tl)
    peer = Peer(*(x[:, sl].contiguous() for x in (q, k, v, g)), scale, states_kind, dist, torch)
    with torch.no_grad():
        o = peer()
        o0 = peer.forward(torch.zeros_like(peer.P))
        outs = torch.empty(2, world * o.numel(), device=DEVICE, dtype=o.dtype)
        dist.all_gather_into_tensor(outs[0], o.reshape(-1))
        dist.all_gather_into_tensor(outs[1], o0.reshape(-1))
        outs = outs.view(2, world, *o.shape)
        res = torch.zeros(2, device=DEVICE, dtype=torch.float64)
        if rank == 0:
            ref, _ = chunk_gla(q, k, v, g, scale=scale, output_final_state=False)
            ref = ref.double()
            for i in range(2):
                got = torch.cat(list(outs[i].unbind(0)), dim=1).double()
                res[i] = (got - ref).norm() / ref.norm()
        dist.broadcast(res, 0)
    err, err0 = res.tolist()
    ok = math.isfinite(err) and err <= TOL
    sensitive = world == 1 or err0 > SENSITIVITY
    return dict(check=dict(W=world, B=B, T_local=Tl, H=H, D=D, states=states_kind),
                rel_err_vs_fla=float(f"{err:.4e}"), rel_err_without_prefix=float(f"{err0:.4e}"),
                tolerance=TOL, ok=bool(ok and sensitive),
                note=None if sensitive else f"P = 0 is within {SENSITIVITY}: the check cannot see the prefix")


def measure(shape, args, dist, torch):
    B, Tl, H, D = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, g = inputs(B, Tl, H, D, 1234 + rank, 0.0, 16.0, torch)
    peer = Peer(q, k, v, g, D ** -0.5, args.states, dist, torch)
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
    row["states"] = args.states
    row["summary_bytes_per_rank"] = 4 * sum(summary_layout(B, H, D, D))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help=f"comma-separated BxT_local (or BxT_localxHxD) per rank (default {DEFAULT_SHAPES})")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="Dk = Dv")
    ap.add_argument("--check-shape", default="2x1000x4x64", help="BxT_localxHxD of the correctness check")
    ap.add_argument("--states", choices=("chunk_fwd_h", "chunk_gla"), default="chunk_fwd_h",
                    help="fla function giving the shard's end state (default: the states-only chunk_fwd_h)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None, help="also write the rows and the check as one JSON file (rank 0)")
    ap.add_argument("--self-test", action="store_true", help="check the pure parts on CPU and exit")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    try:
        shapes = parse_shapes(args.shapes, args.heads, args.dim)
        [check_shape] = parse_shapes(args.check_shape, args.heads, args.dim)
    except ValueError as e:
        ap.error(str(e))
    if args.warmup < 0 or args.iters < 1:
        ap.error("--warmup must be >= 0 and --iters >= 1")

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("gla_lasp2_peer: torch sees no GPU: run this on the GPU node under torchrun", file=sys.stderr)
        return 1
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)

    failures = []
    t0 = time.time()
    # no try/except around the collectives: a rank that fails alone would leave the others waiting
    # in NCCL, while an exception ends this process and torchrun ends the rest
    chk = check(check_shape, args.states, dist, torch)
    say(json.dumps(chk))
    if not chk["ok"]:
        failures.append(f"check failed: {chk}")
    rows = []
    for shape in shapes:
        row = measure(shape, args, dist, torch)
        rows.append(row)
        torch.cuda.empty_cache()
        say(json.dumps(row))
    if rank == 0 and args.out:
        import fla
        import triton

        result = {
            "device": torch.cuda.get_device_name(),
            "commit": os.environ.get("LASP_COMMIT", "unknown"),
            "date": os.environ.get("LASP_DATE", "unknown"),
            "method": (f"fla + NCCL LASP-2 for GLA ({args.states} states pass, packed (M, Lambda) NCCL "
                       f"all_gather_into_tensor, fold in rank order, chunk_gla with initial_state); per rank "
                       f"{args.warmup} warm-up calls then the median of {args.iters} calls, each after an "
                       f"on-stream barrier, CUDA events, host sync after each; row = slowest rank; each part "
                       f"timed alone the same way"),
            "versions": {"torch": torch.__version__, "triton": triton.__version__,
                         "fla": getattr(fla, "__version__", "unknown")},
            "check": chk,
            "errors": failures,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
        say(f"gla_lasp2_peer: wrote {args.out} ({time.time() - t0:.0f} s)")
    if failures and rank == 0:
        print("gla_lasp2_peer: FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    # every rank waits for rank 0's output: torchrun ends the others when one exits non-zero
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


def self_test():
    """CPU checks: shapes, packing, the fold against a naive loop, and the whole composition (with a
    float64 recurrence standing in for fla and a stack for the all-gather) against one sequence."""
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
    # the fold against a naive element-by-element loop
    for r in range(W):
        P = fold_prefix(Mu, Lu, r, torch).double()
        want = torch.zeros(B, H, K, V, dtype=torch.float64)
        for w in range(r):
            for b in range(B):
                for h in range(H):
                    for i in range(K):
                        want[b, h, i] = math.exp(Lg[w, b, h, i].item()) * want[b, h, i] + Mg[w, b, h, i].double()
        assert torch.allclose(P, want, rtol=1e-5, atol=1e-5), (r, (P - want).abs().max())
    assert torch.equal(fold_prefix(Mu, Lu, 0, torch), torch.zeros(B, H, K, V))

    # the whole composition, W ranks simulated in turn, against one sequence
    import torch.nn.functional as F

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
    print(f"gla_lasp2_peer self-test: ok (composition rel err {err:.1e}, without the prefix {err0:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
