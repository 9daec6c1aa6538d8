"""mlstm_kernels' TFLA mLSTM forward and forward+backward on the inputs our mLSTM bench dumped.

    python3 benches/tfla_mlstm.py --dump DIR --out benches/results/mlstm.json
    python3 benches/tfla_mlstm.py --dump DIR --processes 5 --chunk-sizes 128 --only b4_t8192_h16_d128
    python3 benches/tfla_mlstm.py --self-test          # CPU only: the pure parts, no GPU, no mlstm_kernels

DIR is what mlstm_bench --dump DIR wrote:
    DIR/ours.json  {"device", "commit", "method", "inputs", "shapes": [{"name", "B", "T", "H", "Dk",
                    "Dv", "scale", "eps", "ours_fwd_ms", "ours_fwd_min_ms", "num_segments",
                    "chunks_per_segment"}, ...]}
    DIR/<name>/q.bin, k.bin   bf16 [B, T, H, Dk], raw little-endian
    DIR/<name>/v.bin          bf16 [B, T, H, Dv]
    DIR/<name>/h.bin          our bf16 output [B, T, H, Dv]
    DIR/<name>/i.bin, f.bin   fp32 [B, T, H], input- and forget-gate pre-activations
    DIR/<name>/dh.bin         bf16 [B, T, H, Dv]: the upstream gradient both backwards take
    DIR/<name>/dq.bin, dk.bin, dv.bin, di.bin, df.bin   our gradients (bf16 like q, k, v; fp32 gates)
ours.json's rows also carry ours_fwdbwd_ms (our forward saving its rows plus our backward) and
ours_bwd_ms; a dump without dh.bin (an older bench) is compared forward only.

What is measured, per shape, by
mlstm_kernels.torch.chunkwise.triton_xl_chunk.mlstm_chunkwise__xl_chunk(q, k, v, i, f, eps=<the
dump's eps>, chunk_size=C) (mlstm_kernels 2.0.6, TFLA), for every C of --chunk-sizes (its
intra-chunk size; it stores states every min(C, 128) tokens). Both sides compute mLSTMexp
(exponential input gate, logsigmoid forget gate, max stabiliser, eps added after
max(|q . n|, e^-m)); TFLA's qk scale is always Dk^-0.5, so a dump with another scale is an error
and its shape is not run. The inputs are moved once, outside the timing, into TFLA's layout
(q, k, v [B, H, T, D], i, f [B, H, T]; fp32 gates, bf16 the rest, no autocast); its output is bf16
[B, H, T, Dv], compared with ours in that layout.
  - agreement, at every chunk size: ||ours - tfla|| / ||tfla|| (float64 norms) of h must be
    <= 1e-2. Looser than the 5e-3 our output is held to against a float64 reference by the GPU
    tests: TFLA computes its intra-chunk products from bf16 operands and chunks differently from
    our 64-token chunks, so the two round differently;
  - forward: 10 warm-up calls, then 50 calls enqueued back to back on one stream, each between
    two CUDA events, median (the minimum beside it), under torch.no_grad, as fla_forward.py;
  - forward+backward (unless --no-backward): the same, each call being the forward on q, k, v, i, f
    as requires_grad leaves plus torch.autograd.grad(h, (q, k, v, i, f), dh) with the dump's dh
    (or, without one, a fixed random bf16 dh, seed 0); grads are returned, not accumulated;
  - gradient agreement (where the dump has ours): ||ours - tfla|| / ||tfla|| of dq, dk, dv, di and
    df at every chunk size, and TFLA's own gradients at each chunk size against those at the first
    (tfla_self_rel_err: TFLA's chunk sizes need not agree with each other). dq, dk and dv must be
    within 1e-2 at one chunk size at least, as h; di and df are recorded, not held to it: both are
    sums of terms that cancel (reference::mlstm::MlstmGrads::gate_grad_scale), so their relative
    error measures the cancellation more than either kernel.
A chunk size TFLA fails at (an exception) is recorded with its error and the others still run.
Like fla's, TFLA's times may move between processes, so every timing runs in --processes (at
least 3) separate Python processes: this script re-invokes itself with --worker for one shape at a
time, the shapes taking turns round by round (round r times every shape once before round r + 1
starts). Each process loads the inputs and then, per chunk size, checks agreement, times the
forward and times the forward+backward. Per chunk size the median of the per-process medians is
kept; the row reports the best (smallest) of those for the forward and, separately, for the
forward+backward, with the chunk size that gave it. A shape whose process fails (no GPU,
mlstm_kernels missing, a bad file) is not tried again in later rounds.

Output JSON: device (ours.json's), torch_device, commit (env LASP_COMMIT), date (env LASP_DATE),
method, hbm_bytes_per_s, hbm_floor, versions (torch, triton, mlstm_kernels),
tolerance_rel_err_vs_tfla, tfla_chunk_sizes, processes, errors and single_gpu: one row per shape
with B, T, H, D (= Dk), Dv, chunk (ours: 64-token chunks on chip) and ours_segment_tokens (the
tokens of one of our segments, chunks_per_segment * 64), ours_fwd_ms, ours_fwd_min_ms,
tfla_fwd_ms and tfla_chunk (the best chunk size's median of per-process medians, and that chunk
size), ours_fwdbwd_ms and ours_bwd_ms (null where ours.json has none), tfla_fwdbwd_ms and
tfla_fwdbwd_chunk (the same for forward+backward), speedup_fwdbwd (tfla_fwdbwd_ms /
ours_fwdbwd_ms), grad_rel_err_vs_tfla (per gradient, the largest over processes at the chunk
size where it is smallest), hbm_floor_fwd_ms (q, k, v read and h written once in bf16, i and f read once
in fp32, over the device's HBM bandwidth: H100 SXM 3.35e12 B/s, H200 4.8e12 B/s, from
torch.cuda.get_device_name; --hbm-bytes-per-s overrides), floor_fraction_fwd
(hbm_floor_fwd_ms / ours_fwd_ms), speedup_fwd (tfla_fwd_ms / ours_fwd_ms), rel_err_vs_tfla (the
largest over processes and chunk sizes), the per-process medians and minima at the reported chunk
sizes, and tfla_per_chunk: per chunk size its medians, per-process medians and minima, and largest
rel err.

Needs torch with CUDA and mlstm_kernels 2.0.6 (its wheel unpacked on PYTHONPATH, einops beside it:
importing its triton_xl_chunk module runs its chunkwise package's __init__, which imports einops).
Exit status: 0 when every shape ran in every process at every chunk size (forward and, unless
--no-backward, forward+backward) and agreed; 1 otherwise (the JSON is written either way, with null
where TFLA could not run); 2 for bad arguments or an unreadable dump.
"""
import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from fla_forward import time_calls  # this folder's: median and minimum ms between CUDA events
# this folder's GLA comparison: the HBM bandwidth table, the dump loader, the error norm and the
# worker-process plumbing are the same here
from fla_gla import (WORKER_TAG, _fmt, _ratio, _round, _version, hbm_bytes_per_s, load, median_of,
                     rel_err, run_worker)

