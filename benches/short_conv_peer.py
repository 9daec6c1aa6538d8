"""The short convolution with fla's own context parallelism, on the shards our ShortConv gets: the
peer of our halo exchange (examples/src/bin/short_conv.rs).

    torchrun --standalone --nproc-per-node W benches/short_conv_peer.py
    torchrun --standalone --nproc-per-node W benches/short_conv_peer.py --shapes 4x8192,1x32768 --out peer.json
    python3 benches/short_conv_peer.py --self-test    # CPU only, no GPU, no fla (gloo for W = 2, 3)

The layer is y = act(bias + sum_i w[c, i] x_{t-K+1+i}) per channel (fla's causal_conv1d, SiLU, with a
bias, K = --kernel-size, C = H x D channels from --heads and --dim), and its backward.

The mapping. Each of our W ranks holds T_local consecutive tokens of every one of the B sequences:
x [B, T_local, C]. fla's context parallelism (fla.ops.cp.build_cp_context, layout 'contiguous')
splits one packed stream (B = 1) into W equal parts. Channels are independent in the convolution, so
B sequences of C channels are one sequence of B x C channels: x[b, t, c] -> x'[0, t, b * C + c], the
weight and bias repeated B times. With the global cu_seqlens [0, W * T_local], rank r's part of that
stream is exactly its shard. The copies are made before timing.

fla's CP convolution (fla-core 0.6.0, fla.modules.causal_conv1d.cp): every rank but the first gets
the K - 1 tokens before its part from the rank before it over torch.distributed (NCCL, from the
host) as its initial state, convolves, and in the backward sends the gradient of those tokens back.

What is measured, per shape (B x T_local; bf16 x and dy ~ N(0, 1), fp32 weight ~ N(0, 0.25) and
bias ~ N(0, 0.04); every rank its own draw):
  fla_cp_fwd_ms         the CP forward (no autograd graph);
  fla_cp_fwdbwd_ms      the CP forward and backward (x, weight and bias requiring gradients);
  fla_no_comm_fwd_ms, fla_no_comm_fwdbwd_ms  the same calls without cp_context: fla's convolution of
                        the shard alone, the compute our halo exchange must hide.
Each is --warmup untimed calls, then --iters timed calls by gla_lasp2_peer.timed (an on-stream
barrier before each, CUDA events around it, the host synchronising after it); per rank the median;
each column is its slowest rank.

Correctness, before timing: on --check-shape (B x T_local, C = H x D), every rank draws the whole
sequences with the same seed, keeps its shard, maps it, runs fla's CP forward and backward and maps
y and dx back; the shards are gathered along time and rank 0 compares them with fla's single-GPU
causal_conv1d of the whole sequences (relative error <= 5e-3 each). Also reported: the error of the
shard convolved without the exchange, which must exceed 10 x 5e-3 when W > 1 for the check to see
the halo (the check's shards are short for that: 8 tokens of each sequence).

Output (rank 0, stdout): one JSON line for the check and one per shape (W, B, T_local, C, K, the
four columns, per_rank_fwd_ms); --out FILE also writes them all as one JSON object (device, commit
from env LASP_COMMIT, date from env LASP_DATE, method, versions, check, errors, rows).

--self-test runs on the CPU without fla: gloo ranks at W = 2 and 3 with float64 stand-ins for
causal_conv1d (torch's conv1d) and its CP mode (all-gather the shards, convolve the whole stream,
keep this rank's part), checking this script's plumbing, including that the check fails with a
wrong mapping. Needs torch with CUDA and NCCL, and fla-core 0.6.0 on PYTHONPATH with einops.
Exit status: 0 when the check passed and every shape ran; 1 otherwise; 2 for bad arguments.
"""
import argparse
import json
import math
import os
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gla_lasp2_peer as peer  # noqa: E402

TOL = peer.TOL
SENSITIVITY = peer.SENSITIVITY
DEFAULT_SHAPES = "4x8192,1x32768,8x2048"
DEVICE = peer.DEVICE


def to_channels(x):
    """[B, T, C] -> [1, T, B * C] (sequence b's channel c at b * C + c)."""
    B, T, C = x.shape
    return x.permute(1, 0, 2).reshape(1, T, B * C).contiguous()


