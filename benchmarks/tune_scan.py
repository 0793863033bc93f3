"""Time the partition scan (`tilelang_split.scan_partitions`, the serial step of the intra-card
split: S = M S + h over a sequence's partitions) alone, for each V tile, on the bench's split
shapes, and check that every tile gives the same states.

    python benchmarks/tune_scan.py [--block-v 16,32,64] [--out DIR]

The kernel runs one block per (V tile, sequence, v-head), each step loading a K x K map M
(64 KiB in fp32 at K = 128): narrower tiles give more blocks, each loading the same M.
Writes tune_scan.json under --out.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (name, partitions per sequence, sequences, HV): what the bench's split shapes scan
CASES = [("tp8_1x128k", 32, 1, 4), ("tp8_1x32k", 8, 1, 4), ("tp1_1x32k", 4, 1, 32)]


def main():
    import triton.testing

    from flash_qla_cp.kernels import tilelang_split
    from flash_qla_cp.kernels.tilelang_common import compile_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--block-v", default="16,32,64")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    K = V = 128
    rows = []
    for name, P, N, HV in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        # contracting maps (as M = exp(sum g) prod(I - beta k k^T) is), so states stay bounded
        m = 0.1 * torch.randn(N * P, HV, K, K, device="cuda", generator=gen) / K**0.5
        add = torch.randn(N * P, HV, K, V, device="cuda", generator=gen)
        s0 = torch.randn(N, HV, K, V, device="cuda", generator=gen)
        seq_parts = torch.arange(0, (N + 1) * P, P, dtype=torch.int32, device="cuda")
        want = None
        for reverse in (False, True):
            for bv in map(int, args.block_v.split(",")):
                kern = compile_kernel(tilelang_split.build_partition_scan_kernel, HV=HV, K=K, V=V,
                                      reverse=reverse, block_v=bv)
                out = torch.full((N * P, HV, K, V), float("nan"), device="cuda")

                def run():
                    kern(m, add, seq_parts, s0, out)

                run()
                torch.cuda.synchronize()
                if bv == int(args.block_v.split(",")[0]):
                    want = out.clone()
                row = {"shape": name, "parts": P, "HV": HV, "reverse": reverse, "block_v": bv,
                       "ms": round(triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median"), 4),
                       "finite": bool(torch.isfinite(out).all()),
                       "max_abs_diff_vs_first_tile": float((out - want).abs().max())}
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_scan.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
