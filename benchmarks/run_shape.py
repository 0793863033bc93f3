"""Run our forward+backward on one named benchmark shape a few times: a target for a profiler.

    ncu -k regex:gdn_bwd_fused_ws --launch-skip 1 --launch-count 1 -o ws python benchmarks/run_shape.py tp1_1x32k
    ncu -k regex:fused_chunk_gdr_fwd --launch-skip 1 --launch-count 1 -o fq python benchmarks/run_shape.py tp1_4x8k --lib flashqla

The first call compiles (or loads) the kernels, so profile with --launch-skip 1.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import SHAPES, shape_inputs  # noqa: E402
from profile_kernels import operation  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--lib", default="ours", choices=("ours", "flashqla"), help="flashqla: the peer's public op")
    ap.add_argument("--fwd-only", action="store_true", help="the inference forward (no_grad, final state out)")
    args = ap.parse_args()
    op = operation(args.lib, "auto")
    q, k, v, g, beta, cu = shape_inputs(args.shape)
    cu = None if cu is None else cu.to("cuda", torch.int32)
    ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    do = torch.randn_like(v)
    for _ in range(args.iters):
        if args.fwd_only:
            with torch.no_grad():
                o, _ = op(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
            continue
        o, _ = op(*ins, cu_seqlens=cu)
        o.backward(do)
    torch.cuda.synchronize()
    print(f"ran {args.shape} x{args.iters}: o finite {bool(torch.isfinite(o).all())}")


if __name__ == "__main__":
    main()