TOL = 1e-2
MIN_PROCESSES = 3
DEFAULT_CHUNK_SIZES = "64,128,256"
# Tokens per chunk of our on-chip loop (the kernels' LASP_MLSTM_CHUNK).
OUR_CHUNK_TOKENS = 64
SHAPE_KEYS = ("name", "B", "T", "H", "Dk", "Dv", "scale", "eps", "ours_fwd_ms", "chunks_per_segment")
TFLA_MODULE = "mlstm_kernels.torch.chunkwise.triton_xl_chunk"


# ---------------------------------------------------------------------------------------------
# Pure parts (no torch needed): checked by --self-test on CPU.
# ---------------------------------------------------------------------------------------------

def parse_ours(ours):
    """Validate ours.json's content; returns its shape rows."""
    if not isinstance(ours, dict) or not isinstance(ours.get("shapes"), list) or not ours["shapes"]:
        raise ValueError("ours.json: expected an object with a non-empty 'shapes' list")
    rows, names = [], set()
    for i, row in enumerate(ours["shapes"]):
        missing = [key for key in SHAPE_KEYS if key not in row]
        if missing:
            raise ValueError(f"ours.json shapes[{i}]: missing {', '.join(missing)}")
        for key in ("B", "T", "H", "Dk", "Dv", "chunks_per_segment"):
            if not isinstance(row[key], int) or row[key] <= 0:
                raise ValueError(f"ours.json shapes[{i}]: {key} = {row[key]!r} is not a positive integer")
        if row["name"] in names or "/" in row["name"] or row["name"] in ("", ".", ".."):
            raise ValueError(f"ours.json shapes[{i}]: bad or repeated name {row['name']!r}")
        names.add(row["name"])
        rows.append(dict(row, scale=float(row["scale"]), eps=float(row["eps"])))
    return rows


def scale_error(shape):
    """Why TFLA cannot run this shape's dump (its qk scale is fixed at Dk^-0.5), or None."""
    want = shape["Dk"] ** -0.5
    if abs(shape["scale"] - want) > 1e-6 * want:
        return (f"{shape['name']}: dump scale {shape['scale']} is not Dk^-0.5 = {want:.9g}, the only "
                f"scale TFLA computes with; not run")
    return None


