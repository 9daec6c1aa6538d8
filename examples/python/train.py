"""Training benchmark of a GLA decoder language model, sequence parallel over the ranks (LASP-2):
lasp-shmem's chunk_gla against fla's kernels composed with NCCL.

    PYTHONPATH=/path/to/fla-core:/path/to/einops torchrun --nproc-per-node 4 \\
        examples/python/train.py --compare --seq-len 16384 --out training.json
    torchrun --nproc-per-node 4 examples/python/train.py --backend ours --mode overlapped --out ours.json
    torchrun --nproc-per-node 4 examples/python/train.py --backend fla --out fla.json
    # CPU only (gloo, a tiny model, float64 stand-ins for both backends' kernels), as
    # python/tests/test_train_cpu.py runs it:
    PYTHONPATH=python python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        python/tests/train_cpu.py --compare

The model (defaults): 24 layers of d_model 2048, each x + GLA(RMSNorm(x)) then x + SwiGLU(RMSNorm(x))
(hidden 5632, fla's GLA config: 4 x d_model x 2/3 rounded up to 256), untied embedding and head,
vocabulary 32000. The GLA token mixing: 16 heads of Dk = Dv = 128; q, k, v and the per-key gates
g = logsigmoid(W_g x) / 16 (fla's GLA layer convention, with a full-rank W_g) are projections of x;
the attention's output goes through fla's GLA output gate (per-head RMSNorm times swish(W_r x))
and the output projection. Weights are fp32 (the master copy AdamW updates) and the compute is
bf16 under torch.autocast; q, k, v enter the attention in bf16, g in fp32. With --compile the
token-local elementwise steps (the norms, the gates, the output gate, SwiGLU's product) run through
torch.compile, in both backends alike; the attention and the projections run as they are.

Sequence parallel over the W ranks: every step draws B sequences of seq-len + 1 tokens from a
seeded generator (Zipf-distributed, so the loss has somewhere to go; the same on every rank), and
rank r keeps the inputs [r T/W, (r + 1) T/W) with their next-token targets (its last token's target
is the next rank's first token). Token-local layers run on the shard as they are; every GLA layer
calls the backend's LASP-2. Each rank's loss is the mean cross entropy of its tokens; after the
backward the parameter gradients are all-reduced and divided by W (the gradient of the mean loss
over all tokens: each rank's backward already carries the later ranks' losses through LASP-2), then
AdamW steps. The reported loss of a step is the mean of the ranks' losses.

Backends (--backend): `ours`, lasp_shmem.torch.chunk_gla with cp_group in the exchange mode --mode
(overlapped or sequential_nccl); `fla`, the fla + NCCL composition of benches/gla_lasp2_peer.py (its
Peer: chunk_fwd_h states pass, all-gather, fold, chunk_gla from the folded state; chunk_bwd_dh,
all-gather, fold, chunk_gla's backward), wrapped here in an autograd.Function.

Measured (rank 0 reports): tokens/s = B x seq-len over the median time of a step after --warmup
steps (a step: forward, backward, gradient all-reduce, AdamW, the loss's all-reduce, the host
waiting for the GPU at its end; the batch is drawn before the step's clock starts, as a data
loader hands it over); the peak memory of every rank (torch.cuda.max_memory_allocated in a step,
GiB: torch's allocator only, so lasp-shmem's NVSHMEM symmetric heap, 256 MiB by default, is not in
it); the loss of every step; rank 0's median time of each phase of a step (forward with the loss,
backward, the gradients' all-reduce, AdamW; CUDA events, so the phases need not add up to the
step), and rank 0's time of every step. Python's garbage collector runs between steps, every 10
steps, outside the timed part.

--compare trains ours twice and the fla peer once, from the same seed. Ours' runs alternate the
two exchange modes step by step, one starting with overlapped (overlapped_first), the other with
sequential_nccl (sequential_first): the two modes are timed under the same GPU clocks and
temperatures, which drift over a run by more than the modes differ, and at every step one run
computes the step in one mode and the other run in the other mode, from the same weights. The
modes' tokens/s and phases pool their steps of both runs; sequential_over_overlapped_paired is the
median over back-to-back step pairs (one step of each mode) of the sequential step's time over
the overlapped step's; loss_bitwise_identical says the two runs' losses are bitwise equal at every
step, and weights_bitwise_identical their final weights on every rank.

--out FILE (JSON): device, commit (env LASP_COMMIT), date (env LASP_DATE, else now), W, family
"gla", model (the configuration), steps, warmup, and for one run backend, mode, tokens_per_s,
peak_mem_gib (per rank), phase_ms_rank0, step_ms_rank0, losses; with --compare tokens_per_s,
peak_mem_gib and phase_ms_rank0 keyed by overlapped, sequential_nccl and fla_peer,
sequential_over_overlapped_paired, loss_bitwise_identical, weights_bitwise_identical, alternation
(each alternating run's modes in turn), and step_ms_rank0 and losses keyed by overlapped_first,
sequential_first and fla_peer. With matplotlib installed it also writes FILE's name with .png:
the loss curves and the throughputs.

Needs on the GPU node: torch with CUDA and NCCL, lasp_shmem (pip install ./python) and, for the
fla backend, fla-core (with einops) on PYTHONPATH; NVSHMEM_DISABLE_NVLS=1 and, on one node,
NVSHMEM_REMOTE_TRANSPORT=none (lasp_shmem.torch.init says why). The fla backend's first step
autotunes fla's Triton kernels, which takes many minutes on a node whose Triton cache is empty
(benches/gla_lasp2_peer.py, "Time"); a TRITON_CACHE_DIR kept from an earlier run avoids it.
"""

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import lasp_shmem.torch as lt