def from_channels(y, B):
    """The inverse of to_channels."""
    _, T, BC = y.shape
    return y.reshape(T, B, BC // B).permute(1, 0, 2).contiguous()


def own_shard(rank, world):
    return rank


MAPPING = types.SimpleNamespace(to_channels=to_channels, from_channels=from_channels, shard=own_shard)


def reference_ops(torch):
    """float64 CPU stand-ins for fla's causal_conv1d and build_cp_context."""
    import torch.nn.functional as F

    def conv(x, weight, bias, activation):
        K = weight.shape[-1]
        z = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), weight[:, None, :], bias, groups=weight.shape[0])
        z = z.transpose(1, 2)
        return z * torch.sigmoid(z) if activation == "silu" else z

    def build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, cu_seqlens_cpu=None, **kwargs):
        return types.SimpleNamespace(group=group)

    import torch.distributed as dist

    class WholeStream(torch.autograd.Function):
        """Every rank's part along time; backward: the sum of every rank's gradient, this part of it."""

        @staticmethod
        def forward(ctx, x):
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, x.contiguous())
            return torch.cat(parts, dim=1)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad)
            T = grad.shape[1] // dist.get_world_size()
            return grad[:, dist.get_rank() * T:(dist.get_rank() + 1) * T]

    def causal_conv1d(x, weight=None, bias=None, activation=None, cp_context=None, **kwargs):
        if cp_context is None:
            return conv(x, weight, bias, activation), None
        rank, T = dist.get_rank(), x.shape[1]
        y = conv(WholeStream.apply(x), weight, bias, activation)
        return y[:, rank * T:(rank + 1) * T], None

    return types.SimpleNamespace(causal_conv1d=causal_conv1d, build_cp_context=build_cp_context,
                                 x_dtype=torch.float64, w_dtype=torch.float64)


def fla_ops():
    import torch
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.cp import build_cp_context

    return types.SimpleNamespace(causal_conv1d=causal_conv1d, build_cp_context=build_cp_context,
                                 x_dtype=torch.bfloat16, w_dtype=torch.float32)


def default_ops():
    import torch

    return fla_ops() if DEVICE == "cuda" else reference_ops(torch)


class Conv:
    """fla's convolution of one rank's mapped shard x [1, T_local, B * C], with and without its CP
    context (built once, from the global cu_seqlens [0, W * T_local])."""

    def __init__(self, x, weight, bias, dist, torch, ops):
        self.x, self.weight, self.bias, self.ops = x, weight, bias, ops
        total = dist.get_world_size() * x.shape[1]
        self.context = ops.build_cp_context(torch.tensor([0, total], dtype=torch.long, device=x.device),
                                            group=dist.group.WORLD, conv1d_kernel_size=weight.shape[-1],
                                            cu_seqlens_cpu=torch.tensor([0, total], dtype=torch.long))

    def forward(self, x=None, cp=True):
        y, _ = self.ops.causal_conv1d(self.x if x is None else x, self.weight, self.bias, activation="silu",
                                      cp_context=self.context if cp else None)
        return y

    def forward_backward(self, dy, cp=True):
        """y and dx of a call with x, weight and bias requiring gradients."""
        x = self.x.detach().requires_grad_(True)
        for p in (self.weight, self.bias):
            p.requires_grad_(True)
            p.grad = None
        y = self.forward(x, cp)
        y.backward(dy)
        return y, x.grad


def inputs(B, T, C, K, seed, torch, ops):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device=DEVICE, generator=gen)  # noqa: E731
    x, dy = rnd(B, T, C).to(ops.x_dtype), rnd(B, T, C).to(ops.x_dtype)
    weight, bias = (rnd(C, K) * 0.5).to(ops.w_dtype), (rnd(C) * 0.2).to(ops.w_dtype)
    return x, dy, weight, bias


def mapped_conv(x, dy, weight, bias, B, dist, torch, ops, mapping):
    repeat = lambda p: p.repeat(B, *([1] * (p.dim() - 1))).contiguous()  # noqa: E731
    conv = Conv(mapping.to_channels(x), repeat(weight), repeat(bias), dist, torch, ops)
    return conv, mapping.to_channels(dy)