def parse_chunk_sizes(text):
    """--chunk-sizes: distinct positive integers, comma-separated."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. {DEFAULT_CHUNK_SIZES}")
    if any(c <= 0 for c in sizes) or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: chunk sizes must be positive and distinct")
    return sizes


def fwd_bytes(B, T, H, Dk, Dv):
    """q, k, v read and h written once in bf16, i and f read once in fp32."""
    n = B * T * H
    return 2 * (2 * n * Dk + 2 * n * Dv) + 8 * n


def hbm_floor_ms(B, T, H, Dk, Dv, bw):
    return None if not bw else fwd_bytes(B, T, H, Dk, Dv) / bw * 1e3


def worst_err(errs):
    """The largest rel err, or None when there is none or any is missing or not finite."""
    if not errs or any(e is None or not math.isfinite(e) for e in errs):
        return None
    return float(f"{max(errs):.4e}")


GRADS = ("dq", "dk", "dv", "di", "df")
# The gradients held to TOL against TFLA; di and df are recorded only (the module doc).
CHECKED_GRADS = ("dq", "dk", "dv")


def worst_grad_errs(per_chunk_errs):
    """Per gradient, the largest rel err over the dicts given (None where one lacks it), or None
    where no dict has gradients."""
    have = [e for e in per_chunk_errs if e]
    if not have:
        return None
    return {g: worst_err([e.get(g) for e in have]) for g in GRADS}


def best_grad_errs(per_chunk):
    """Per gradient, the smallest over chunk sizes of per_chunk[c]["grad_rel_err"] (each already the
    worst over processes), or None where no chunk size has gradients."""
    have = [c["grad_rel_err"] for c in per_chunk.values() if c.get("grad_rel_err")]
    if not have:
        return None
    best = {}
    for g in GRADS:
        errs = [e[g] for e in have if e.get(g) is not None]
        best[g] = min(errs) if errs else None
    return best


def grad_failures(name, best):
    """The checked gradients that agree with TFLA at no chunk size."""
    return [f"{name}: {g} rel err vs TFLA {best[g]} > {TOL:.0e} at every chunk size" for g in CHECKED_GRADS
            if best and (best[g] is None or not math.isfinite(best[g]) or best[g] > TOL)]


def chunk_summary(name, chunk, good, need_backward):
    """One chunk size over the processes that ran: (summary dict, the rel errs checked, failure
    strings)."""
    per = [(r.get("process", "?"), r.get("chunks", {}).get(str(chunk), {})) for r in good]
    failures = []
    for process, c in per:
        if c.get("fwd_ms") is None:
            failures.append(f"{name}: process {process}: TFLA forward at chunk size {chunk} did not run: "
                            f"{c.get('fwd_error', 'no time reported')}")
        if need_backward and c.get("fwdbwd_ms") is None:
            failures.append(f"{name}: process {process}: TFLA forward+backward at chunk size {chunk} did not "
                            f"run: {c.get('fwdbwd_error', 'no time reported')}")
    # A forward that failed is reported above; its missing rel err would only repeat that.
    errs = [c.get("rel_err") for _, c in per if "fwd_error" not in c]
    bad = [e for e in errs if e is None or not math.isfinite(e) or e > TOL]
    if bad:
        failures.append(f"{name}: chunk size {chunk}: rel err vs TFLA "
                        f"{max(bad, key=lambda e: -1 if e is None else e)} > {TOL:.0e} (per process: {errs})")
    values = {key: [c.get(key) for _, c in per] for key in ("fwd_ms", "fwd_min_ms", "fwdbwd_ms", "fwdbwd_min_ms")}
    summary = dict(
        fwd_ms=_round(median_of(values["fwd_ms"])),
        fwdbwd_ms=_round(median_of(values["fwdbwd_ms"])),
        rel_err=worst_err(errs),
        grad_rel_err=worst_grad_errs([c.get("grad_rel_err") for _, c in per]),
        tfla_self_rel_err=worst_grad_errs([c.get("tfla_self_rel_err") for _, c in per]),
        fwd_ms_per_process=[_round(x) for x in values["fwd_ms"]],
        fwd_min_ms_per_process=[_round(x) for x in values["fwd_min_ms"]],
        fwdbwd_ms_per_process=[_round(x) for x in values["fwdbwd_ms"]],
        fwdbwd_min_ms_per_process=[_round(x) for x in values["fwdbwd_min_ms"]],
    )
    return summary, errs, failures


def best_chunk(per_chunk, key):
    """The chunk size with the smallest per_chunk[c][key] (the first on ties), or None."""
    timed = [c for c in per_chunk if per_chunk[c][key] is not None]
    return min(timed, key=lambda c: per_chunk[c][key]) if timed else None


def assemble_row(shape, results, bw, chunk_sizes, need_backward=True, processes=MIN_PROCESSES):
    """One single_gpu row from a shape of ours.json and its workers' results (dicts, one per
    process; a failed process is a dict with 'error'). Returns (row, list of failure strings)."""
    name = shape["name"]
    failures = [e for e in (scale_error(shape),) if e]
    good = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            failures.append(f"{name}: process {r.get('process', '?')}: {r['error']}")
    if len(results) < processes:
        failures.append(f"{name}: {len(results)} of {processes} processes ran")
    per_chunk, all_errs = {}, []
    for chunk in chunk_sizes:
        summary, errs, fails = chunk_summary(name, chunk, good, need_backward)
        per_chunk[str(chunk)] = summary
        all_errs += errs
        failures += fails
    failures += grad_failures(name, best_grad_errs(per_chunk))
    fwd_chunk = best_chunk(per_chunk, "fwd_ms")
    fb_chunk = best_chunk(per_chunk, "fwdbwd_ms")
    fwd = per_chunk[fwd_chunk] if fwd_chunk else {}
    fb = per_chunk[fb_chunk] if fb_chunk else {}
    B, T, H, Dk, Dv = shape["B"], shape["T"], shape["H"], shape["Dk"], shape["Dv"]
    floor = hbm_floor_ms(B, T, H, Dk, Dv, bw)
    ours_fwd = shape["ours_fwd_ms"]
    row = dict(
        B=B, T=T, H=H, D=Dk, Dv=Dv,
        chunk=OUR_CHUNK_TOKENS, ours_segment_tokens=shape["chunks_per_segment"] * OUR_CHUNK_TOKENS,
        ours_fwd_ms=ours_fwd, ours_fwd_min_ms=shape.get("ours_fwd_min_ms"),
        tfla_fwd_ms=fwd.get("fwd_ms"), tfla_chunk=int(fwd_chunk) if fwd_chunk else None,
        ours_fwdbwd_ms=shape.get("ours_fwdbwd_ms"), ours_bwd_ms=shape.get("ours_bwd_ms"),
        tfla_fwdbwd_ms=fb.get("fwdbwd_ms"), tfla_fwdbwd_chunk=int(fb_chunk) if fb_chunk else None,
        speedup_fwdbwd=_ratio(fb.get("fwdbwd_ms"), shape.get("ours_fwdbwd_ms")),
        grad_rel_err_vs_tfla=best_grad_errs(per_chunk),
        hbm_floor_fwd_ms=_round(floor),
        floor_fraction_fwd=_ratio(floor, ours_fwd),
        speedup_fwd=_ratio(fwd.get("fwd_ms"), ours_fwd),
        rel_err_vs_tfla=worst_err(all_errs),
        tfla_fwd_ms_per_process=fwd.get("fwd_ms_per_process", []),
        tfla_fwd_min_ms_per_process=fwd.get("fwd_min_ms_per_process", []),
        tfla_fwdbwd_ms_per_process=fb.get("fwdbwd_ms_per_process", []),
        tfla_fwdbwd_min_ms_per_process=fb.get("fwdbwd_min_ms_per_process", []),
        tfla_per_chunk=per_chunk,
        name=name, scale=shape["scale"], eps=shape["eps"],
        num_segments=shape.get("num_segments"), chunks_per_segment=shape["chunks_per_segment"],
    )
    for key in ("ours_fwd_ms_per_process", "ours_fwdbwd_ms_per_process"):
        if key in shape:
            row[key] = shape[key]
    return row, failures


def build_result(ours, rows, failures, worker_info, bw, chunk_sizes, processes, args_desc):
    """The output JSON object."""
    return {
        "device": ours.get("device"),
        "torch_device": worker_info.get("device_name"),
        "commit": os.environ.get("LASP_COMMIT", ours.get("commit", "unknown")),
        "date": os.environ.get("LASP_DATE", ours.get("date", "unknown")),
        "method": (ours.get("method", "ours: as recorded in ours.json") + "; TFLA: " + args_desc),
        "hbm_bytes_per_s": bw,
        "hbm_floor": "(q, k, v read + h written once in bf16, i, f read once in fp32) / hbm_bytes_per_s "
                     "(spec bandwidth by device name: H100 SXM 3.35e12, H200 4.8e12 B/s)",
        "versions": {k: worker_info.get(k) for k in ("torch", "triton", "mlstm_kernels")},
        "tolerance_rel_err_vs_tfla": TOL,
        "tfla_chunk_sizes": chunk_sizes,
        "processes": processes,
        "errors": failures,
        "single_gpu": rows,
    }


# ---------------------------------------------------------------------------------------------
# GPU parts.
# ---------------------------------------------------------------------------------------------

def import_tfla():
    """TFLA's chunkwise forward+backward and mlstm_kernels' version; RuntimeError saying what to
    install when the import fails."""
    try:
        import mlstm_kernels
        from mlstm_kernels.torch.chunkwise.triton_xl_chunk import mlstm_chunkwise__xl_chunk
    except Exception as e:
        raise RuntimeError(f"cannot import {TFLA_MODULE} ({type(e).__name__}: {e}); put the mlstm_kernels "
                           f"2.0.6 wheel's contents and einops on PYTHONPATH") from e
    return mlstm_chunkwise__xl_chunk, getattr(mlstm_kernels, "__version__", "unknown")


def to_tfla_layout(x):
    """[B, T, H, ...] -> TFLA's [B, H, T, ...], contiguous."""
    return x.transpose(1, 2).contiguous()


