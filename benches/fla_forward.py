"""fla's chunk_simple_gla forward on the inputs forward_bench dumped, compared with our output.

    python3 benches/fla_forward.py --dump DIR --out benches/results/forward_kernel.json

DIR is what `forward_bench --dump DIR` wrote: DIR/ours.json (device, our timings per shape) and
one folder per shape with raw little-endian q.bin, k.bin, v.bin (bf16 [B, T, H, D]), g.bin
(fp32 [B, T, H]), o.bin (our bf16 output) and meta.json. For every shape this loads the inputs
onto the GPU, runs fla.ops.simple_gla.chunk_simple_gla(q, k, v, g=g, scale=D**-0.5), checks
||ours - fla|| / ||fla|| <= 5e-3, times fla the way forward_bench times ours (10 warm-up calls,
then 50 calls enqueued back to back, each between two CUDA events, median) and writes one JSON
merging both: device, commit (env LASP_COMMIT), date (env LASP_DATE) and per shape
{B, T, H, D, ours_ms, fla_ms, speedup, hbm_floor_ms, floor_fraction, rel_err_vs_fla, ...}.

Needs torch with CUDA and fla-core (0.6.0 in benches/results/forward_kernel.json) on PYTHONPATH.
Exit status: 0 when every shape ran and agreed, 1 otherwise (the JSON is written either way, with
null where fla could not run).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

TOL = 5e-3


def load(path, dtype, shape, torch):
    n = math.prod(shape)
    size = path.stat().st_size
    want = n * torch.empty((), dtype=dtype).element_size()
    if size != want:
        raise SystemExit(f"{path}: {size} bytes, expected {want} for {shape} {dtype}; rerun forward_bench --dump")
    t = torch.from_file(str(path), shared=False, size=n, dtype=dtype)
    return t.view(*shape)


def time_calls(fn, warmup, iters, torch):
    """Median ms of `iters` calls enqueued back to back, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    samples = [a.elapsed_time(b) for a, b in pairs]
    return statistics.median(samples), min(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True, type=Path, help="directory forward_bench --dump wrote")
    ap.add_argument("--out", type=Path, default=Path("benches/results/forward_kernel.json"))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()

    ours_path = args.dump / "ours.json"
    if not ours_path.exists():
        raise SystemExit(f"{ours_path} not found: run `forward_bench --dump {args.dump}` first")
    ours = json.loads(ours_path.read_text())

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("torch sees no GPU: run this on the GPU node")
    fla_error = None
    try:
        import fla
        from fla.ops.simple_gla import chunk_simple_gla
        fla_version = getattr(fla, "__version__", "unknown")
    except Exception as e:  # report and still write our numbers
        fla_error = f"cannot import fla ({type(e).__name__}: {e}); put the fla-core wheel's contents on PYTHONPATH"
        print(f"fla_forward: {fla_error}", file=sys.stderr, flush=True)
        chunk_simple_gla, fla_version = None, None

    failures = []
    shapes = []
    for row in ours["shapes"]:
        d = args.dump / row["dir"]
        meta = json.loads((d / "meta.json").read_text())
        B, T, H, D = meta["B"], meta["T"], meta["H"], meta["D"]
        Dv = meta.get("Dv", D)
        out = dict(B=B, T=T, H=H, D=D, ours_ms=row["ours_ms"], fla_ms=None, speedup=None,
                   hbm_floor_ms=row["hbm_floor_ms"], floor_fraction=row["floor_fraction"],
                   rel_err_vs_fla=None, ours_min_ms=row.get("ours_min_ms"), fla_min_ms=None,
                   num_segments=row.get("num_segments"))
        shapes.append(out)
        if chunk_simple_gla is None:
            failures.append(f"{row['dir']}: fla not available")
            continue
        t0 = time.time()
        dev = torch.device("cuda")
        q = load(d / "q.bin", torch.bfloat16, (B, T, H, D), torch).to(dev)
        k = load(d / "k.bin", torch.bfloat16, (B, T, H, D), torch).to(dev)
        v = load(d / "v.bin", torch.bfloat16, (B, T, H, Dv), torch).to(dev)
        g = load(d / "g.bin", torch.float32, (B, T, H), torch).to(dev)
        o_ours = load(d / "o.bin", torch.bfloat16, (B, T, H, Dv), torch).to(dev)
        scale = D ** -0.5
        try:
            with torch.no_grad():
                o_fla, _ = chunk_simple_gla(q, k, v, g=g, scale=scale)
                torch.cuda.synchronize()
                ref = o_fla.double()
                err = ((o_ours.double() - ref).norm() / ref.norm()).item()
                del ref
                fla_ms, fla_min = time_calls(lambda: chunk_simple_gla(q, k, v, g=g, scale=scale),
                                             args.warmup, args.iters, torch)
        except Exception as e:
            failures.append(f"{row['dir']}: fla failed: {type(e).__name__}: {e}")
            print(f"fla_forward: {failures[-1]}", file=sys.stderr, flush=True)
            continue
        out.update(fla_ms=round(fla_ms, 5), fla_min_ms=round(fla_min, 5),
                   speedup=round(fla_ms / row["ours_ms"], 4), rel_err_vs_fla=float(f"{err:.4e}"))
        ok = math.isfinite(err) and err <= TOL
        if not ok:
            failures.append(f"{row['dir']}: rel err vs fla {err:.3e} > {TOL:.0e}")
        print(f"B={B} T={T} H={H} D={D}: ours {row['ours_ms']:.4f} ms, fla {fla_ms:.4f} ms, "
              f"speedup {fla_ms / row['ours_ms']:.2f}x, HBM floor {row['hbm_floor_ms']:.4f} ms "
              f"({row['floor_fraction']:.2f} of ours), rel err vs fla {err:.2e} {'ok' if ok else 'FAIL'} "
              f"({time.time() - t0:.0f} s)", flush=True)
        del q, k, v, g, o_ours, o_fla
        torch.cuda.empty_cache()

    result = {
        "device": ours["device"],
        "torch_device": torch.cuda.get_device_name(),
        "commit": os.environ.get("LASP_COMMIT", ours.get("commit", "unknown")),
        "date": os.environ.get("LASP_DATE", ours.get("date", "unknown")),
        "hbm_bytes_per_s": ours.get("hbm_bytes_per_s"),
        "hbm_floor": ours.get("hbm_floor"),
        "method": ours.get("method", "") + "; fla timed the same way in the same job, after ours, "
                  "on the same inputs, torch.no_grad",
        "versions": {"torch": torch.__version__, "triton": _version("triton"), "fla": fla_version},
        "tolerance_rel_err_vs_fla": TOL,
        "errors": failures + ([fla_error] if fla_error else []),
        "shapes": shapes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"fla_forward: wrote {args.out}", flush=True)
    if failures:
        print("fla_forward: FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
        return 1
    return 0


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
