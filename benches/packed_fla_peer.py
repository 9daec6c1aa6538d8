"""Packed documents on one GPU beside fla's cu_seqlens path: lasp_shmem.torch's chunk_simple_gla
and chunk_gated_delta_rule against fla's, both against the float64 recurrence of each document
on its own, forward (fla's backwards, simple GLA's and Gated DeltaNet's, refuse to run with Triton
3.6 on Hopper, fla #640).

    LASP_SHMEM_LIB=... PYTHONPATH=python:python/tests python3 benches/packed_fla_peer.py --out peer.json

Cases (B = 1, as fla packs; H = 2, Dk = Dv = 128): documents of 1, 63, 64, 65 and 90 tokens (283
in all, packed_lasp2's W = 1 layout), the short documents of 1 to 200 tokens in turn over 283
tokens, and documents of 64 to 8192 tokens (log-uniform) over 16384. Inputs as
tests/reference.py's delta_inputs draws them (unit keys, g = logsigmoid / 16, beta = sigmoid).
Per case and family: rel_err_vs_fla = ||o_ours - o_fla|| / ||o_fla||, rel_err_vs_f64 and
fla_rel_err_vs_f64 the same against the float64 per-document recurrence (short cases only: it
runs token by token). Needs fla-core 0.6.0 and einops importable. Exit status 1 when ours is
further than 5e-3 from the float64 recurrence.
"""
import argparse
import json
import math
import random
import sys

import torch
from reference import delta_inputs, delta_recurrent, recurrent, rel_err

import lasp_shmem.torch as lt

TOL = 5e-3


def layouts():
    short, t = [0], 283
    cycle = [1, 63, 64, 65, 17, 200]
    while short[-1] < t:
        short.append(min(short[-1] + cycle[(len(short) - 1) % len(cycle)], t))
    rng = random.Random(5)
    mixed, total = [0], 16384
    while mixed[-1] < total:
        mixed.append(min(mixed[-1] + int(64 * 128 ** rng.random()), total))
    return [("boundary", [0, 1, 64, 128, 193, 283]), ("short", short), ("mixed", mixed)]


def per_document(step, cu, tensors):
    """step over each document of [1, T, ...] float64 tensors, the outputs concatenated."""
    return torch.cat([step(*(x[:, a:b] for x in tensors), None)[0]
                      for a, b in zip(cu[:-1], cu[1:])], dim=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="the JSON to write (else standard output)")
    args = ap.parse_args(argv)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla

    torch.cuda.set_device(0)
    lt.init()
    rows, worst = [], 0.0
    for name, offsets in layouts():
        t = offsets[-1]
        cu = torch.tensor(offsets, dtype=torch.long, device="cuda")
        q, k, v, g, beta, _ = delta_inputs(1, t, 2, 128, 128, "cuda", seed=23)
        scale = 128 ** -0.5
        for family in ("scalar_decay", "gated_delta"):
            with torch.no_grad():
                if family == "scalar_decay":
                    ours = lt.chunk_simple_gla(q, k, v, g, cu_seqlens=cu)[0]
                    fla = chunk_simple_gla(q, k, v, g=g, scale=scale, cu_seqlens=cu)[0]
                else:
                    ours = lt.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)[0]
                    fla = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                                 cu_seqlens=cu)[0]
            row = {"family": family, "documents": name, "B": 1, "T": t, "H": 2, "D": 128,
                   "doc_lengths": [b - a for a, b in zip(offsets[:-1], offsets[1:])],
                   "rel_err_vs_fla": round(rel_err(ours, fla), 7)}
            if t <= 4096:
                wide = [x.double() for x in ((q, k, v, g) if family == "scalar_decay"
                                             else (q, k, v, g, beta))]
                step = recurrent if family == "scalar_decay" else delta_recurrent
                want = per_document(step, offsets, wide)
                row["rel_err_vs_f64"] = round(rel_err(ours, want), 7)
                row["fla_rel_err_vs_f64"] = round(rel_err(fla, want), 7)
                worst = max(worst, row["rel_err_vs_f64"])
            rows.append(row)
            print(json.dumps(row | {"doc_lengths": len(row["doc_lengths"])}), flush=True)
    lt.shutdown()
    text = json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0 if worst <= TOL and not math.isnan(worst) else 1


if __name__ == "__main__":
    sys.exit(main())
