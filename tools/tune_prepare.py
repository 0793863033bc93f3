"""Time the prepare kernel (`kernels/hopper/prepare.py`) with its registers capped for more blocks
per SM, on shapes of benchmarks/bench_kernels.py, on one GPU.

    python tools/tune_prepare.py [--shapes tp1_1x32k,tp1_varlen8_32k,tp8_1x128k] [--out DIR]
    python tools/tune_prepare.py --kernel-log variants.jsonl   # no GPU needed

At its default the kernel uses 104 registers (ptxas, sm_90a): four 128-thread blocks per SM.
Each value of BLOCKS_PER_SM is timed (do_bench median) after its outputs, G and Ag, are checked
bit for bit against the default's (a cap changes register allocation, not arithmetic; a mismatch
is reported with the timing). One JSON line per setting; tune_prepare.json under --out. With
--kernel-log nothing runs: the variants' kernels are written as a kernel log for
`tools/precompile_cache.py --log`.
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "benchmarks")]

from bench_kernels import SHAPES, shape_inputs  # noqa: E402

from flash_qla_cp.kernels.forward import prepare_spec, run_prepare  # noqa: E402
from flash_qla_cp.kernels.runtime import kernel_log_line  # noqa: E402
from flash_qla_cp.kernels.tables import chunk_table  # noqa: E402

# 5: 92 registers, no spills; 6: 80, 4 bytes spilled; 8: 64, 24 bytes spilled (ptxas, sm_90a)
BLOCKS_PER_SM = (1, 5, 6, 8)


def variant_specs(shape):
    """[KernelSpec] of the prepare kernel for `shape` (bf16), one per BLOCKS_PER_SM (1: uncapped;
    the plans use forward.PREPARE_BLOCKS_PER_SM)."""
    _, _, H, HV, K, _, nseq = SHAPES[shape]
    spec = prepare_spec(H, HV, K, "bfloat16", bool(nseq))
    return [spec.replace(blocks_per_sm=m) for m in BLOCKS_PER_SM]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp1_1x32k,tp1_varlen8_32k,tp8_1x128k")
    ap.add_argument("--kernel-log", help="only write the variants' kernels to this kernel log (no GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if args.kernel_log:
        with open(args.kernel_log, "w") as f:
            f.writelines(kernel_log_line(spec) for shape in shapes for spec in variant_specs(shape))
        return
    import triton.testing

    rows = []
    for shape in shapes:
        _, k, _, g, beta, cu = shape_inputs(shape)
        cu = None if cu is None else cu.to(device="cuda", dtype=torch.int32)
        tab = None if cu is None else chunk_table(cu)
        specs = variant_specs(shape)

        def run(spec):
            return run_prepare(spec, k, g, beta, cu_seqlens=cu, chunk_tab=tab)[:2]

        want = [t.clone() for t in run(specs[0])]
        for m, spec in zip(BLOCKS_PER_SM, specs):
            got = run(spec)
            differ = [name for name, a, b in zip(("G", "Ag"), got, want) if not torch.equal(a, b)]
            row = {"shape": shape, "blocks_per_sm": m, "mismatch": differ or None,
                   "ms": round(triton.testing.do_bench(lambda: run(spec), return_mode="median"), 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_prepare.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
