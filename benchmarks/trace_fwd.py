"""Where a chunk's time goes in the warp-specialised forward (clock64 stamps, one GPU run).

Builds the kernel with `trace=True` (tilelang_fwd_ws.py) for each variant, runs it once after
a warm-up on a benchmark shape, and prints per warpgroup the median cycles of each phase over
all chunks and CTAs:

  state : wait (data, out_done) | publish S | GEMM 1 | w | GEMM 2 | publish v_new | update
  output: wait data | q k^T + mask | wait S | q S | wait v_new | P v_new | store o

    python benchmarks/trace_fwd.py --shape tp1_1x8k --variants ws32,ws64
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import SHAPES, make_inputs  # noqa: E402
from tune_fwd import opts  # noqa: E402

from flash_qla_cp.kernels.tilelang_common import compile_kernel  # noqa: E402
from flash_qla_cp.kernels.tilelang_fwd import fwd_kernel_specs, prepare_fwd  # noqa: E402
from flash_qla_cp.kernels.tilelang_fwd_ws import build_fused_fwd_ws_kernel  # noqa: E402

PHASES = {
    "state": ["wait", "publish_S", "gemm1", "w", "gemm2", "publish_vnew", "update"],
    "output": ["wait_data", "qk_mask", "wait_S", "qS", "wait_vnew", "P_vnew", "store_o"],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tp1_1x8k")
    ap.add_argument("--variants", default="ws32,ws64")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    B, T, H, HV, K, V, nseq = SHAPES[args.shape]
    assert nseq is None, "a dense shape"
    q, k, v, g, beta = make_inputs(B, T, H, HV, K, V)
    g_cum, ag, _ = prepare_fwd(k, g, beta)
    h0 = torch.zeros(1, HV, K, V, device="cuda")
    o = torch.empty_like(v)
    rows = []
    for var in args.variants.split(","):
        cfg = opts(var)
        params = dict(fwd_kernel_specs(H, HV, K, V, torch.bfloat16, K**-0.5, False, False, False, False, **cfg)[1][1])
        assert params.get("block_v"), params
        kern = compile_kernel(build_fused_fwd_ws_kernel, **dict(params, trace=True))
        ht = torch.zeros(B, HV, K, V, device="cuda")
        for _ in range(3):  # warm-up, then the traced run
            kern(q, k, v, ag, g_cum, h0, o, ht)
        torch.cuda.synchronize()
        bv = params["block_v"]
        n_chunks = min(-(-T // 64), K * bv // 16)
        flat = ht.reshape(B, HV, K, V // bv, bv).permute(0, 1, 3, 2, 4).reshape(B * HV * (V // bv), K * bv)
        row = {"variant": var, "shape": args.shape, "chunks_traced": n_chunks}
        for r, (wg, names) in enumerate(PHASES.items()):
            part = flat[:, r * K * bv // 2 : r * K * bv // 2 + n_chunks * 8].reshape(-1, n_chunks, 8)[:, 1:, :7]
            med = part.reshape(-1, 7).median(0).values.tolist()
            row[wg] = {name: round(x) for name, x in zip(names, med)}
            row[wg + "_total"] = round(part.sum(-1).median().item())
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "trace_fwd.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