def _error_text(e, limit=300):
    return f"{type(e).__name__}: {str(e)[:limit]}"


def measure_chunk(tfla, inputs, leaves, h_ours, dh, grads_ours, first_grads, eps, chunk, args, torch):
    """At one chunk size: rel err of ours against TFLA (h, and the gradients where grads_ours, a
    dict by GRADS name in TFLA's layout, and TFLA's against first_grads, the first chunk size's,
    which an empty dict receives), then TFLA's forward and forward+backward times. A failure is
    recorded (fwd_error, fwdbwd_error) rather than raised."""
    out = {}

    def fwd():
        return tfla(*inputs, eps=eps, chunk_size=chunk)

    try:
        with torch.no_grad():
            h = fwd()
            torch.cuda.synchronize()
            out["rel_err"] = rel_err(h_ours, h)
            del h
            out["fwd_ms"], out["fwd_min_ms"] = time_calls(fwd, args.warmup, args.iters, torch)
    except Exception as e:
        out["fwd_error"] = _error_text(e)
    if not args.no_backward:
        def fwdbwd():
            return torch.autograd.grad(tfla(*leaves, eps=eps, chunk_size=chunk), leaves, dh)

        try:
            if grads_ours:
                grads = fwdbwd()
                out["grad_rel_err"] = {g: rel_err(grads_ours[g], x) for g, x in zip(GRADS, grads)}
                if first_grads:
                    out["tfla_self_rel_err"] = {g: rel_err(first_grads[g], x) for g, x in zip(GRADS, grads)}
                else:
                    first_grads.update(zip(GRADS, grads))
                del grads
            out["fwdbwd_ms"], out["fwdbwd_min_ms"] = time_calls(fwdbwd, args.warmup, args.iters, torch)
        except Exception as e:
            out["fwdbwd_error"] = _error_text(e)
    return out


