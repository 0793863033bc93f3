"""Sweep the intra-card split of the TileLang kernels (partitions per sequence) on one GPU.

    python tools/tune_split.py --shapes tp8_1x32k,tp1_1x8k --parts 1,4,16,auto

For each shape of benchmarks/bench_kernels.py and each P in --parts (1: unsplit; 'auto': what
`kernels/split.py` picks), the public op's forward and forward+backward times (do_bench
medians, eager), and with --fused-walk on,off the fwd+bwd once per fused-walk mode. Prints one
JSON line per setting and writes tune_split.json under --out.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_kernels import shape_inputs  # noqa: E402

from flash_qla_cp import KernelOptions, chunk_gated_delta_rule  # noqa: E402


def main():
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp8_1x32k")
    ap.add_argument("--parts", default="1,4,16,auto")
    ap.add_argument("--fused-walk", default="auto", help="comma-separated KernelOptions.fused_walk modes")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args()

    rows = []
    for shape in args.shapes.split(","):
        q, k, v, g, beta, cu = shape_inputs(shape)
        cu32 = None if cu is None else cu.to(device="cuda", dtype=torch.int32)
        cu_cpu = None if cu is None else cu.to(torch.int32)
        do = torch.randn_like(v)
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        for parts in args.parts.split(","):
            intra = "off" if parts == "1" else parts if parts == "auto" else int(parts)
            row = {"shape": shape, "intra_cp": intra}

            def fwd():
                with torch.no_grad():
                    chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu32,
                                           cu_seqlens_cpu=cu_cpu, backend="tilelang", intra_cp=intra)

            row["fwd_ms"] = round(triton.testing.do_bench(fwd, return_mode="median"), 4)
            for mode in args.fused_walk.split(","):
                options = KernelOptions(fused_walk=mode)

                def fwdbwd():
                    for t in ins:
                        t.grad = None
                    o, _ = chunk_gated_delta_rule(*ins, cu_seqlens=cu32, cu_seqlens_cpu=cu_cpu, backend="tilelang",
                                                  intra_cp=intra, kernel_options=options)
                    o.backward(do)

                row[f"fwdbwd_ms_{mode}"] = round(triton.testing.do_bench(fwdbwd, return_mode="median"), 4)
            print(json.dumps(row), flush=True)
            rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_split.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
