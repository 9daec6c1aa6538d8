"""fla's chunk_gla (GLA, per-key gates) forward and forward+backward on the inputs our bench dumped.

    python3 benches/fla_gla.py --dump DIR --out benches/results/gla.json
    python3 benches/fla_gla.py --dump DIR --processes 5 --only b4_t8192_h16_d128
    python3 benches/fla_gla.py --self-test          # CPU only: the pure parts, no GPU, no fla

DIR is what our Rust bench's dump option wrote:
    DIR/ours.json  {"device", "commit", "shapes": [{"name", "B", "T", "H", "Dk", "Dv", "scale",
                    "ours_fwd_ms", "ours_fwdbwd_ms" (or null)}, ...]}
    DIR/<name>/q.bin, k.bin   bf16 [B, T, H, Dk], raw little-endian
    DIR/<name>/v.bin          bf16 [B, T, H, Dv]
    DIR/<name>/g.bin          fp32 [B, T, H, Dk], log-gates (<= 0)
    DIR/<name>/o.bin          our bf16 output [B, T, H, Dv]
    DIR/<name>/do.bin         bf16 [B, T, H, Dv], the output gradient our backward was given
    DIR/<name>/dq.bin, dk.bin our bf16 gradients [B, T, H, Dk] (no h0, no dht)
    DIR/<name>/dv.bin         our bf16 gradient [B, T, H, Dv]
    DIR/<name>/dg.bin         our fp32 gradient [B, T, H, Dk] of the log-gates
The five gradient files come together or not at all (older dumps and forward-only runs have none).

What is measured, per shape, by fla.ops.gla.chunk_gla(q, k, v, g, scale=<the dump's scale, Dk**-0.5
by default>, output_final_state=False) (fla-core 0.6.0):
  - agreement: ||ours - fla|| / ||fla|| (float64 norms) of o must be <= 5e-3;
  - gradient agreement, when the dump has our gradients (unless --no-backward): fla's forward on
    requires_grad q, k, v (bf16) and g (fp32), then torch.autograd.grad(o, (q, k, v, g), do) with
    the dump's do; the same relative error must be <= 5e-3 for dq, dk, dv and <= 1e-2 for dg. dg
    gets the looser bound because fla's dg is no exact reference either: fla computes it from its
    chunk states stored in bf16, and sums its terms in another order than ours. The check runs
    after the forward timing and frees its tensors before the forward+backward timing, so the
    memory held stays that of one forward+backward;
  - forward: 10 warm-up calls, then 50 calls enqueued back to back on one stream, each between
    two CUDA events, median (the minimum beside it), under torch.no_grad, as fla_forward.py;
  - forward+backward: the same, each call being the forward plus
    torch.autograd.grad(o, (q, k, v, g), do) with a fixed random do (seed 0); grads are returned,
    not accumulated, so no extra accumulation kernels are timed.
fla's times move by up to 2x between processes while ours stay put, so every timing runs in
--processes (at least 3) separate Python processes: this script re-invokes itself with --worker
for one shape at a time, the shapes taking turns round by round (round r times every shape once
before round r + 1 starts). Each process loads the inputs, checks agreement, times fla's forward,
checks the gradients and times fla's forward+backward; the row reports the median of the
per-process medians and keeps the per-process medians. A shape whose process fails (no GPU, fla
missing, a bad file) is not tried again in later rounds.

Output JSON: device (ours.json's), torch_device, commit (env LASP_COMMIT), date (env LASP_DATE),
method, hbm_bytes_per_s, hbm_floor, versions, tolerance_rel_err_vs_fla,
tolerance_grad_rel_err_vs_fla ({"dq", "dk", "dv", "dg"}), processes, errors and single_gpu: one
row per shape with B, T, H, D (= Dk), Dv, ours_fwd_ms, fla_fwd_ms, ours_fwdbwd_ms (null if
ours.json has none), fla_fwdbwd_ms, hbm_floor_fwd_ms (q, k, v read and o written once in
bf16, g read once in fp32, over the device's HBM bandwidth: H100 SXM 3.35e12 B/s, H200 4.8e12 B/s,
from torch.cuda.get_device_name; --hbm-bytes-per-s overrides), floor_fraction_fwd
(hbm_floor_fwd_ms / ours_fwd_ms), speedup_fwd (fla_fwd_ms / ours_fwd_ms), speedup_fwdbwd,
rel_err_vs_fla (the largest over processes), grad_rel_err_vs_fla ({"dq", "dk", "dv", "dg"}, each
the largest over processes; null when the dump has no gradients or --no-backward), and the
per-process medians and minima.

Needs torch with CUDA and fla-core (its wheel unpacked on PYTHONPATH; einops beside it).
Exit status: 0 when every shape ran in every process (forward and, unless --no-backward, backward)
and agreed (the output and, where dumped, the gradients); 1 otherwise (the JSON is written either
way, with null where fla could not run); 2 for bad arguments or an unreadable dump.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fla_forward import time_calls  # this folder's: median and minimum ms between CUDA events

TOL = 5e-3
# dg is looser: fla's dg comes from its bf16 chunk states and sums in another order than ours.
GRAD_TOL = {"dq": TOL, "dk": TOL, "dv": TOL, "dg": 1e-2}
# Our backward's dump, per shape: the output gradient it was given, then its gradients.
GRAD_FILES = ("do", "dq", "dk", "dv", "dg")
MIN_PROCESSES = 3
WORKER_TAG = "FLA_GLA_WORKER_RESULT "
# HBM bandwidth by device name (spec sheet numbers), matched in order, first hit wins.
HBM_BYTES_PER_S = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
]
SHAPE_KEYS = ("name", "B", "T", "H", "Dk", "Dv", "ours_fwd_ms")
# Where the worker puts the tensors: a hook for a CPU dry run of the plumbing (with torch.cuda and
# fla stubbed); leave it unset for measurements.
DEVICE = os.environ.get("FLA_GLA_DEVICE", "cuda")


# ---------------------------------------------------------------------------------------------
# Pure parts (no torch needed): checked by --self-test on CPU.
# ---------------------------------------------------------------------------------------------

def parse_ours(ours):
    """Validate ours.json's content; returns its shape rows with scale filled in."""
    if not isinstance(ours, dict) or not isinstance(ours.get("shapes"), list) or not ours["shapes"]:
        raise ValueError("ours.json: expected an object with a non-empty 'shapes' list")
    rows, names = [], set()
    for i, row in enumerate(ours["shapes"]):
        missing = [key for key in SHAPE_KEYS if key not in row]
        if missing:
            raise ValueError(f"ours.json shapes[{i}]: missing {', '.join(missing)}")
        for key in ("B", "T", "H", "Dk", "Dv"):
            if not isinstance(row[key], int) or row[key] <= 0:
                raise ValueError(f"ours.json shapes[{i}]: {key} = {row[key]!r} is not a positive integer")
        if row["name"] in names or "/" in row["name"] or row["name"] in ("", ".", ".."):
            raise ValueError(f"ours.json shapes[{i}]: bad or repeated name {row['name']!r}")
        names.add(row["name"])
        out = dict(row)
        out["scale"] = float(row["scale"]) if row.get("scale") is not None else row["Dk"] ** -0.5
        out["ours_fwdbwd_ms"] = row.get("ours_fwdbwd_ms")
        rows.append(out)
    return rows


