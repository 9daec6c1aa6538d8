"""LASP-2 forward from PyTorch through lasp-shmem's C ABI (ctypes), launched by torchrun.

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
- a CPU tensor is rejected with the library's message, before anything is enqueued.
With --time it then times the overlapped call against the sequential NCCL mode and the compute
alone (no exchange) at B=4, T_local=8192, H=16, D=128 (CUDA events, medians).
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


for struct, size in ((RuntimeOptions, 32), (Place, 16), (UniqueId, 128), (ForwardArgs, 104)):
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
    "lasp2_finish": [HANDLE, HANDLE],
    "lasp2_note_replayed_calls": [HANDLE, ctypes.c_uint64],
    "lasp2_free": [HANDLE],
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


def forward_args(q, k, v, g, h0, o, ht):
    b, t, h, dk = q.shape
    ptr = lambda x: None if x is None else x.data_ptr()  # noqa: E731
    return ForwardArgs(b, t, h, dk, v.shape[-1], ptr(q), ptr(k), ptr(v), ptr(g), ptr(h0), ptr(o),
                       ptr(ht), 0.0, 0)


def reference(q, k, v, g, h0):
    """o and the final state of whole sequences in float64: o = s ((Q K^T) * D) V + s e^{G} Q h0
    with D_ij = e^{G_i - G_j} for j <= i, G the cumulative log-decay."""
    q, k, v, g, h0 = (x.double() for x in (q, k, v, g, h0))
    b, t, h, dk = q.shape
    scale = dk ** -0.5
    o = torch.empty(b, t, h, v.shape[-1], dtype=torch.float64, device=q.device)
    ht = torch.empty_like(h0)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    for bi in range(b):
        for hi in range(h):
            G = g[bi, :, hi].cumsum(0)
            D = torch.where(causal, (G[:, None] - G[None, :]).clamp(max=0).exp(), 0.0)
            Q, K, V = q[bi, :, hi], k[bi, :, hi], v[bi, :, hi]
            o[bi, :, hi] = scale * (((Q @ K.T) * D) @ V + G.exp()[:, None] * (Q @ h0[bi, hi]))
            w = (G[-1] - G).exp()
            ht[bi, hi] = G[-1].exp() * h0[bi, hi] + (K * w[:, None]).T @ V
    return o, ht


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def shard(x, start, length):
    return x[:, start:start + length].contiguous()


def check(lasp, runtime, rank, world, dev):
    b, h, d = 2, 4, 128
    per_rank, short = 1000, 37
    lengths = [per_rank] * (world - 1) + [per_rank - short if world > 1 else per_rank]
    start, total, last = sum(lengths[:rank]), sum(lengths), rank == world - 1
    gen = torch.Generator(device=dev).manual_seed(11)  # the same sequence on every rank
    rand = lambda *s: torch.rand(*s, generator=gen, device=dev)  # noqa: E731
    q, k, v = ((2 * rand(b, total, h, d) - 1).bfloat16() for _ in range(3))
    g = torch.where(rand(b, total, h) < 0.05, 0.0, -0.5 * rand(b, total, h))
    h0 = rand(b, h, d, d) - 0.5
    want_o, want_ht = reference(q, k, v, g, h0)

    mine = [shard(x, start, lengths[rank]) for x in (q, k, v, g)]
    o = torch.empty(b, lengths[rank], h, d, dtype=torch.bfloat16, device=dev)
    ht = torch.empty(b, h, d, d, device=dev) if last else None
    args = forward_args(*mine, h0, o, ht)
    op = ctypes.c_void_p()
    lasp.lasp2_create(runtime, b, h, d, d, MODE_OVERLAPPED, ctypes.byref(op))
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731

    def run():
        o.fill_(float("nan"))
        if ht is not None:
            ht.fill_(float("nan"))
        lasp.lasp2_forward(op, stream(), ctypes.byref(args))
        lasp.lasp2_finish(op, stream())
        return o.clone(), None if ht is None else ht.clone()

    o1, ht1 = run()
    err = rel_err(o1, shard(want_o, start, lengths[rank]))
    line = f"rank {rank}: shard of {lengths[rank]} of {total} tokens: o rel err {err:.2e}"
    if last:
        line += f", final state rel err {rel_err(ht1, want_ht):.2e}"
    say(line + f" (tolerance {TOL:g})")
    assert err <= TOL and (not last or rel_err(ht1, want_ht) <= TOL), "does not match"

    lasp.lasp2_set_mode(op, MODE_SEQUENTIAL_NCCL)
    o2, ht2 = run()
    assert torch.equal(o1.view(torch.int16), o2.view(torch.int16)), "sequential NCCL differs"
    assert not last or torch.equal(ht1.view(torch.int32), ht2.view(torch.int32))
    lasp.lasp2_set_mode(op, MODE_OVERLAPPED)
    say(f"rank {rank}: sequential NCCL gives bitwise the overlapped outputs")

    graph, replays = torch.cuda.CUDAGraph(), 50
    o.fill_(float("nan"))
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        lasp.lasp2_forward(op, stream(), ctypes.byref(args))
    for _ in range(replays):
        graph.replay()
    lasp.lasp2_note_replayed_calls(op, replays)
    lasp.lasp2_finish(op, stream())
    assert torch.equal(o1.view(torch.int16), o.view(torch.int16)), "graph replays differ"
    say(f"rank {rank}: {replays} replays of a torch.cuda.graph capture: bitwise identical")

    bad = forward_args(*mine, h0, o, ht)
    bad.q = q.cpu().data_ptr()
    try:
        lasp.lasp2_forward(op, stream(), ctypes.byref(bad))
        raise AssertionError("a CPU tensor for q was accepted")
    except LaspError as e:
        assert e.status == ERROR_INVALID_ARGUMENT and "q at 0x" in str(e), str(e)
        say(f"rank {rank}: a CPU tensor is rejected: {str(e)[:110]}...")
    lasp.lasp2_free(op)


def time_modes(lasp, runtime, rank, world, dev, iters=50, warmup=10):
    b, t, h, d = 4, 8192, 16, 128
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    q, k, v = ((torch.rand(b, t, h, d, generator=gen, device=dev) - 0.5).bfloat16()
               for _ in range(3))
    g = -0.1 * torch.rand(b, t, h, generator=gen, device=dev)
    o = torch.empty(b, t, h, d, dtype=torch.bfloat16, device=dev)
    args = forward_args(q, k, v, g, None, o, None)
    op = ctypes.c_void_p()
    lasp.lasp2_create(runtime, b, h, d, d, MODE_OVERLAPPED, ctypes.byref(op))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    results = {}
    for name, mode in (("overlapped", MODE_OVERLAPPED), ("sequential_nccl", MODE_SEQUENTIAL_NCCL),
                       ("no_comm", MODE_NO_COMM)):
        lasp.lasp2_set_mode(op, mode)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(warmup + iters)]
        host = time.perf_counter()
        for start, end in events:  # enqueued back to back, as a training step would
            start.record()
            lasp.lasp2_forward(op, stream, ctypes.byref(args))
            end.record()
        host = time.perf_counter() - host
        lasp.lasp2_finish(op, stream)
        results[name] = statistics.median(s.elapsed_time(e) for s, e in events[warmup:])
        # The host's enqueue cost per call (ctypes, argument checks, launches, two events); it
        # stays hidden while the GPU queue is ahead of the host.
        results[name + "_host"] = 1e3 * host / len(events)
    lasp.lasp2_free(op)
    say(f"rank {rank}: B={b} T_local={t} H={h} D={d}, W={world}, median of {iters} (ms; "
        "_host: host ms per call while enqueuing): "
        + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))


def main():
    parser = argparse.ArgumentParser()
    repo = Path(__file__).resolve().parents[2]
    default = next((p for p in (repo / ".bundle/bin/liblasp_shmem.so",
                                repo / "target/release/liblasp_shmem.so") if p.exists()), None)
    parser.add_argument("--lib", default=os.environ.get("LASP_SHMEM_LIB", default))
    parser.add_argument("--time", action="store_true")
    opts = parser.parse_args()
    if opts.lib is None:
        sys.exit("liblasp_shmem.so not found: run bash scripts/build-c-examples.sh or pass --lib")

    dist.init_process_group("gloo")  # CPU only: it carries just the 128-byte id
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)

    lasp = Lasp(opts.lib)
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

    check(lasp, runtime, rank, world, dev)
    if opts.time:
        time_modes(lasp, runtime, rank, world, dev)
    lasp.runtime_shutdown(runtime)
    dist.destroy_process_group()
    say(f"rank {rank}: lasp2_torch: every check passed")


if __name__ == "__main__":
    main()
