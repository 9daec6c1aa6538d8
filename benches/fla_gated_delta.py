"""fla's chunk_gated_delta_rule forward on the inputs target/release/gated_delta_bench dumped: its
time, beside ours from the same dump, and the relative error between the two outputs.

    gated_delta_bench --dump /tmp/gdn
    python3 benches/fla_gated_delta.py /tmp/gdn --out /tmp/gdn/fla_1.json

Per shape (DIR/<name>/{q,k,v,g,beta,o}.bin and DIR/ours.json, as gated_delta_bench writes them):
fla's forward under torch.no_grad with scale D^-1/2 and no final state, on the same bf16 q, k, v
and fp32 g, beta; --warmup untimed calls, then --iters calls enqueued back to back, each between
two CUDA events; the median. rel_err_ours_vs_fla is ||o_ours - o_fla|| / ||o_fla|| in float64
(both are bf16 approximations of the f64 recurrence, which the GPU tests hold ours to within
5e-3). fla's times vary between processes: run this in several and take the median of their
medians. Needs fla-core 0.6.0 (with einops) importable; its Triton autotuning runs on the first
call of each shape unless TRITON_CACHE_DIR holds an earlier run's choices.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from fla_forward import load, time_calls  # this folder's: the dump's loader and the CUDA-event timer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", type=Path, help="gated_delta_bench's --dump DIR")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, help="the JSON to write (else standard output)")
    args = ap.parse_args(argv)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    ours = json.loads((args.dump / "ours.json").read_text())
    rows = []
    for shape in ours["shapes"]:
        b, t, h, d = shape["B"], shape["T"], shape["H"], shape["D"]
        folder = args.dump / shape["name"]
        q, k, v = (load(folder / f"{n}.bin", torch.bfloat16, (b, t, h, d), torch).cuda() for n in "qkv")
        g, beta = (load(folder / f"{n}.bin", torch.float32, (b, t, h), torch).cuda() for n in ("g", "beta"))
        ours_o = load(folder / "o.bin", torch.bfloat16, (b, t, h, d), torch).cuda()

        def call():
            return chunk_gated_delta_rule(q, k, v, g, beta, scale=d ** -0.5, output_final_state=False)[0]

        with torch.no_grad():
            o = call().double()
            rel = ((ours_o.double() - o).norm() / o.norm()).item()
            ms, _ = time_calls(call, args.warmup, args.iters, torch)
        row = dict(name=shape["name"], B=b, T=t, H=h, D=d, fla_fwd_ms=round(ms, 5),
                   ours_fwd_ms=shape["ours_fwd_ms"], speedup_fwd=round(ms / shape["ours_fwd_ms"], 3),
                   rel_err_ours_vs_fla=round(rel, 7))
        rows.append(row)
        print(f"{shape['name']}: fla {ms:.4f} ms, ours {shape['ours_fwd_ms']:.4f} ms "
              f"({row['speedup_fwd']:.2f}x), rel err ours vs fla {rel:.2e}", flush=True)
    import fla
    result = dict(device=torch.cuda.get_device_name(), ours_commit=ours["commit"],
                  versions=dict(torch=torch.__version__, fla=getattr(fla, "__version__", "unknown")),
                  method=f"{args.warmup} warm-up calls, then {args.iters} calls enqueued back to back, each "
                         "between two CUDA events; median; fla.ops.gated_delta_rule.chunk_gated_delta_rule under "
                         "torch.no_grad on gated_delta_bench's dumped inputs",
                  shapes=rows)
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