def check(shape, kernel_size, dist, torch, ops, mapping=MAPPING):
    """fla's CP forward and backward of every rank's mapped shard, mapped back and gathered, against
    fla's single-GPU convolution of the whole sequences (rank 0); every rank returns the same dict."""
    B, Tl, C = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    x, dy, weight, bias = inputs(B, world * Tl, C, kernel_size, 4321, torch, ops)
    r = mapping.shard(rank, world)
    sl = slice(r * Tl, (r + 1) * Tl)
    conv, dy_mapped = mapped_conv(x[:, sl], dy[:, sl], weight, bias, B, dist, torch, ops, mapping)
    y, dx = (mapping.from_channels(t.detach(), B) for t in conv.forward_backward(dy_mapped))
    with torch.no_grad():
        y0 = mapping.from_channels(conv.forward(cp=False), B)
    got = [peer.gather_sequence(t, dist, torch) for t in (y, dx, y0)]
    res = torch.zeros(3, device=DEVICE, dtype=torch.float64)
    if rank == 0:
        whole = x.detach().requires_grad_(True)
        y_ref, _ = ops.causal_conv1d(whole, weight, bias, activation="silu")
        y_ref.backward(dy)
        res[0], res[1] = peer.rel_err(got[0], y_ref.detach()), peer.rel_err(got[1], whole.grad)
        res[2] = peer.rel_err(got[2], y_ref.detach())
    dist.broadcast(res, 0)
    err_y, err_dx, err0 = res.tolist()
    ok = all(math.isfinite(e) and e <= TOL for e in (err_y, err_dx))
    sensitive = world == 1 or err0 > SENSITIVITY
    note = None if sensitive else f"the shard without the exchange is within {SENSITIVITY}: the check cannot see it"
    return dict(check=dict(W=world, B=B, T_local=Tl, C=C, K=kernel_size), rel_err_y_vs_fla=float(f"{err_y:.4e}"),
                rel_err_dx_vs_fla=float(f"{err_dx:.4e}"), rel_err_without_exchange=float(f"{err0:.4e}"),
                tolerance=TOL, ok=bool(ok and sensitive), note=note)


def measure(shape, kernel_size, args, dist, torch, ops):
    B, Tl, C = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    x, dy, weight, bias = inputs(B, Tl, C, kernel_size, 1234 + rank, torch, ops)
    conv, dy_mapped = mapped_conv(x, dy, weight, bias, B, dist, torch, ops, MAPPING)
    calls = {
        "fla_cp_fwd_ms": lambda: conv.forward(),
        "fla_cp_fwdbwd_ms": lambda: conv.forward_backward(dy_mapped),
        "fla_no_comm_fwd_ms": lambda: conv.forward(cp=False),
        "fla_no_comm_fwdbwd_ms": lambda: conv.forward_backward(dy_mapped, cp=False),
    }
    t = {}
    for name, fn in calls.items():
        if name.endswith("_fwd_ms"):
            with torch.no_grad():
                t[name] = peer.timed(fn, args.warmup, args.iters, dist, torch)
        else:
            t[name] = peer.timed(fn, args.warmup, args.iters, dist, torch)
    per_rank = {name: peer.gather_floats(ms, dist, torch) for name, ms in t.items()}
    row = dict(W=world, B=B, T_local=Tl, C=C, K=kernel_size)
    row.update({name: round(peer.slowest(ms), 5) for name, ms in per_rank.items()})
    row["per_rank_fwd_ms"] = [round(v, 5) for v in per_rank["fla_cp_fwd_ms"]]
    return row


