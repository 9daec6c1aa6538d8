"""Gradient accuracy of the scalar-decay backward against fla's, on the same inputs, under torchrun.

    torchrun --nproc-per-node 1 benches/gradient_accuracy.py --out gradient_accuracy.json
    torchrun --nproc-per-node 4 benches/gradient_accuracy.py --out gradient_accuracy.json \
        --sanitizer sanitizer.json

Every gradient is compared, by plain relative error ||x - ref|| / ||ref||, with torch.autograd in
float64 through the quadratic form of scalar-decay linear attention (`lasp2_torch.reference`), on
the bf16 inputs both kernels see, with an initial state and a gradient of the final state. The
peer is fla's `chunk_gla` with the scalar gate broadcast over Dk (its dg summed over Dk): fla's
`chunk_simple_gla` backward refuses to run with Triton 3.4 - 3.7.0 on Hopper, `chunk_gla`'s does.
Four gate regimes (log-decays per token): typical logsigmoid(x)/16, x ~ N(0, 1); mixed 0 (45 %),
-20 (10 %) or typical; strong -30 u, u ~ U(0, 1); none 0. With W > 1 every rank first runs its
shard of the LASP-2 rows (our lasp_op_backward of a LASP-2 op, the shards' gradients gathered);
then the problems are dealt out to the ranks, each running its share of the single-GPU rows (our
lasp_op_backward of a single-GPU op), the float64 references and fla on the whole sequences, so
that fla's Triton compilation and autotuning happen once per rank, side by side.

The run fails (exit 1) where our dg is worse than 2x fla's or than 5e-3, or where dq, dk, dv or
dh0 exceed 5e-3. Rank 0 writes `--out`: device, commit, date, rows (regime, W, B, T, H, Dk, Dv,
ours_dg, fla_dg, ours_dq, ours_dk, ours_dv, ours_dh0, fla_dq, fla_dk, fla_dv) and sanitizer (each
compute-sanitizer tool's error count, from scripts/sanitize.sh's JSON).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "python"))
import lasp2_torch as lt  # noqa: E402  (the C ABI through ctypes, and the float64 reference)

TOL = 5e-3
PEER_FACTOR = 2.0
REGIMES = ("typical", "mixed", "strong", "none")
# (B, T per rank, H, D): the shapes of the comparison, Dk = Dv = D.
SHAPES = ((1, 1024, 2, 64), (2, 777, 2, 128))


def gates(regime, shape, gen, dev):
    rand = lambda: torch.rand(shape, generator=gen, device=dev)  # noqa: E731
    typical = F.logsigmoid(torch.randn(shape, generator=gen, device=dev)) / 16
    if regime == "typical":
        return typical
    if regime == "mixed":
        u = rand()
        return torch.where(u < 0.45, 0.0, torch.where(u < 0.55, -20.0, typical))
    if regime == "strong":
        return -30 * rand()
    return torch.zeros(shape, device=dev)


def problem(regime, b, t, h, d, seed, dev):
    """bf16 q, k, v, dO, fp32 gates, h0 and dht of whole sequences."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q, k, v, grad_o = (randn(b, t, h, d).bfloat16() for _ in range(4))
    g = gates(regime, (b, t, h), gen, dev).float().contiguous()
    h0 = randn(b, h, d, d) * 0.5
    grad_ht = randn(b, h, d, d) * 0.1
    return q, k, v, g, h0, grad_o, grad_ht


def fla_grads(q, k, v, g, h0, grad_o, grad_ht):
    from fla.ops.gla import chunk_gla

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    gk = g[..., None].expand(*g.shape, q.shape[-1]).contiguous().requires_grad_()
    h0_ = h0.clone().requires_grad_()
    o, ht = chunk_gla(*leaves, gk, scale=q.shape[-1] ** -0.5, initial_state=h0_,
                      output_final_state=True)
    torch.autograd.backward((o, ht), (grad_o, grad_ht))
    return [x.grad for x in leaves] + [gk.grad.sum(-1), h0_.grad]


def ours_single(lasp, runtime, q, k, v, g, h0, grad_o, grad_ht):
    grads = [torch.empty_like(x) for x in (q, k, v, g, h0)]
    for x in grads:
        x.fill_(float("nan"))
    b, _, h, d = q.shape
    op = lt.Op(lasp, runtime, lt.KIND_SINGLE_GPU, b, h, d, d)
    op.backward(lt.backward_args(q, k, v, g, h0, grad_o, grad_ht, *grads))
    torch.cuda.synchronize()
    op.free()
    return grads


def ours_lasp2(lasp, runtime, rank, world, q, k, v, g, h0, grad_o, grad_ht):
    """This rank's shard through Lasp2Attention (forward saving its start state, then the
    backward); the shards' gradients gathered on every rank."""
    b, t, h, d = q.shape
    per = t // world
    mine = lambda x: x[:, rank * per:(rank + 1) * per].contiguous()  # noqa: E731
    layer = lt.Lasp2Layer(lasp, runtime, b, h, d, d, rank, world)
    leaves = [mine(x).requires_grad_() for x in (q, k, v, g)] + [h0.clone().requires_grad_()]
    out = layer(*leaves)
    last = rank == world - 1
    if last:
        torch.autograd.backward(out, (mine(grad_o), grad_ht))
    else:
        torch.autograd.backward(out, mine(grad_o))
    torch.cuda.synchronize()
    layer.finish()
    layer.free()
    shards = []
    for x in leaves[:4]:
        parts = [torch.empty_like(x.grad).cpu() for _ in range(world)]
        dist.all_gather(parts, x.grad.cpu())
        shards.append(torch.cat(parts, 1).to(q.device))
    dh0 = leaves[4].grad.cpu()
    dist.all_reduce(dh0)  # rank 0's gradient; the others are zeros
    return shards + [dh0.to(q.device)]


