"""Per-kernel GPU time of our forward and forward+backward (torch.profiler), to see where time goes.

    python benchmarks/profile_kernels.py --shapes tp8_1x32k --intra auto,off

Prints, per shape and intra setting, each CUDA kernel's total time over --iters iterations
divided by --iters (ms per call), and writes profile_kernels.json under --out.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import shape_inputs  # noqa: E402

from flash_qla_cp import chunk_gated_delta_rule  # noqa: E402


def kernel_times(fn, iters):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = ev.cuda_time_total
        if t > 0:
            rows.append((ev.key[:90], round(t / iters / 1000, 4), ev.count // iters))
    return sorted(rows, key=lambda r: -r[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp8_1x32k")
    ap.add_argument("--intra", default="auto,off")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = []
    for sname in args.shapes.split(","):
        q, k, v, g, beta, cu = shape_inputs(sname)
        cu = None if cu is None else cu.to("cuda", torch.int32)
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        do = torch.randn_like(v)
        for intra in args.intra.split(","):
            intra = intra if intra in ("auto", "off") else int(intra)

            def fwd():
                with torch.no_grad():
                    chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                           backend="tilelang", intra_cp=intra)

            def fwdbwd():
                o, _ = chunk_gated_delta_rule(*ins, cu_seqlens=cu, backend="tilelang", intra_cp=intra)
                for t in ins:  # written, not accumulated (as bench_kernels.py)
                    t.grad = None
                o.backward(do)

            for name, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                rows = kernel_times(fn, args.iters)
                entry = {"shape": sname, "intra": str(intra), "pass": name,
                         "total_ms": round(sum(r[1] for r in rows), 4), "kernels": rows[:12]}
                result.append(entry)
                print(json.dumps(entry), flush=True)
    with open(os.path.join(args.out, "profile_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