def hbm_bytes_per_s(device_name):
    """The device's HBM bandwidth in B/s from its torch name, or None when unknown."""
    for key, bw in HBM_BYTES_PER_S:
        if key in (device_name or ""):
            return bw
    return None


def fwd_bytes(B, T, H, Dk, Dv):
    """q, k, v read and o written once in bf16, g read once in fp32."""
    n = B * T * H
    return n * (2 * Dk * 2 + 2 * Dv * 2 + Dk * 4)


def hbm_floor_ms(B, T, H, Dk, Dv, bw):
    return None if not bw else fwd_bytes(B, T, H, Dk, Dv) / bw * 1e3


def grad_dump_present(d):
    """Whether the shape folder d has our gradients: True when all of GRAD_FILES are there, False
    when none is (a dump from before the backward, or of a forward-only run); ValueError otherwise."""
    missing = [f"{n}.bin" for n in GRAD_FILES if not (d / f"{n}.bin").exists()]
    if missing and len(missing) < len(GRAD_FILES):
        raise ValueError(f"{d}: gradient dump incomplete, {', '.join(missing)} missing; redo the dump")
    return not missing


def grad_rel_errs(name, good):
    """Per gradient, the largest rel err over the processes that checked the gradients (None when
    none did, or for a gradient some process got no finite error for), and the failure strings."""
    reported = [r["grad_rel_err"] for r in good if r.get("grad_rel_err") is not None]
    if not reported:
        return None, []
    worst, failures = {}, []
    for grad, tol in GRAD_TOL.items():
        errs = [x.get(grad) for x in reported]
        bad = [e for e in errs if e is None or not math.isfinite(e) or e > tol]
        if bad:
            failures.append(f"{name}: {grad} rel err vs fla {max(bad, key=lambda e: -1 if e is None else e)}"
                            f" > {tol:.0e} (per process: {errs})")
        finite = [e for e in errs if e is not None and math.isfinite(e)]
        worst[grad] = float(f"{max(finite):.4e}") if len(finite) == len(errs) else None
    return worst, failures