GRADS = ("dq", "dk", "dv", "dg", "dh0")


def accuracy_row(regime, w, inputs, got):
    """Our gradients and fla's against the float64 reference on the same inputs."""
    q = inputs[0]
    b, t, h, d = q.shape
    want = lt.reference_grads(*inputs)
    ours = dict(zip(GRADS, (lt.rel_err(x, y) for x, y in zip(got, want))))
    fla = dict(zip(GRADS, (lt.rel_err(x, y) for x, y in zip(fla_grads(*inputs), want))))
    return {"regime": regime, "W": w, "B": b, "T": t, "H": h, "Dk": d, "Dv": d,
            "ours_dg": ours["dg"], "fla_dg": fla["dg"], "ours_dq": ours["dq"],
            "ours_dk": ours["dk"], "ours_dv": ours["dv"], "ours_dh0": ours["dh0"],
            "fla_dq": fla["dq"], "fla_dk": fla["dk"], "fla_dv": fla["dv"]}


def verdict(row):
    """Says the row; returns what failed (None where it passed)."""
    bad = [n for n in ("dq", "dk", "dv", "dh0") if not row[f"ours_{n}"] <= TOL]
    if not (row["ours_dg"] <= TOL and row["ours_dg"] <= PEER_FACTOR * row["fla_dg"]):
        bad.append("dg")
    lt.say(f"{'FAIL' if bad else 'PASS'} {row['regime']} W={row['W']} B={row['B']} T={row['T']} "
           f"H={row['H']} D={row['Dk']}: dg ours {row['ours_dg']:.2e} fla {row['fla_dg']:.2e}; "
           f"dq {row['ours_dq']:.2e} dk {row['ours_dk']:.2e} dv {row['ours_dv']:.2e} dh0 "
           f"{row['ours_dh0']:.2e} (fla dq {row['fla_dq']:.2e} dk {row['fla_dk']:.2e} dv "
           f"{row['fla_dv']:.2e})")
    if bad:
        return f"{row['regime']} W={row['W']} D={row['Dk']}: {', '.join(bad)}"
    return None


def device_name():
    return torch.cuda.get_device_name()


def commit():
    """The commit the library was built from (LASP_COMMIT, which scripts/gpu-env.sh's
    lasp_binaries exports from a bundle), else the checkout's."""
    if os.environ.get("LASP_COMMIT"):
        return os.environ["LASP_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], text=True,
                                       cwd=Path(__file__).parent).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", default=lt.default_lib())
    parser.add_argument("--out")
    parser.add_argument("--sanitizer", help="scripts/sanitize.sh's JSON of error counts")
    opts = parser.parse_args()
    if opts.lib is None:
        sys.exit("liblasp_shmem.so not found: run bash scripts/build-c-examples.sh or pass --lib")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    lasp = lt.Lasp(opts.lib)
    runtime = lt.init_runtime(lasp)

    problems = [(w, b, t_local * w, h, d, regime) for w in sorted({1, world})
                for b, t_local, h, d in SHAPES for regime in REGIMES]
    mine = [i for i in range(len(problems)) if i % world == rank]
    gathered = {}
    for i, (w, b, t, h, d, regime) in enumerate(problems):
        if w > 1:
            inputs = problem(regime, b, t, h, d, i + 1, dev)
            grads = ours_lasp2(lasp, runtime, rank, world, *inputs)
            if i in mine:
                gathered[i] = grads
    rows = []
    for i in mine:
        w, b, t, h, d, regime = problems[i]
        inputs = problem(regime, b, t, h, d, i + 1, dev)
        got = gathered.pop(i) if w > 1 else ours_single(lasp, runtime, *inputs)
        rows.append((i, accuracy_row(regime, w, inputs, got)))
    lasp.runtime_shutdown(runtime)
    everyone = [None] * world if rank == 0 else None
    dist.gather_object(rows, everyone, dst=0)
    dist.destroy_process_group()
    if rank != 0:
        return
    rows = [row for _, row in sorted(r for part in everyone for r in part)]
    failures = [f for f in map(verdict, rows) if f]
    if opts.out:
        sanitizer = json.loads(Path(opts.sanitizer).read_text()) if opts.sanitizer else None
        result = {"device": device_name(), "commit": commit(),
                  "date": datetime.date.today().isoformat(),
                  "config": {"regimes": "typical logsigmoid(N(0,1))/16; mixed 0 (45 %), -20 "
                                        "(10 %) or typical; strong -30 U(0,1); none 0",
                             "inputs": "q, k, v, dO ~ N(0, 1) bf16; h0 ~ N(0, 0.25); "
                                       "dht ~ N(0, 0.01)",
                             "peer": "fla chunk_gla, gate broadcast over Dk, dg summed"},
                  "method": "plain relative error ||x - ref|| / ||ref|| against float64 "
                            "torch.autograd through the quadratic form",
                  "rows": rows, "sanitizer": sanitizer}
        Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    lt.say(f"gradient_accuracy: {len(rows) - len(failures)} passed, {len(failures)} failed")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