def worker(args):
    """One process, one shape: per chunk size, check agreement and time TFLA's forward and
    forward+backward."""
    import torch

    res = {"name": args.worker, "process": args.process}
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no GPU: run this on the GPU node")
        tfla, tfla_version = import_tfla()
        res.update(device_name=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=_version("triton"), mlstm_kernels=tfla_version)
        shape = {s["name"]: s for s in parse_ours(json.loads((args.dump / "ours.json").read_text()))}[args.worker]
        d = args.dump / shape["name"]
        B, T, H, Dk, Dv = (shape[k] for k in ("B", "T", "H", "Dk", "Dv"))
        dev = torch.device("cuda")

        def tensor(file, dtype, *last):
            return to_tfla_layout(load(d / file, dtype, (B, T, H, *last), torch).to(dev))

        inputs = (tensor("q.bin", torch.bfloat16, Dk), tensor("k.bin", torch.bfloat16, Dk),
                  tensor("v.bin", torch.bfloat16, Dv), tensor("i.bin", torch.float32),
                  tensor("f.bin", torch.float32))
        h_ours = tensor("h.bin", torch.bfloat16, Dv)
        # detach() shares the inputs' storage: leaves for the backward without copying the inputs.
        leaves = [x.detach().requires_grad_() for x in inputs]
        grads_ours = None
        if (d / "dh.bin").exists():
            dh = tensor("dh.bin", torch.bfloat16, Dv)
            grads_ours = dict(dq=tensor("dq.bin", torch.bfloat16, Dk), dk=tensor("dk.bin", torch.bfloat16, Dk),
                              dv=tensor("dv.bin", torch.bfloat16, Dv), di=tensor("di.bin", torch.float32),
                              df=tensor("df.bin", torch.float32))
        else:
            gen = torch.Generator(device=dev).manual_seed(0)
            dh = torch.randn(B, H, T, Dv, device=dev, generator=gen).to(torch.bfloat16)
        first_grads = {}
        res["chunks"] = {str(c): measure_chunk(tfla, inputs, leaves, h_ours, dh, grads_ours, first_grads,
                                               shape["eps"], c, args, torch)
                         for c in args.chunk_sizes}
    except Exception as e:
        res["error"] = _error_text(e, 500)
    print(WORKER_TAG + json.dumps(res), flush=True)
    return 0 if "error" not in res else 1