def median_of(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(num, den, digits=4):
    return round(num / den, digits) if num is not None and den else None


def _round(x, digits=5):
    return None if x is None else round(x, digits)


def assemble_row(shape, results, bw, need_backward=True, processes=MIN_PROCESSES):
    """One single_gpu row from a shape of ours.json and its workers' results (dicts, one per
    process; a failed process is a dict with 'error'). Returns (row, list of failure strings)."""
    name = shape["name"]
    failures = []
    good = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            failures.append(f"{name}: process {r.get('process', '?')}: {r['error']}")
    if len(results) < processes:
        failures.append(f"{name}: {len(results)} of {processes} processes ran")
    errs = [r.get("rel_err") for r in good]
    bad_err = [e for e in errs if e is None or not math.isfinite(e) or e > TOL]
    if bad_err:
        failures.append(f"{name}: rel err vs fla {max(bad_err, key=lambda e: -1 if e is None else e)} > {TOL:.0e}"
                        f" (per process: {errs})")
    fwd = [r.get("fwd_ms") for r in good]
    fwd_min = [r.get("fwd_min_ms") for r in good]
    fb = [r.get("fwdbwd_ms") for r in good]
    fb_min = [r.get("fwdbwd_min_ms") for r in good]
    for r in good:
        if need_backward and r.get("fwdbwd_ms") is None:
            failures.append(f"{name}: process {r.get('process', '?')}: fla forward+backward did not run: "
                            f"{r.get('fwdbwd_error', 'no time reported')}")
        if "grad_error" in r:
            failures.append(f"{name}: process {r.get('process', '?')}: gradient check did not run: "
                            f"{r['grad_error']}")
    grad_worst, grad_failures = grad_rel_errs(name, good)
    failures += grad_failures
    fla_fwd = median_of(fwd) if good else None
    fla_fb = median_of(fb) if good else None
    B, T, H, Dk, Dv = shape["B"], shape["T"], shape["H"], shape["Dk"], shape["Dv"]
    floor = hbm_floor_ms(B, T, H, Dk, Dv, bw)
    ours_fwd, ours_fb = shape["ours_fwd_ms"], shape.get("ours_fwdbwd_ms")
    finite_errs = [e for e in errs if e is not None and math.isfinite(e)]
    row = dict(
        B=B, T=T, H=H, D=Dk, Dv=Dv,
        ours_fwd_ms=ours_fwd, fla_fwd_ms=_round(fla_fwd),
        ours_fwdbwd_ms=ours_fb, fla_fwdbwd_ms=_round(fla_fb),
        hbm_floor_fwd_ms=_round(floor),
        floor_fraction_fwd=_ratio(floor, ours_fwd),
        speedup_fwd=_ratio(fla_fwd, ours_fwd),
        speedup_fwdbwd=_ratio(fla_fb, ours_fb),
        rel_err_vs_fla=float(f"{max(finite_errs):.4e}") if finite_errs and len(finite_errs) == len(errs) else None,
        grad_rel_err_vs_fla=grad_worst,
        fla_fwd_ms_per_process=[_round(x) for x in fwd],
        fla_fwd_min_ms_per_process=[_round(x) for x in fwd_min],
        fla_fwdbwd_ms_per_process=[_round(x) for x in fb],
        fla_fwdbwd_min_ms_per_process=[_round(x) for x in fb_min],
        name=name, scale=shape["scale"],
    )
    for key in ("ours_fwd_ms_per_process", "num_segments", "states_splits"):
        if key in shape:
            row[key] = shape[key]
    return row, failures


def parse_worker_output(stdout):
    """The result dict a worker printed (the last line starting with WORKER_TAG), or None."""
    found = None
    for line in stdout.splitlines():
        if line.startswith(WORKER_TAG):
            found = json.loads(line[len(WORKER_TAG):])
    return found


def run_worker(cmd, timeout, env=None):
    """Run one worker process; its stderr goes to ours, its stdout is parsed. Always a dict."""
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"worker timed out after {timeout} s"}
    try:
        res = parse_worker_output(p.stdout)
    except ValueError as e:
        res = {"error": f"unparsable worker result: {e}"}
    if res is None:
        tail = " | ".join(p.stdout.strip().splitlines()[-5:])
        res = {"error": f"worker exited {p.returncode} without a result" + (f" (stdout: {tail})" if tail else "")}
    elif p.returncode != 0 and "error" not in res:
        res["error"] = f"worker exited {p.returncode}"
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def build_result(ours, rows, failures, worker_info, bw, args_desc):
    """The output JSON object."""
    return {
        "device": ours.get("device"),
        "torch_device": worker_info.get("device_name"),
        "commit": os.environ.get("LASP_COMMIT", ours.get("commit", "unknown")),
        "date": os.environ.get("LASP_DATE", ours.get("date", "unknown")),
        "method": (ours.get("method", "ours: as recorded in ours.json") + "; fla: " + args_desc),
        "hbm_bytes_per_s": bw,
        "hbm_floor": "(q, k, v read + o written once in bf16, g read once in fp32) / hbm_bytes_per_s "
                     "(spec bandwidth by device name: H100 SXM 3.35e12, H200 4.8e12 B/s)",
        "versions": {k: worker_info.get(k) for k in ("torch", "triton", "fla")},
        "tolerance_rel_err_vs_fla": TOL,
        "tolerance_grad_rel_err_vs_fla": GRAD_TOL,
        "errors": failures,
        "single_gpu": rows,
    }