ROOT = Path(__file__).resolve().parents[2]
# The fla backend is benches/gla_lasp2_peer.py's composition itself, so that the training compares
# against the peer whose correctness its self-test checks; benches/ is not a package.
sys.path.insert(0, str(ROOT / "benches"))
import gla_lasp2_peer as peer  # noqa: E402

# A configuration: its backend and the exchange modes its steps take in turn (step s runs in
# modes[s % len(modes)]; the fla peer has none). The single runs train in one mode; --compare runs
# ours twice with the two modes alternating step by step, each run starting with the other mode,
# so that both modes are timed under the same clocks, temperatures and weights, and every step's
# loss is computed once in each mode from the same weights.
SINGLE = {"overlapped": ("ours", ("overlapped",)), "sequential_nccl": ("ours", ("sequential_nccl",)),
          "fla_peer": ("fla", None)}
COMPARE = {"overlapped_first": ("ours", ("overlapped", "sequential_nccl")),
           "sequential_first": ("ours", ("sequential_nccl", "overlapped")),
           "fla_peer": ("fla", None)}
SIDES = ("overlapped", "sequential_nccl", "fla_peer")


class FlaPeerGLA(torch.autograd.Function):
    """fla + NCCL LASP-2 on this rank's shard (q, k, v [B, T/W, H, D], g fp32): the peer's training
    step, its forward recording fla's chunk_gla graph on detached inputs and its backward feeding
    (do, D) through that graph."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, group, ops):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
        composition = peer.Peer(*leaves, scale, "chunk_fwd_h", dist, torch, ops, group=group)
        with torch.enable_grad():
            composition.train_forward()
        ctx.composition = composition
        return composition.o.detach()

    @staticmethod
    def backward(ctx, do):
        composition = ctx.composition
        del ctx.composition  # its graph goes with the step
        composition.do = do.contiguous()
        composition.dstates()
        composition.dallgather()
        composition.dfold()
        return (*composition.backward(), None, None, None)


def rms_norm(x, weight, eps):
    # in fp32 whatever the input, as fla's norms compute
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def swiglu(gate, up):
    return F.silu(gate) * up


def log_gates(x):
    """fla's GLA gates: logsigmoid in fp32, over 16 (its gate_logit_normalizer)."""
    return F.logsigmoid(x.float()) / 16


def output_gate(o, weight, eps, r):
    """fla's GLA output gate: per-head RMSNorm of the attention's output times swish(r)."""
    return rms_norm(o, weight, eps) * F.silu(r)


