"""Time the prepare kernel (`kernels/hopper/prepare.py`) with its registers capped for more blocks
per SM and, under GVA, with several v-heads per block, on shapes of benchmarks/bench_kernels.py,
on one GPU.

    python tools/tune_prepare.py [--shapes tp1_1x32k,tp1_varlen8_32k,tp8_1x128k] [--out DIR]
    python tools/tune_prepare.py --kernel-log variants.jsonl   # no GPU needed

Each pair of BLOCKS_PER_SM and HEADS_PER_BLOCK is timed (do_bench median) after its outputs, G
and Ag (written over NaN), are checked bit for bit against those of the uncapped kernel with one
v-head per block (a cap changes register allocation, and a shared k k^T is the same product:
no other arithmetic; a mismatch is reported with the timing). One JSON line per setting;
tune_prepare.json under --out. With --kernel-log nothing runs: the variants' kernels are written
as a kernel log for `tools/precompile_cache.py --log`.
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "benchmarks")]

from bench_kernels import SHAPES, shape_inputs  # noqa: E402

from flash_qla_cp.kernels.forward import prepare_heads_per_block, prepare_spec, run_prepare  # noqa: E402
from flash_qla_cp.kernels.runtime import kernel_log_line  # noqa: E402
from flash_qla_cp.kernels.tables import chunk_table  # noqa: E402

# blocks per SM (1: uncapped) x v-heads per block (GVA: the v-heads of a block share k k^T).
# ptxas, sm_90a, TP1 heads, dense: one v-head per block, 5 blocks: 96 registers, no spills; two
# v-heads: 4 blocks 102 registers, no spills, 5 blocks 96 with 60 bytes spilled (varlen: none)
BLOCKS_PER_SM = (1, 4, 5, 6)
HEADS_PER_BLOCK = (1, 2)


def variant_specs(shape):
    """[(blocks per SM, v-heads per block, KernelSpec)] of the prepare kernel for `shape` (bf16):
    every pair the shape's GVA group allows, (1, 1) first (uncapped, one v-head per block: the
    reference the others must equal bit for bit; the plans use forward.PREPARE_BLOCKS_PER_SM and
    forward.PREPARE_HEADS_PER_BLOCK)."""
    _, _, H, HV, K, _, nseq = SHAPES[shape]
    spec = prepare_spec(H, HV, K, "bfloat16", bool(nseq))
    return [(m, vh, spec.replace(blocks_per_sm=m, heads_per_block=vh)) for vh in HEADS_PER_BLOCK
            if prepare_heads_per_block(H, HV, vh) == vh for m in BLOCKS_PER_SM]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp1_1x32k,tp1_varlen8_32k,tp8_1x128k")
    ap.add_argument("--kernel-log", help="only write the variants' kernels to this kernel log (no GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if args.kernel_log:
        with open(args.kernel_log, "w") as f:
            f.writelines(kernel_log_line(spec) for shape in shapes for _, _, spec in variant_specs(shape))
        return
    import triton.testing

    rows = []
    for shape in shapes:
        _, k, _, g, beta, cu = shape_inputs(shape)
        cu = None if cu is None else cu.to(device="cuda", dtype=torch.int32)
        tab = None if cu is None else chunk_table(cu)
        specs = variant_specs(shape)

        def run(spec, out=None):
            return run_prepare(spec, k, g, beta, cu_seqlens=cu, chunk_tab=tab, out=out)[:2]

        template = run(specs[0][2])  # G and Ag's shapes and dtypes

        def poisoned():  # NaN outputs: a value the variant leaves unwritten cannot match
            return tuple(torch.full_like(t, float("nan")) for t in template)

        want = run(specs[0][2], poisoned())
        for m, vh, spec in specs:
            got = run(spec, poisoned())
            differ = [name for name, a, b in zip(("G", "Ag"), got, want) if not torch.equal(a, b)]
            row = {"shape": shape, "blocks_per_sm": m, "heads_per_block": vh, "mismatch": differ or None,
                   "ms": round(triton.testing.do_bench(lambda: run(spec), return_mode="median"), 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_prepare.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