# ---------------------------------------------------------------------------------------------
# GPU parts.
# ---------------------------------------------------------------------------------------------

def load(path, dtype, shape, torch):
    n = math.prod(shape)
    size = path.stat().st_size
    want = n * torch.empty((), dtype=dtype).element_size()
    if size != want:
        raise ValueError(f"{path}: {size} bytes, expected {want} for {shape} {dtype}; redo the dump")
    return torch.from_file(str(path), shared=False, size=n, dtype=dtype).view(*shape)


def rel_err(ours, ref):
    ref = ref.double()
    return ((ours.double() - ref).norm() / ref.norm()).item()


def grad_check(d, shape, q, k, v, g, chunk_gla, torch):
    """rel err of our dumped dq, dk, dv, dg against fla's, from one fla forward+backward with the
    dumped do; None when the dump has no gradients. Ours are loaded one at a time and each of fla's
    gradients is dropped once compared, to keep memory bounded at the largest shapes; nothing
    outlives the call."""
    if not grad_dump_present(d):
        return None
    B, T, H, Dk, Dv, scale = (shape[k] for k in ("B", "T", "H", "Dk", "Dv", "scale"))
    dev = q.device
    do = load(d / "do.bin", torch.bfloat16, (B, T, H, Dv), torch).to(dev)
    # detach() shares the inputs' storage: fresh leaves without copying the inputs.
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
    o, _ = chunk_gla(*leaves, scale=scale, output_final_state=False)
    grads = dict(zip(("dq", "dk", "dv", "dg"), torch.autograd.grad(o, leaves, do)))
    del o, do, leaves
    errs = {}
    for name, dtype, last in (("dq", torch.bfloat16, Dk), ("dk", torch.bfloat16, Dk),
                              ("dv", torch.bfloat16, Dv), ("dg", torch.float32, Dk)):
        ours = load(d / f"{name}.bin", dtype, (B, T, H, last), torch).to(dev)
        errs[name] = rel_err(ours, grads.pop(name))
        del ours
    return errs