def _fmt_chunks(res):
    parts = []
    for c, m in res.get("chunks", {}).items():
        fwd = _fmt(m.get("fwd_ms")) if "fwd_error" not in m else f"failed ({m['fwd_error']})"
        fb = _fmt(m.get("fwdbwd_ms")) if "fwdbwd_error" not in m else f"failed ({m['fwdbwd_error']})"
        grads = ", ".join(f"{g} {_fmt(e)}" for g, e in (m.get("grad_rel_err") or {}).items())
        parts.append(f"C={c}: fwd {fwd} ms, fwd+bwd {fb} ms, rel err vs ours {_fmt(m.get('rel_err'))}"
                     + (f" (grads: {grads})" if grads else ""))
    return "; ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", type=Path, help="directory mlstm_bench --dump wrote (ours.json + one folder per shape)")
    ap.add_argument("--out", type=Path, default=Path("benches/results/mlstm.json"))
    ap.add_argument("--processes", type=int, default=MIN_PROCESSES,
                    help=f"separate Python processes timing TFLA per shape (at least {MIN_PROCESSES})")
    ap.add_argument("--chunk-sizes", type=parse_chunk_sizes, default=parse_chunk_sizes(DEFAULT_CHUNK_SIZES),
                    help=f"TFLA chunk sizes to time, comma-separated (default {DEFAULT_CHUNK_SIZES})")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this shape of ours.json (repeatable)")
    ap.add_argument("--no-backward", action="store_true", help="time TFLA's forward only")
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
        ap.error(f"--processes must be at least {MIN_PROCESSES}: TFLA's times may vary between processes")

    ours_path = args.dump / "ours.json"
    if not ours_path.exists():
        print(f"tfla_mlstm: {ours_path} not found: run mlstm_bench --dump {args.dump} first", file=sys.stderr)
        return 2
    ours = json.loads(ours_path.read_text())
    try:
        shapes = parse_ours(ours)
    except ValueError as e:
        print(f"tfla_mlstm: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {s["name"] for s in shapes})
        if unknown:
            print(f"tfla_mlstm: --only {', '.join(unknown)}: not in {ours_path}", file=sys.stderr)
            return 2
        shapes = [s for s in shapes if s["name"] in args.only]

    chunks_arg = ",".join(str(c) for c in args.chunk_sizes)
    results = {s["name"]: [] for s in shapes}
    for r in range(1, args.processes + 1):
        for s in shapes:
            if scale_error(s) or any("error" in x for x in results[s["name"]]):
                continue  # its first failure is reported; the rest would repeat it
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", s["name"], "--process", str(r),
                   "--dump", str(args.dump), "--warmup", str(args.warmup), "--iters", str(args.iters),
                   "--chunk-sizes", chunks_arg]
            if args.no_backward:
                cmd.append("--no-backward")
            res = run_worker(cmd, args.worker_timeout)
            res["process"] = r  # 1-based
            results[s["name"]].append(res)
            msg = res.get("error") or _fmt_chunks(res)
            print(f"tfla_mlstm: process {r}/{args.processes} {s['name']}: {msg} ({res.get('wall_s')} s)", flush=True)

    worker_info = next((x for rs in results.values() for x in rs if "device_name" in x), {})
    bw = args.hbm_bytes_per_s or hbm_bytes_per_s(worker_info.get("device_name"))
    failures, rows = [], []
    for s in shapes:
        row, fails = assemble_row(s, results[s["name"]], bw, args.chunk_sizes,
                                  need_backward=not args.no_backward, processes=args.processes)
        rows.append(row)
        failures += fails
        print(f"B={row['B']} T={row['T']} H={row['H']} D={row['D']}: fwd ours {row['ours_fwd_ms']} ms, "
              f"TFLA {_fmt(row['tfla_fwd_ms'])} ms at C={row['tfla_chunk']} (TFLA / ours "
              f"{_fmt(row['speedup_fwd'])}); fwd+bwd ours {_fmt(row['ours_fwdbwd_ms'])} ms, TFLA "
              f"{_fmt(row['tfla_fwdbwd_ms'])} ms at C={row['tfla_fwdbwd_chunk']} (TFLA / ours "
              f"{_fmt(row['speedup_fwdbwd'])}), grad rel errs {row['grad_rel_err_vs_tfla']}; HBM floor {_fmt(row['hbm_floor_fwd_ms'])} ms "
              f"({_fmt(row['floor_fraction_fwd'])} of ours); rel err vs TFLA {_fmt(row['rel_err_vs_tfla'])}",
              flush=True)
    if bw is None:
        failures.append(f"unknown HBM bandwidth for {worker_info.get('device_name')!r}: pass --hbm-bytes-per-s")
    desc = (f"{TFLA_MODULE}.mlstm_chunkwise__xl_chunk(q, k, v, i, f, eps, chunk_size=C) for C in "
            f"{chunks_arg}, on the same inputs moved once into its [B, H, T, D] layout, after ours, in "
            f"{args.processes} separate Python processes per shape (shapes in turns, round by round); in "
            f"each, per C: {args.warmup} warm-up calls, then {args.iters} calls enqueued back to back on one "
            f"stream, each between two CUDA events, median; forward under torch.no_grad; forward+backward = "
            f"forward + torch.autograd.grad of (q, k, v, i, f) with the dump's dh; per C the median of "
            f"the per-process medians; row = the best C's; ours: mlstm_bench, forward+backward = the "
            f"forward saving its rows + the backward, three processes, the median of their medians")
    result = build_result(ours, rows, failures, worker_info, bw, args.chunk_sizes, args.processes, desc)
    if worker_info.get("device_name") and ours.get("device") and worker_info["device_name"] != ours["device"]:
        result["warnings"] = [f"ours.json was measured on {ours['device']!r}, TFLA on {worker_info['device_name']!r}"]
        print(f"tfla_mlstm: warning: {result['warnings'][0]}", file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"tfla_mlstm: wrote {args.out}", flush=True)
    if failures:
        print("tfla_mlstm: FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
        return 1
    return 0


def self_test():
    """CPU checks of the pure parts and of the argument handling."""
    shape = dict(name="b4_t8192_h16_d128", B=4, T=8192, H=16, Dk=128, Dv=128, scale=0.088388346,
                 eps=1e-6, ours_fwd_ms=0.3, ours_fwd_min_ms=0.29, num_segments=2, chunks_per_segment=64)
    [s] = parse_ours({"device": "x", "shapes": [shape]})
    assert s["scale"] == 0.088388346 and s["eps"] == 1e-6
    for bad in ({"shapes": []}, {"shapes": [dict(shape, B=0)]}, {"shapes": [shape, shape]},
                {"shapes": [{k: v for k, v in shape.items() if k != "eps"}]},
                {"shapes": [dict(shape, chunks_per_segment=0)]}, {"shapes": [dict(shape, name="../x")]}):
        try:
            parse_ours(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"parse_ours accepted {bad}")
    # the dump's f32 scale is Dk^-0.5 rounded to f32: accepted; another scale is not
    assert scale_error(s) is None
    assert "not Dk^-0.5" in scale_error(dict(s, scale=0.1))
    assert scale_error(dict(s, Dk=64, scale=0.125)) is None

    assert parse_chunk_sizes(DEFAULT_CHUNK_SIZES) == [64, 128, 256]
    assert parse_chunk_sizes("128") == [128]
    for bad in ("", "64,,128", "a", "0", "-64", "64,64", "64.5"):
        try:
            parse_chunk_sizes(bad)
        except argparse.ArgumentTypeError:
            pass
        else:
            raise AssertionError(f"parse_chunk_sizes accepted {bad!r}")

    assert hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert hbm_bytes_per_s("NVIDIA A100-SXM4-80GB") is None
    # B=4 T=8K H=16 D=128: q, k, v, h 128 MiB each in bf16, i and f 2 MiB each in fp32 = 516 MiB
    assert fwd_bytes(4, 8192, 16, 128, 128) == 516 * 2 ** 20
    assert fwd_bytes(1, 1, 1, 64, 128) == 2 * (2 * 64 + 2 * 128) + 8
    assert abs(hbm_floor_ms(4, 8192, 16, 128, 128, 3.35e12) - 516 * 2 ** 20 / 3.35e9) < 1e-12
    assert hbm_floor_ms(4, 8192, 16, 128, 128, None) is None

    sizes = [64, 128, 256]

    def chunk(fwd, fb, err=5e-3):
        return dict(rel_err=err, fwd_ms=fwd, fwd_min_ms=fwd - 0.01, fwdbwd_ms=fb, fwdbwd_min_ms=fb - 0.1)

    # per process: C=64 is the fastest forward, C=256 the fastest forward+backward
    ok = [dict(process=p + 1, chunks={"64": chunk(0.6 + d, 5.0 + d), "128": chunk(0.7 + d, 4.0 + d),
                                      "256": chunk(0.9 + d, 3.0 + d, err=7e-3)})
          for p, d in enumerate([0.2, 0.0, 0.1])]
    row, fails = assemble_row(s, ok, 3.35e12, sizes)
    assert not fails, fails
    assert row["tfla_chunk"] == 64 and row["tfla_fwd_ms"] == 0.7, row
    assert row["tfla_fwdbwd_chunk"] == 256 and row["tfla_fwdbwd_ms"] == 3.1, row
    assert row["tfla_fwd_ms_per_process"] == [0.8, 0.6, 0.7]
    assert row["tfla_fwd_min_ms_per_process"] == [0.79, 0.59, 0.69]
    assert row["tfla_fwdbwd_ms_per_process"] == [3.2, 3.0, 3.1]
    assert row["tfla_per_chunk"]["128"]["fwd_ms"] == 0.8 and row["tfla_per_chunk"]["128"]["fwdbwd_ms"] == 4.1
    assert row["tfla_per_chunk"]["64"]["rel_err"] == 5e-3 and row["rel_err_vs_tfla"] == 7e-3
    assert row["chunk"] == 64 and row["ours_segment_tokens"] == 4096
    assert row["ours_fwdbwd_ms"] is None and row["ours_fwd_min_ms"] == 0.29
    assert row["speedup_fwdbwd"] is None and row["grad_rel_err_vs_tfla"] is None
    assert row["speedup_fwd"] == round(0.7 / 0.3, 4)
    assert row["hbm_floor_fwd_ms"] == round(516 * 2 ** 20 / 3.35e9, 5)
    assert row["floor_fraction_fwd"] == round(516 * 2 ** 20 / 3.35e9 / 0.3, 4)
    for k in ("B", "T", "H", "D", "Dv", "chunk", "ours_segment_tokens", "ours_fwd_ms", "tfla_fwd_ms",
              "tfla_chunk", "ours_fwdbwd_ms", "tfla_fwdbwd_ms", "tfla_fwdbwd_chunk", "hbm_floor_fwd_ms",
              "floor_fraction_fwd", "speedup_fwd", "rel_err_vs_tfla", "tfla_per_chunk"):
        assert k in row, k
    assert "ours_fwd_ms_per_process" not in row
    # with our backward: its time, the speedup and the worst gradient errors; dq above TOL fails,
    # df above it does not (recorded only)
    errs = dict(dq=3e-3, dk=4e-3, dv=2e-3, di=0.2, df=0.5)
    graded = [dict(r, chunks={c: dict(m, grad_rel_err=dict(errs, dk=errs["dk"] + 1e-3 * p))
                              for c, m in r["chunks"].items()}) for p, r in enumerate(ok)]
    row, fails = assemble_row(dict(s, ours_fwdbwd_ms=1.0, ours_bwd_ms=0.7), graded, 3.35e12, sizes)
    assert not fails, fails
    assert row["ours_fwdbwd_ms"] == 1.0 and row["ours_bwd_ms"] == 0.7 and row["speedup_fwdbwd"] == 3.1, row
    assert row["grad_rel_err_vs_tfla"] == dict(errs, dk=6e-3), row["grad_rel_err_vs_tfla"]
    # dq off at one chunk size only (TFLA's chunk sizes may disagree with each other): reported,
    # not a failure; off at every chunk size: a failure
    graded[1]["chunks"]["128"]["grad_rel_err"]["dq"] = 2e-2
    row, fails = assemble_row(dict(s, ours_fwdbwd_ms=1.0), graded, 3.35e12, sizes)
    assert not fails and row["tfla_per_chunk"]["128"]["grad_rel_err"]["dq"] == 2e-2, (fails, row)
    assert row["grad_rel_err_vs_tfla"]["dq"] == 3e-3, row["grad_rel_err_vs_tfla"]
    for c in ("64", "256"):
        graded[1]["chunks"][c]["grad_rel_err"]["dq"] = 3e-2
    _, fails = assemble_row(dict(s, ours_fwdbwd_ms=1.0), graded, 3.35e12, sizes)
    assert len(fails) == 1 and "dq rel err" in fails[0] and "every chunk size" in fails[0], fails
    row, _ = assemble_row(dict(s, ours_fwd_ms_per_process=[0.3, 0.31, 0.29]), ok, None, sizes)
    assert row["ours_fwd_ms_per_process"] == [0.3, 0.31, 0.29] and row["hbm_floor_fwd_ms"] is None

    # a chunk size that failed in one process: a failure, the other chunk sizes still reported
    failed = [dict(ok[0], chunks=dict(ok[0]["chunks"], **{"64": {"fwd_error": "AssertionError: x",
                                                               "fwdbwd_error": "AssertionError: x"}}))] + ok[1:]
    row, fails = assemble_row(s, failed, 3.35e12, sizes)
    assert len(fails) == 2 and all("chunk size 64" in f and "AssertionError: x" in f for f in fails), fails
    assert row["tfla_chunk"] == 64 and row["tfla_fwd_ms"] == 0.65 and row["rel_err_vs_tfla"] == 7e-3, row
    # a chunk size that failed everywhere: the best of the others
    failed = [dict(r, chunks=dict(r["chunks"], **{"64": {"fwd_error": "E", "fwdbwd_error": "E"}})) for r in ok]
    row, fails = assemble_row(s, failed, 3.35e12, sizes)
    assert len(fails) == 6 and row["tfla_chunk"] == 128 and row["tfla_fwd_ms"] == 0.8, (fails, row)
    assert row["tfla_per_chunk"]["64"]["fwd_ms"] is None and row["tfla_per_chunk"]["64"]["rel_err"] is None
    # forward only: no forward+backward failure, no forward+backward time
    fwd_only = [dict(r, chunks={c: {k: v for k, v in m.items() if not k.startswith("fwdbwd")}
                                for c, m in r["chunks"].items()}) for r in ok]
    row, fails = assemble_row(s, fwd_only, 3.35e12, sizes, need_backward=False)
    assert not fails and row["tfla_fwdbwd_ms"] is None and row["tfla_fwdbwd_chunk"] is None, (fails, row)
    _, fails = assemble_row(s, fwd_only, 3.35e12, sizes)
    assert len(fails) == 9 and "no time reported" in fails[0], fails
    # disagreement, a non-finite error, a failed process, too few processes, a wrong scale
    bad_err = [dict(ok[0], chunks=dict(ok[0]["chunks"], **{"128": chunk(0.7, 4.0, err=1.5e-2)}))] + ok[1:]
    row, fails = assemble_row(s, bad_err, 3.35e12, sizes)
    assert len(fails) == 1 and "chunk size 128: rel err vs TFLA 0.015 > 1e-02" in fails[0], fails
    assert row["rel_err_vs_tfla"] == 1.5e-2
    nan_err = [dict(ok[0], chunks=dict(ok[0]["chunks"], **{"128": chunk(0.7, 4.0, err=float("nan"))}))] + ok[1:]
    row, fails = assemble_row(s, nan_err, 3.35e12, sizes)
    assert len(fails) == 1 and row["rel_err_vs_tfla"] is None, fails
    _, fails = assemble_row(s, [ok[0], {"process": 2, "error": "boom"}, ok[2]], 3.35e12, sizes)
    assert len(fails) == 1 and "process 2: boom" in fails[0], fails
    _, fails = assemble_row(s, ok[:2], 3.35e12, sizes)
    assert len(fails) == 1 and "2 of 3" in fails[0], fails
    row, fails = assemble_row(dict(s, scale=0.1), [], 3.35e12, sizes)
    assert len(fails) == 2 and "not Dk^-0.5" in fails[0] and "0 of 3" in fails[1], fails
    assert row["tfla_fwd_ms"] is None and row["tfla_chunk"] is None and row["speedup_fwd"] is None

    result = build_result({"device": "NVIDIA H100", "commit": "c"}, [row], [], {
        "device_name": "NVIDIA H100", "torch": "t", "triton": "tr", "mlstm_kernels": "2.0.6"},
        3.35e12, sizes, 3, "m")
    json.dumps(result)
    for k in ("device", "torch_device", "commit", "date", "method", "hbm_bytes_per_s", "hbm_floor",
              "tolerance_rel_err_vs_tfla", "processes", "errors", "single_gpu"):
        assert k in result, k
    assert result["versions"] == {"torch": "t", "triton": "tr", "mlstm_kernels": "2.0.6"}

    # argument handling: bad arguments and unreadable dumps exit with 2 before any worker starts
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp)
        (dump / "bad").mkdir()
        (dump / "bad" / "ours.json").write_text(json.dumps({"shapes": []}))
        (dump / "good").mkdir()
        (dump / "good" / "ours.json").write_text(json.dumps({"shapes": [shape]}))
        for argv in ([], ["--dump", tmp, "--processes", "2"], ["--dump", tmp, "--chunk-sizes", "64,x"],
                     ["--dump", tmp, "--iters", "0"], ["--dump", tmp, "--warmup", "-1"],
                     ["--dump", tmp], ["--dump", str(dump / "bad")],
                     ["--dump", str(dump / "good"), "--only", "b1_t1_h1_d1"]):
            with contextlib.redirect_stderr(io.StringIO()):
                try:
                    code = main(argv)
                except SystemExit as e:
                    code = e.code
            assert code == 2, (argv, code)

    # the layout change, with torch on CPU when torch is importable
    try:
        import torch
    except ImportError:
        print("tfla_mlstm self-test: torch not importable, skipped to_tfla_layout")
    else:
        x = torch.arange(2 * 3 * 4 * 5).view(2, 3, 4, 5)
        y = to_tfla_layout(x)
        assert y.shape == (2, 4, 3, 5) and y.is_contiguous() and y[1, 2, 0, 3] == x[1, 0, 2, 3]
        g = to_tfla_layout(x[..., 0])
        assert g.shape == (2, 4, 3) and g[1, 3, 2] == x[1, 2, 3, 0]
    print("tfla_mlstm self-test: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