def parse_shapes(text, channels):
    """'4x8192,1x32768' (B x T_local) -> [(B, T_local, C)]."""
    return [(b, t, channels) for b, t, _, _ in peer.parse_shapes(text, 1, 1)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated BxT_local (default {DEFAULT_SHAPES})")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="C = heads x dim channels")
    ap.add_argument("--kernel-size", type=int, default=4)
    ap.add_argument("--check-shape", default="2x8", help="B x T_local of the check (C from --heads, --dim)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None, help="also write the rows and the check as one JSON file (rank 0)")
    ap.add_argument("--self-test", action="store_true",
                    help="check the mapping and, under gloo with W = 2 and 3, the check and timing on CPU, then exit")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    channels = args.heads * args.dim
    try:
        shapes = parse_shapes(args.shapes, channels)
        [check_shape] = parse_shapes(args.check_shape, channels)
    except ValueError as e:
        ap.error(str(e))
    if args.warmup < 0 or args.iters < 1 or not 1 <= args.kernel_size <= 4:
        ap.error("--warmup must be >= 0, --iters >= 1 and --kernel-size 1 to 4")

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("short_conv_peer: torch sees no GPU: run this on the GPU node under torchrun", file=sys.stderr)
        return 1
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    ops = default_ops()
    say = (lambda s: print(s, flush=True)) if dist.get_rank() == 0 else (lambda s: None)
    chk = check(check_shape, args.kernel_size, dist, torch, ops)
    say(json.dumps(chk))
    rows = []
    for shape in shapes:
        rows.append(measure(shape, args.kernel_size, args, dist, torch, ops))
        say(json.dumps(rows[-1]))
    if args.out and dist.get_rank() == 0:
        import fla
        import triton

        method = (f"fla's causal_conv1d (Triton, SiLU, bias) with cp_context (build_cp_context, layout contiguous, "
                  f"one stream of B*C channels from global cu_seqlens [0, W*T_local]: the K-1 tokens before "
                  f"each part and their gradient exchanged over NCCL from the host), and without it; per rank "
                  f"{args.warmup} warm-up calls then the median of {args.iters} calls, each after an on-stream "
                  f"barrier, CUDA events, host sync after each; row = slowest rank.")
        Path(args.out).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), commit=os.environ.get("LASP_COMMIT"),
            date=os.environ.get("LASP_DATE"), method=method,
            versions={"torch": torch.__version__, "triton": triton.__version__,
                      "fla": getattr(fla, "__version__", "unknown")},
            check=chk, rows=rows), indent=1) + "\n")
    dist.destroy_process_group()
    return 0 if chk["ok"] else 1


def wrong_channels(x):
    """A wrong mapping (c * B + b order), for the self-test's negative case."""
    B, T, C = x.shape
    return x.permute(1, 2, 0).reshape(1, T, C * B).contiguous()


WRONG_MAPPINGS = {
    "channels in c*B+b order": types.SimpleNamespace(to_channels=wrong_channels, from_channels=from_channels,
                                                     shard=own_shard),
    "the next rank's shard": types.SimpleNamespace(to_channels=to_channels, from_channels=from_channels,
                                                   shard=lambda rank, world: (rank + 1) % world),
}


def self_test():
    """CPU checks: the mapping round trip and index order; then, under gloo in W = 2 and 3
    processes with the stand-ins for fla, the check (which must pass, and fail with a wrong mapping
    or shard) and the timing of one small shape."""
    import torch

    assert parse_shapes("4x8192,1x32768", 2048) == [(4, 8192, 2048), (1, 32768, 2048)]
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    y = to_channels(x)
    assert y.shape == (1, 5, 12)
    for b in range(3):
        for t in range(5):
            for c in range(4):
                assert y[0, t, b * 4 + c] == x[b, t, c]
    assert torch.equal(from_channels(y, 3), x)
    print("short_conv_peer self-test: ok (mapping round trip and index order)", flush=True)

    import tempfile

    import torch.multiprocessing as mp

    os.environ["GLA_PEER_DEVICE"] = "cpu"
    for world in (2, 3):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(self_test_rank, args=(world, f"file://{tmp}/store"), nprocs=world)
    return 0


def self_test_rank(rank, world, init):
    import torch
    import torch.distributed as dist

    assert DEVICE == "cpu" and peer.DEVICE == "cpu", (DEVICE, peer.DEVICE)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ops = default_ops()
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    chk = check((2, 8, 16), 4, dist, torch, ops)
    assert chk["ok"] and chk["rel_err_y_vs_fla"] < 1e-10 and chk["rel_err_dx_vs_fla"] < 1e-10, chk
    assert chk["rel_err_without_exchange"] > SENSITIVITY, chk
    say(f"short_conv_peer self-test W={world}: check ok {json.dumps(chk)}")
    for what, mapping in WRONG_MAPPINGS.items():
        bad = check((2, 8, 16), 4, dist, torch, ops, mapping=mapping)
        assert not bad["ok"], (what, bad)
        say(f"short_conv_peer self-test W={world}: check fails with {what} as it must")
    row = measure((2, 24, 8), 4, argparse.Namespace(warmup=1, iters=2), dist, torch, ops)
    assert set(row) == {"W", "B", "T_local", "C", "K", "fla_cp_fwd_ms", "fla_cp_fwdbwd_ms", "fla_no_comm_fwd_ms",
                        "fla_no_comm_fwdbwd_ms", "per_rank_fwd_ms"}, row
    assert row["fla_cp_fwd_ms"] == max(row["per_rank_fwd_ms"]) > 0, row
    say(f"short_conv_peer self-test W={world}: timing ok {json.dumps(row)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