def worker(args):
    """One process, one shape: check agreement, time fla's forward, check the gradients, time fla's
    forward+backward."""
    import torch

    res = {"name": args.worker, "process": args.process}
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no GPU: run this on the GPU node")
        import fla
        from fla.ops.gla import chunk_gla
        res.update(device_name=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=_version("triton"), fla=getattr(fla, "__version__", "unknown"))
        shape = {s["name"]: s for s in parse_ours(json.loads((args.dump / "ours.json").read_text()))}[args.worker]
        d = args.dump / shape["name"]
        B, T, H, Dk, Dv, scale = (shape[k] for k in ("B", "T", "H", "Dk", "Dv", "scale"))
        dev = torch.device(DEVICE)
        q = load(d / "q.bin", torch.bfloat16, (B, T, H, Dk), torch).to(dev)
        k = load(d / "k.bin", torch.bfloat16, (B, T, H, Dk), torch).to(dev)
        v = load(d / "v.bin", torch.bfloat16, (B, T, H, Dv), torch).to(dev)
        g = load(d / "g.bin", torch.float32, (B, T, H, Dk), torch).to(dev)
        o_ours = load(d / "o.bin", torch.bfloat16, (B, T, H, Dv), torch).to(dev)

        def fwd():
            return chunk_gla(q, k, v, g, scale=scale, output_final_state=False)

        with torch.no_grad():
            o_fla, _ = fwd()
            torch.cuda.synchronize()
            res["rel_err"] = rel_err(o_ours, o_fla)
            del o_fla, o_ours
            res["fwd_ms"], res["fwd_min_ms"] = time_calls(fwd, args.warmup, args.iters, torch)
        if not args.no_backward:
            try:
                res["grad_rel_err"] = grad_check(d, shape, q, k, v, g, chunk_gla, torch)
            except Exception as e:  # reported apart, so the forward+backward is still timed
                res["grad_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            try:
                leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
                gen = torch.Generator(device=dev).manual_seed(0)
                do = torch.randn(B, T, H, Dv, device=dev, generator=gen).to(torch.bfloat16)

                def fwdbwd():
                    o, _ = chunk_gla(*leaves, scale=scale, output_final_state=False)
                    return torch.autograd.grad(o, leaves, do)

                res["fwdbwd_ms"], res["fwdbwd_min_ms"] = time_calls(fwdbwd, args.warmup, args.iters, torch)
            except Exception as e:  # fla's backward refuses some Triton versions; report it
                res["fwdbwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    print(WORKER_TAG + json.dumps(res), flush=True)
    return 0 if "error" not in res else 1


def _fmt(x):
    return "n/a" if x is None else f"{x:.4g}"


def _fmt_grads(errs):
    return "n/a" if errs is None else " ".join(f"{k} {_fmt(v)}" for k, v in errs.items())


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", type=Path, help="directory our bench's dump wrote (ours.json + one folder per shape)")
    ap.add_argument("--out", type=Path, default=Path("benches/results/gla.json"))
    ap.add_argument("--processes", type=int, default=MIN_PROCESSES,
                    help=f"separate Python processes timing fla per shape (at least {MIN_PROCESSES})")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this shape of ours.json (repeatable)")
    ap.add_argument("--no-backward", action="store_true",
                    help="run fla's forward only: no forward+backward timing, no gradient check")
    ap.add_argument("--hbm-bytes-per-s", type=float, default=None,
                    help="HBM bandwidth for the floor, overriding the device-name table")
    ap.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds per worker process")
    ap.add_argument("--self-test", action="store_true", help="check the pure parts on CPU and exit")
    ap.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    ap.add_argument("--process", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.self_test:
        return self_test()
    if args.dump is None:
        ap.error("--dump is required")
    if args.warmup < 0 or args.iters < 1:
        ap.error("--warmup must be >= 0 and --iters >= 1")
    if args.worker:
        return worker(args)
    if args.processes < MIN_PROCESSES:
        ap.error(f"--processes must be at least {MIN_PROCESSES}: fla's times vary between processes")

    ours_path = args.dump / "ours.json"
    if not ours_path.exists():
        print(f"fla_gla: {ours_path} not found: run our bench with its dump option first", file=sys.stderr)
        return 2
    ours = json.loads(ours_path.read_text())
    try:
        shapes = parse_ours(ours)
    except ValueError as e:
        print(f"fla_gla: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {s["name"] for s in shapes})
        if unknown:
            print(f"fla_gla: --only {', '.join(unknown)}: not in {ours_path}", file=sys.stderr)
            return 2
        shapes = [s for s in shapes if s["name"] in args.only]

    results = {s["name"]: [] for s in shapes}
    for r in range(1, args.processes + 1):
        for s in shapes:
            if any("error" in x for x in results[s["name"]]):
                continue  # its first failure is reported; the rest would repeat it
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", s["name"], "--process", str(r),
                   "--dump", str(args.dump), "--warmup", str(args.warmup), "--iters", str(args.iters)]
            if args.no_backward:
                cmd.append("--no-backward")
            res = run_worker(cmd, args.worker_timeout)
            res["process"] = r  # 1-based
            results[s["name"]].append(res)
            msg = res.get("error") or (
                f"fla fwd {res.get('fwd_ms', float('nan')):.4f} ms, fwd+bwd "
                + (f"{res['fwdbwd_ms']:.4f} ms" if res.get("fwdbwd_ms") is not None
                   else f"n/a ({res.get('fwdbwd_error', 'skipped')})")
                + f", rel err vs ours {res.get('rel_err', float('nan')):.2e}"
                + f", grads {_fmt_grads(res.get('grad_rel_err')) if 'grad_error' not in res else res['grad_error']}")
            print(f"fla_gla: process {r}/{args.processes} {s['name']}: {msg} ({res.get('wall_s')} s)", flush=True)

    worker_info = next((x for rs in results.values() for x in rs if "device_name" in x), {})
    bw = args.hbm_bytes_per_s or hbm_bytes_per_s(worker_info.get("device_name"))
    failures, rows = [], []
    for s in shapes:
        row, fails = assemble_row(s, results[s["name"]], bw, need_backward=not args.no_backward,
                                  processes=args.processes)
        rows.append(row)
        failures += fails
        print(f"B={row['B']} T={row['T']} H={row['H']} D={row['D']}: fwd ours {row['ours_fwd_ms']} ms, "
              f"fla {_fmt(row['fla_fwd_ms'])} ms (fla / ours {_fmt(row['speedup_fwd'])}); fwd+bwd ours "
              f"{_fmt(row['ours_fwdbwd_ms'])} ms, fla {_fmt(row['fla_fwdbwd_ms'])} ms (fla / ours "
              f"{_fmt(row['speedup_fwdbwd'])}); HBM floor {_fmt(row['hbm_floor_fwd_ms'])} ms "
              f"({_fmt(row['floor_fraction_fwd'])} of ours); rel err vs fla {_fmt(row['rel_err_vs_fla'])}, "
              f"grads {_fmt_grads(row['grad_rel_err_vs_fla'])}", flush=True)
    if bw is None:
        failures.append(f"unknown HBM bandwidth for {worker_info.get('device_name')!r}: pass --hbm-bytes-per-s")
    desc = (f"fla.ops.gla.chunk_gla(q, k, v, g, scale, output_final_state=False) on the same inputs, after "
            f"ours, in {args.processes} separate Python processes per shape (shapes in turns, round by "
            f"round); in each: {args.warmup} warm-up calls, then {args.iters} calls enqueued back to back "
            f"on one stream, each between two CUDA events, median; forward under torch.no_grad; "
            f"forward+backward = forward + torch.autograd.grad of (q, k, v, g) with a fixed random do; "
            f"row = median of the per-process medians; gradients (where dumped) checked once per process "
            f"before the forward+backward timing, with the dump's do")
    result = build_result(ours, rows, failures, worker_info, bw, desc)
    result["processes"] = args.processes
    if worker_info.get("device_name") and ours.get("device") and worker_info["device_name"] != ours["device"]:
        result["warnings"] = [f"ours.json was measured on {ours['device']!r}, fla on {worker_info['device_name']!r}"]
        print(f"fla_gla: warning: {result['warnings'][0]}", file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"fla_gla: wrote {args.out}", flush=True)
    if failures:
        print("fla_gla: FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
        return 1
    return 0


def self_test():
    """CPU checks of the pure parts (and of the worker plumbing with a stand-in process)."""
    shape = dict(name="b4_t8192_h16_d128", B=4, T=8192, H=16, Dk=128, Dv=128, scale=128 ** -0.5,
                 ours_fwd_ms=0.3, ours_fwdbwd_ms=2.0)
    [s] = parse_ours({"device": "x", "shapes": [shape]})
    assert s["scale"] == 128 ** -0.5
    [s2] = parse_ours({"shapes": [{k: v for k, v in shape.items() if k not in ("scale", "ours_fwdbwd_ms")}]})
    assert s2["scale"] == 128 ** -0.5 and s2["ours_fwdbwd_ms"] is None
    for bad in ({"shapes": []}, {"shapes": [dict(shape, B=0)]}, {"shapes": [shape, shape]},
                {"shapes": [{k: v for k, v in shape.items() if k != "T"}]}, {"shapes": [dict(shape, name="../x")]}):
        try:
            parse_ours(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"parse_ours accepted {bad}")

    assert hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert hbm_bytes_per_s("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_bytes_per_s("NVIDIA A100-SXM4-80GB") is None and hbm_bytes_per_s(None) is None
    # B=4 T=8K H=16 D=128: q, k, v, o 128 MiB each in bf16, g 256 MiB in fp32 = 768 MiB
    assert fwd_bytes(4, 8192, 16, 128, 128) == 768 * 2 ** 20
    assert abs(hbm_floor_ms(4, 8192, 16, 128, 128, 3.35e12) - 768 * 2 ** 20 / 3.35e9) < 1e-12

    ok = [dict(process=i, rel_err=3e-3, fwd_ms=f, fwd_min_ms=f - 0.01, fwdbwd_ms=fb, fwdbwd_min_ms=fb - 0.1)
          for i, (f, fb) in enumerate([(0.9, 4.0), (0.45, 3.0), (0.6, 5.0)])]
    row, fails = assemble_row(s, ok, 3.35e12)
    assert not fails, fails
    assert row["fla_fwd_ms"] == 0.6 and row["fla_fwdbwd_ms"] == 4.0
    assert row["fla_fwd_ms_per_process"] == [0.9, 0.45, 0.6]
    assert row["speedup_fwd"] == 2.0 and row["speedup_fwdbwd"] == 2.0
    assert row["hbm_floor_fwd_ms"] == round(768 * 2 ** 20 / 3.35e9, 5)
    assert row["floor_fraction_fwd"] == round(768 * 2 ** 20 / 3.35e9 / 0.3, 4)
    assert row["rel_err_vs_fla"] == 3e-3
    for k in ("B", "T", "H", "D", "ours_fwd_ms", "fla_fwd_ms", "ours_fwdbwd_ms", "fla_fwdbwd_ms",
              "hbm_floor_fwd_ms", "floor_fraction_fwd", "speedup_fwd", "speedup_fwdbwd", "rel_err_vs_fla"):
        assert k in row, k
    row, fails = assemble_row(s2, ok, None)
    assert not fails and row["speedup_fwdbwd"] is None and row["hbm_floor_fwd_ms"] is None
    # disagreement, a failed process, a missing backward, too few processes: all failures
    _, fails = assemble_row(s, [dict(ok[0], rel_err=6e-3)] + ok[1:], 3.35e12)
    assert len(fails) == 1 and "rel err" in fails[0], fails
    _, fails = assemble_row(s, [ok[0], {"process": 1, "error": "boom"}, ok[2]], 3.35e12)
    assert len(fails) == 1 and "boom" in fails[0], fails
    _, fails = assemble_row(s, [dict(ok[0], fwdbwd_ms=None, fwdbwd_error="refused")] + ok[1:], 3.35e12)
    assert len(fails) == 1 and "refused" in fails[0], fails
    _, fails = assemble_row(s, [dict(ok[0], fwdbwd_ms=None)] + ok[1:], 3.35e12, need_backward=False)
    assert not fails
    _, fails = assemble_row(s, ok[:2], 3.35e12)
    assert len(fails) == 1 and "2 of 3" in fails[0], fails
    _, fails = assemble_row(s, [dict(ok[0], rel_err=float("nan"))] + ok[1:], 3.35e12)
    assert len(fails) == 1, fails

    # gradients: the largest per gradient over processes; dg has its own tolerance; null if unchecked
    assert row["grad_rel_err_vs_fla"] is None
    gerr = dict(dq=2e-3, dk=3e-3, dv=1e-3, dg=8e-3)
    gok = [dict(r, grad_rel_err=dict(gerr, dq=gerr["dq"] + i * 1e-3)) for i, r in enumerate(ok)]
    row, fails = assemble_row(s, gok, 3.35e12)
    assert not fails, fails
    assert row["grad_rel_err_vs_fla"] == dict(dq=4e-3, dk=3e-3, dv=1e-3, dg=8e-3), row["grad_rel_err_vs_fla"]
    row, fails = assemble_row(s, [dict(gok[0], grad_rel_err=dict(gerr, dk=6e-3))] + gok[1:], 3.35e12)
    assert len(fails) == 1 and fails[0].startswith(s["name"] + ": dk rel err vs fla 0.006 > 5e-03"), fails
    assert row["grad_rel_err_vs_fla"]["dk"] == 6e-3
    _, fails = assemble_row(s, [dict(gok[0], grad_rel_err=dict(gerr, dg=1.1e-2))] + gok[1:], 3.35e12)
    assert len(fails) == 1 and ": dg rel err vs fla 0.011 > 1e-02" in fails[0], fails
    row, fails = assemble_row(s, [dict(gok[0], grad_rel_err=dict(gerr, dv=float("nan")))] + gok[1:], 3.35e12)
    assert len(fails) == 1 and ": dv rel err" in fails[0] and row["grad_rel_err_vs_fla"]["dv"] is None, fails
    _, fails = assemble_row(s, [dict(gok[0], grad_rel_err={k: v for k, v in gerr.items() if k != "dq"})]
                            + gok[1:], 3.35e12)
    assert len(fails) == 1 and ": dq rel err vs fla None" in fails[0], fails
    row, fails = assemble_row(s, [dict(ok[0], grad_error="ValueError: short file")] + gok[1:], 3.35e12)
    assert len(fails) == 1 and "gradient check did not run: ValueError" in fails[0], fails
    assert row["grad_rel_err_vs_fla"]["dq"] == 4e-3
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        assert grad_dump_present(d) is False
        for n in GRAD_FILES[:2]:
            (d / f"{n}.bin").write_bytes(b"")
        try:
            grad_dump_present(d)
        except ValueError as e:
            assert "dk.bin, dv.bin, dg.bin missing" in str(e), e
        else:
            raise AssertionError("grad_dump_present accepted an incomplete dump")
        for n in GRAD_FILES:
            (d / f"{n}.bin").write_bytes(b"")
        assert grad_dump_present(d) is True

    # worker plumbing with stand-in processes
    good = {"name": "x", "rel_err": 1e-3, "fwd_ms": 1.0}
    cmd = [sys.executable, "-c", f"print('noise'); print({WORKER_TAG + json.dumps(good)!r})"]
    res = run_worker(cmd, 60)
    assert res["rel_err"] == 1e-3 and "error" not in res, res
    res = run_worker([sys.executable, "-c", "print('no result'); raise SystemExit(3)"], 60)
    assert "exited 3" in res["error"], res
    res = run_worker([sys.executable, "-c", "import time; time.sleep(5)"], 0.5)
    assert "timed out" in res["error"], res

    result = build_result({"device": "NVIDIA H100", "commit": "c"}, [row], [], {"device_name": "NVIDIA H100",
                          "torch": "t", "triton": "tr", "fla": "0.6.0"}, 3.35e12, "m")
    json.dumps(result)
    for k in ("device", "commit", "date", "method", "tolerance_grad_rel_err_vs_fla", "single_gpu"):
        assert k in result, k

    # load / rel_err with torch on CPU, when torch is importable
    try:
        import torch
    except ImportError:
        print("fla_gla self-test: torch not importable, skipped load/rel_err/grad_check")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            x = torch.randn(2, 3, 4, 5).to(torch.bfloat16)
            p = Path(tmp) / "x.bin"
            p.write_bytes(x.view(torch.int16).numpy().astype("<i2").tobytes())
            y = load(p, torch.bfloat16, (2, 3, 4, 5), torch)
            assert torch.equal(x, y)
            try:
                load(p, torch.float32, (2, 3, 4, 5), torch)
            except ValueError:
                pass
            else:
                raise AssertionError("load accepted a wrong size")
            assert rel_err(y, x) == 0.0
            assert abs(rel_err(x.double() * 1.001, x.double()) - 1e-3) < 1e-9
        self_test_grad_check(torch)
    print("fla_gla self-test: ok")
    return 0


def self_test_grad_check(torch):
    """grad_check's plumbing on CPU, fla stood in for by a differentiable toy with chunk_gla's
    signature: a dump of the toy's own gradients agrees exactly, a perturbed one by as much."""
    def toy_gla(q, k, v, g, scale, output_final_state):
        o = (q.float() * k.float() * g.exp()).sum(-1, keepdim=True) * scale * v.float()
        return o.to(torch.bfloat16), None

    def write(path, x):
        path.write_bytes(x.contiguous().view(torch.uint8).numpy().tobytes())

    B, T, H, Dk, Dv = 1, 6, 2, 4, 3
    shape = dict(B=B, T=T, H=H, Dk=Dk, Dv=Dv, scale=Dk ** -0.5)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, Dk, generator=gen).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=gen).to(torch.bfloat16)
    g = -torch.rand(B, T, H, Dk, generator=gen)
    do = torch.randn(B, T, H, Dv, generator=gen).to(torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o, _ = toy_gla(*leaves, scale=shape["scale"], output_final_state=False)
    grads = torch.autograd.grad(o, leaves, do)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        assert grad_check(d, shape, q, k, v, g, toy_gla, torch) is None
        write(d / "do.bin", do)
        for name, x in zip(("dq", "dk", "dv", "dg"), grads):
            write(d / f"{name}.bin", x)
        assert grad_check(d, shape, q, k, v, g, toy_gla, torch) == dict(dq=0.0, dk=0.0, dv=0.0, dg=0.0)
        write(d / "dg.bin", grads[3] * 1.01)
        errs = grad_check(d, shape, q, k, v, g, toy_gla, torch)
        assert abs(errs["dg"] - 1e-2) < 1e-6 and errs["dv"] == 0.0, errs
        (d / "dv.bin").write_bytes(b"\0" * 4)
        try:
            grad_check(d, shape, q, k, v, g, toy_gla, torch)
        except ValueError as e:
            assert "dv.bin" in str(e), e
        else:
            raise AssertionError("grad_check accepted a short dv.bin")


if __name__ == "__main__":
    sys.exit(main())
