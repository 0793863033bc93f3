"""Time the two forward kernels of flash_qla_cp separately and the fused kernel's variants.

python benchmarks/tune_fwd.py [--out DIR]  -> tune_fwd.json (prepare ms, fused ms per block_v)
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import SHAPES, make_inputs, shape_cu  # noqa: E402

from flash_qla_cp.kernels.tilelang_common import compile_kernel, precompile  # noqa: E402
from flash_qla_cp.kernels.tilelang_fwd import fwd_kernel_specs, prepare_fwd  # noqa: E402


def opts(var):
    """'bv:stages:async:threads:osmem' -> single-warpgroup kernel options; 'ws<bv>[s<stages>]'
    -> the warp-specialised kernel with that block_v (and ring depth); 'wg4-<bv>' -> the
    four-warpgroup kernel (tilelang_fwd_ws4.py)."""
    if var.startswith("wg4-"):
        return dict(warp_specialized=True, four_warpgroups=True, block_v=int(var[4:]))
    if var.startswith("ws"):  # ws<bv>, ws<bv>s<stages>
        bv, _, st = var[2:].partition("s")
        return dict(warp_specialized=True, block_v=int(bv), **({"num_stages": int(st)} if st else {}))
    bv, st, am, th, osm = (int(x) for x in var.split(":"))
    return dict(block_v=bv, num_stages=st, async_mma=bool(am), threads=th, o_store_smem=bool(osm))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp1_1x32k,tp8_1x32k,tp1_varlen8_32k")
    ap.add_argument("--variants", default="64:2:1:128:0,32:2:1:128:0,16:2:1:128:0,32:2:1:256:0,64:2:1:256:0,32:2:1:128:1",
                    help="comma list of block_v:num_stages:async_mma:threads:o_store_smem or ws<block_v>")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import triton.testing

    variants = args.variants.split(",")
    shapes = args.shapes.split(",")
    specs = []
    for sname in shapes:
        B, T, H, HV, K, V, nseq = SHAPES[sname]
        for var in variants:
            specs += fwd_kernel_specs(H, HV, K, V, torch.bfloat16, K**-0.5, nseq is not None, False, True, False,
                                      **opts(var))
    t0 = time.time()
    precompile(specs)
    print(f"compiled in {time.time() - t0:.1f}s", flush=True)
    rows = []
    for sname in shapes:
        B, T, H, HV, K, V, nseq = SHAPES[sname]
        q, k, v, g, beta = make_inputs(B, T, H, HV, K, V)
        cu = None
        if nseq:
            cu = shape_cu(sname).to(device="cuda", dtype=torch.int32)
            q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
        g_cum, ag, tab = prepare_fwd(k, g, beta, cu_seqlens=cu)
        row = {"shape": sname}
        row["prepare_ms"] = triton.testing.do_bench(lambda: prepare_fwd(k, g, beta, cu_seqlens=cu, chunk_tab=tab),
                                                    return_mode="median")
        N = B if cu is None else len(cu) - 1
        o = torch.empty_like(v)
        ht = torch.empty(N, HV, K, V, device="cuda")
        h0 = torch.zeros(1, HV, K, V, device="cuda")
        best = None
        for var in variants:
            factory, params = fwd_kernel_specs(H, HV, K, V, torch.bfloat16, K**-0.5, nseq is not None, False, True,
                                               False, **opts(var))[1]
            kern = compile_kernel(factory, **params)
            if cu is None:
                fn = lambda: kern(q, k, v, ag, g_cum, h0, o, ht)  # noqa: E731
            else:
                fn = lambda: kern(q, k, v, ag, g_cum, cu, h0, o, ht)  # noqa: E731
            ms = triton.testing.do_bench(fn, return_mode="median")
            row["fused_" + "_".join(f"{k}{int(v)}" for k, v in opts(var).items()) + "_ms"] = ms
            if best is None or ms < best[0]:
                best = (ms, opts(var))
        row["best_fused_ms"], row["best_config"] = best
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "tune_fwd.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