# The token-local elementwise steps; --compile replaces each with its torch.compile (inductor fuses
# each into one or two kernels, in both backends alike), the default runs them eagerly.
TOKEN_LOCAL = dict(rms_norm=rms_norm, swiglu=swiglu, log_gates=log_gates, output_gate=output_gate)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return TOKEN_LOCAL["rms_norm"](x, self.weight, self.eps)


class GLA(nn.Module):
    """fla's GLA layer with a full-rank gate projection: q, k, v, g = logsigmoid(W_g x) / 16, then
    the output gate RMSNorm(o) * swish(W_r x) per head and the output projection."""

    def __init__(self, d_model, heads, head_dim, attention):
        super().__init__()
        self.heads, self.head_dim, self.attention = heads, head_dim, attention
        inner = heads * head_dim
        self.q_proj, self.k_proj, self.v_proj, self.gk_proj, self.r_proj = (
            nn.Linear(d_model, inner, bias=False) for _ in range(5))
        self.o_norm = RMSNorm(head_dim)
        self.o_proj = nn.Linear(inner, d_model, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        heads = lambda y: y.view(B, T, self.heads, self.head_dim)  # noqa: E731
        q, k, v = (heads(p(x)).to(torch.bfloat16) for p in (self.q_proj, self.k_proj, self.v_proj))
        g = heads(TOKEN_LOCAL["log_gates"](self.gk_proj(x)))
        # the LASP-2 backends take their inputs' dtypes as they are (bf16 q, k, v, fp32 g)
        with torch.autocast(x.device.type, enabled=False):
            o = self.attention(q, k, v, g)
        o = TOKEN_LOCAL["output_gate"](o, self.o_norm.weight, self.o_norm.eps, heads(self.r_proj(x)))
        return self.o_proj(o.reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.gate, self.up = (nn.Linear(d_model, hidden, bias=False) for _ in range(2))
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.down(TOKEN_LOCAL["swiglu"](self.gate(x), self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg, attention):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.d_model), RMSNorm(cfg.d_model)
        self.attn = GLA(cfg.d_model, cfg.heads, cfg.head_dim, attention)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LM(nn.Module):
    def __init__(self, cfg, attention):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def attention_fn(backend, group, device):
    """(q, k, v, g) of the shard -> o of the shard, by the backend's LASP-2 over `group`."""
    if backend == "ours":
        return lambda q, k, v, g: lt.chunk_gla(q, k, v, g, cp_group=group)[0]
    ops = peer.fla_ops() if device.type == "cuda" else peer.reference_ops(torch)
    return lambda q, k, v, g: FlaPeerGLA.apply(q, k, v, g, q.shape[-1] ** -0.5, group, ops)


def batch(step, cfg, rank, world, device):
    """This rank's inputs and targets of the step's sequences (the same draw on every rank)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    zipf = 1.0 / torch.arange(1, cfg.vocab + 1, dtype=torch.float64)
    tokens = torch.multinomial(zipf.expand(cfg.batch, -1), cfg.seq_len + 1, replacement=True,
                               generator=gen)
    n = cfg.seq_len // world
    part = tokens[:, rank * n:(rank + 1) * n + 1].to(device)
    return part[:, :-1], part[:, 1:]


def all_reduce_mean(tensors, group, world, bucket=1 << 26):
    """Every tensor replaced by its mean over the group, in flat buckets of at most `bucket`
    elements (one collective per bucket, not per parameter, without a copy of them all at once)."""
    i = 0
    while i < len(tensors):
        j, size = i, 0
        while j < len(tensors) and (j == i or size + tensors[j].numel() <= bucket):
            size += tensors[j].numel()
            j += 1
        flat = torch.cat([t.reshape(-1) for t in tensors[i:j]])
        dist.all_reduce(flat, group=group)
        flat /= world
        for t, part in zip(tensors[i:j], flat.split([t.numel() for t in tensors[i:j]])):
            t.copy_(part.view_as(t))
        i = j


PHASES = ("forward", "backward", "gradient_all_reduce", "optimizer")


class PhaseClock:
    """CUDA events between a step's phases (the host's clock on the CPU), read after the step's
    final synchronisation, so that timing them adds no wait: {phase: ms} of the step."""

    def __init__(self, cuda):
        self.cuda, self.marks = cuda, []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def phases(self):
        pairs = zip(self.marks, self.marks[1:])
        ms = [a.elapsed_time(b) if self.cuda else (b - a) * 1e3 for a, b in pairs]
        self.marks = []
        return dict(zip(PHASES, ms))


def run(name, attention, modes, cfg, group, device, reference_weights=None, keep_weights=False):
    """Trains cfg.steps steps of the configuration `name` with `attention` (attention_fn's) from
    cfg.seed, step s in the exchange mode modes[s % len(modes)] (modes None: the fla peer). Returns
    a dict: `sides` (each step's side: its mode, or "fla_peer"), rank 0's `times` (s) and `phases`
    ({phase: ms}) of every step, `losses`, `peaks` ({side: [GiB of every rank]}, None on the CPU:
    the most torch's allocator held in a step of that side), `weights` (the final parameters on the
    host, where `keep_weights`) and `weights_equal` (whether they are bitwise those of
    `reference_weights` on every rank, where given)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sides = [modes[s % len(modes)] if modes else "fla_peer" for s in range(cfg.steps)]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    torch.manual_seed(cfg.seed)
    model = LM(cfg, attention).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.1, fused=cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = PhaseClock(cuda)
    losses, times, phases, peaks = [], [], [], {}
    # Python's collector walks every object of the process (torch's, inductor's, Triton's) when it
    # runs inside a step, at random steps on each rank, and every rank waits for the slowest at the
    # next collective: objects from before the loop are frozen out of its walks, and it runs
    # between steps, outside the timed part, as large-scale trainers schedule it.
    gc.collect()
    gc.freeze()
    gc.disable()
    for step in range(cfg.steps):
        if step % 10 == 0:
            gc.collect()
        if modes and (step == 0 or sides[step] != sides[step - 1]):
            lt.set_exchange_mode(sides[step])  # collective, and it waits for the GPU: untimed
        # The batch is drawn before the step's clock starts, as a trainer's data loader hands it
        # over: the draw's host time varies and is not what the configurations differ in.
        inputs, targets = batch(step, cfg, rank, world, device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        dist.barrier(group)
        t0 = time.perf_counter()
        clock.mark()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        clock.mark()
        loss.backward()
        clock.mark()
        all_reduce_mean([p.grad for p in params], group, world)
        clock.mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.mark()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=group)
        losses.append((reported / world).item())
        sync()
        times.append(time.perf_counter() - t0)
        phases.append(clock.phases())
        if cuda:
            held = torch.cuda.max_memory_allocated() / 2**30
            peaks[sides[step]] = max(peaks.get(sides[step], 0.0), held)
        if rank == 0:
            print(f"{name} step {step} ({sides[step]}): loss {losses[-1]:.6f} ({times[-1] * 1e3:.1f} ms)",
                  flush=True)
    gc.enable()
    gc.unfreeze()
    out = dict(sides=sides, times=times, phases=phases, losses=losses, peaks=None, weights=None,
               weights_equal=None)
    if cuda:
        every = [None] * world
        dist.all_gather_object(every, peaks, group=group)
        out["peaks"] = {side: [round(p[side], 3) for p in every] for side in peaks}
    if keep_weights:
        out["weights"] = [p.detach().cpu() for p in params]
    if reference_weights is not None:
        equal = torch.tensor(int(all(torch.equal(p.detach().cpu(), r)
                                     for p, r in zip(params, reference_weights))), device=device)
        dist.all_reduce(equal, op=dist.ReduceOp.MIN, group=group)
        out["weights_equal"] = bool(equal.item())
    del model, optimizer, params
    return out


def timed(runs, side, key, warmup):
    """`key` ("times" or "phases") of every step of `side` after the warm-up, over `runs`."""
    return [r[key][s] for r in runs for s in range(warmup, len(r["sides"])) if r["sides"][s] == side]


def side_summary(runs, side, cfg):
    """tokens/s (batch x seq-len over the median step time) and the median ms of each phase of
    `side`'s timed steps in `runs`."""
    speed = cfg.batch * cfg.seq_len / statistics.median(timed(runs, side, "times", cfg.warmup))
    steps = timed(runs, side, "phases", cfg.warmup)
    return speed, {p: round(statistics.median(s[p] for s in steps), 3) for p in PHASES}


def paired_ratio(runs, warmup):
    """The median over the alternating runs' step pairs after the warm-up (steps warmup + 2i and
    warmup + 2i + 1: one of each mode, back to back) of the sequential_nccl step's time over the
    overlapped step's: above 1 where overlapped is faster. A pair's steps drift together, so this
    sees differences smaller than the spread of step times."""
    ratios = []
    for r in runs:
        for i in range(warmup, len(r["sides"]) - 1, 2):
            t = {r["sides"][i]: r["times"][i], r["sides"][i + 1]: r["times"][i + 1]}
            ratios.append(t["sequential_nccl"] / t["overlapped"])
    return round(statistics.median(ratios), 4)


def model_config(cfg):
    return dict(layers=cfg.layers, d_model=cfg.d_model, heads=cfg.heads, head_dim=cfg.head_dim,
                ffn=cfg.ffn, vocab=cfg.vocab, batch=cfg.batch, seq_len=cfg.seq_len,
                mlp="SwiGLU", norm="RMSNorm", gates="logsigmoid(W_g x) / 16 per key",
                output="fla GLA output gate: RMSNorm(o) * swish(W_r x) per head, then o_proj",
                precision="fp32 weights and AdamW, bf16 compute (torch.autocast)",
                optimizer=f"AdamW lr {cfg.lr} weight_decay 0.1", data=f"Zipf tokens, seed {cfg.seed}",
                token_local="torch.compile" if cfg.compile else "eager")


def plot(path, result, compare):
    try:
        import matplotlib
    except ImportError:
        print("train: matplotlib does not import here, so no plot was written", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["losses"] if compare else {result["backend"] + (f" {result['mode']}" if result["mode"] else ""):
                                             result["losses"]}
    speeds = result["tokens_per_s"] if compare else {next(iter(runs)): result["tokens_per_s"]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, losses in runs.items():
        left.plot(range(len(losses)), losses, label=name)
    left.set(xlabel="step", ylabel="loss", title=f"GLA LM, W = {result['W']}")
    left.legend()
    right.bar(list(speeds), list(speeds.values()))
    right.set(ylabel="tokens/s", title=f"median after {result['warmup']} warm-up steps")
    fig.tight_layout()
    fig.savefig(path)
    print(f"train: wrote {path}", flush=True)


def main(argv=None, init_ours=None):
    """Runs the benchmark; `init_ours(group, rank, world)` starts lasp_shmem (default: its init on
    the group; python/tests/train_cpu.py passes CPU stand-ins)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("ours", "fla"), default="ours")
    ap.add_argument("--mode", choices=("overlapped", "sequential_nccl"), default="overlapped",
                    help="lasp_shmem's exchange mode (backend ours)")
    ap.add_argument("--compare", action="store_true",
                    help="ours in both modes, alternating step by step (two runs, each starting with "
                         "the other mode), then the fla peer")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128, help="Dk = Dv (64 or 128)")
    ap.add_argument("--ffn", type=int, default=None, help="SwiGLU hidden size (default: fla's GLA rule)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=16384, help="tokens per sequence, over all ranks")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the throughput")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the token-local elementwise steps (norms, gates, SwiGLU)")
    ap.add_argument("--out", default=None, help="the JSON file (rank 0)")
    ap.add_argument("--cpu", action="store_true",
                    help="gloo on the CPU and a tiny model (2 layers, d_model 128, 2 heads of 64, vocab "
                         "256, seq-len 128, 3 steps, 1 warm-up), to check the plumbing; fla runs on its "
                         "float64 stand-ins, lasp_shmem on those python/tests/train_cpu.py installs")
    cfg = ap.parse_args(argv)
    if cfg.cpu:
        cfg.layers, cfg.d_model, cfg.heads, cfg.head_dim, cfg.vocab = 2, 128, 2, 64, 256
        cfg.seq_len, cfg.steps, cfg.warmup, cfg.lr = 128, 3, 1, 1e-2
    if cfg.ffn is None:
        cfg.ffn = math.ceil(cfg.d_model * 4 * 2 / 3 / 256) * 256
    if cfg.steps <= cfg.warmup:
        ap.error("--steps must exceed --warmup")
    if cfg.compile:
        TOKEN_LOCAL.update({name: torch.compile(fn, dynamic=False) for name, fn in TOKEN_LOCAL.items()})

    if cfg.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    else:
        # The deterministic variants of torch's own ops, so that two configurations of the same
        # arithmetic give the same bits (cuBLAS needs this workspace setting before it starts).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.seq_len % world:
        ap.error(f"--seq-len {cfg.seq_len} does not split into {world} equal shards")
    configs = COMPARE if cfg.compare else {
        n: SINGLE[n] for n in ["fla_peer" if cfg.backend == "fla" else cfg.mode]}
    uses_ours = any(backend == "ours" for backend, _ in configs.values())
    if uses_ours:
        (init_ours or (lambda group, rank, world: lt.init(group)))(group, rank, world)
    # every backend's attention before the first step: a missing fla fails the job at once
    attention = {name: attention_fn(backend, group, device) for name, (backend, _) in configs.items()}
    results = {}
    for name, (_, modes) in configs.items():
        # the second alternating run's weights are checked against the first's, bit for bit
        first = results.get("overlapped_first", {}).get("weights")
        results[name] = run(name, attention[name], modes, cfg, group, device, reference_weights=first,
                            keep_weights=cfg.compare and name == "overlapped_first")
        if first is not None:
            results["overlapped_first"]["weights"] = None

    if rank == 0:
        result = dict(
            device=(torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu (gloo, float64 stand-ins for lasp_shmem and fla)"),
            commit=os.environ.get("LASP_COMMIT", "unknown"),
            date=os.environ.get("LASP_DATE", datetime.now(timezone.utc).isoformat(timespec="seconds")),
            W=world, family="gla", model=model_config(cfg), steps=cfg.steps, warmup=cfg.warmup)
        runs = list(results.values())
        summary = {side: side_summary(runs, side, cfg) for side in SIDES if timed(runs, side, "times", 0)}
        # each rank's most over the runs that had steps of the side (None on the CPU)
        peaks = {side: [max(per_run) for per_run in zip(*(r["peaks"][side] for r in runs
                                                          if r["peaks"] and side in r["peaks"]))]
                 or None for side in summary}
        ms = {name: [round(t * 1e3, 2) for t in r["times"]] for name, r in results.items()}
        if cfg.compare:
            alternating = [results["overlapped_first"], results["sequential_first"]]
            result.update(
                tokens_per_s={side: round(summary[side][0], 1) for side in SIDES},
                sequential_over_overlapped_paired=paired_ratio(alternating, cfg.warmup),
                peak_mem_gib=peaks,
                loss_bitwise_identical=alternating[0]["losses"] == alternating[1]["losses"],
                weights_bitwise_identical=results["sequential_first"]["weights_equal"],
                phase_ms_rank0={side: summary[side][1] for side in SIDES},
                alternation={name: list(modes) for name, (_, modes) in configs.items() if modes},
                step_ms_rank0=ms,
                losses={name: r["losses"] for name, r in results.items()})
        else:
            [(name, r)] = results.items()
            [(side, (speed, phase_ms))] = summary.items()
            backend, modes = configs[name]
            result.update(backend=backend, mode=modes[0] if modes else None, tokens_per_s=round(speed, 1),
                          peak_mem_gib=peaks[side], phase_ms_rank0=phase_ms, step_ms_rank0=ms[name],
                          losses=r["losses"])
        print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "step_ms_rank0")}), flush=True)
        if cfg.out:
            Path(cfg.out).write_text(json.dumps(result, indent=2) + "\n")
            print(f"train: wrote {cfg.out}", flush=True)
            plot(Path(cfg.out).with_suffix(".png"), result, cfg.compare)
    dist.barrier()
    if init_ours is None and uses_ours:
        lt.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
