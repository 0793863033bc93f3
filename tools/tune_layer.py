"""Sweep the tuning parameters of the layer's kernels around the op (`kernels/layer.py`) on one GPU.

    python tools/tune_layer.py --shapes qwen3_next_1x32k,recipe_1x32k
    python tools/tune_layer.py --shapes qwen3_next_1x32k --kernel-log variants.jsonl   # no GPU needed

Steps: `inputs` (conv + SiLU, l2 norm and gates), `inputs_bwd`, `norm` (gated RMSNorm), `norm_bwd`.
For each shape of benchmarks/bench_layer.py, each step and each variant in VARIANTS (block size;
for the inputs kernels and the norm backward also register caps for more blocks per SM): the
kernel's time (do_bench median) on random inputs, after its outputs are checked against the
default variant's (per-token outputs bit for bit, parameter gradients summed from per-block parts
to 1e-5; a mismatch is reported with the timing). One JSON line per setting; tune_layer.json under --out. With
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

from bench_layer import SHAPES  # noqa: E402

from flash_qla_cp import GatedDeltaNet  # noqa: E402
from flash_qla_cp.kernels import layer as steps  # noqa: E402
from flash_qla_cp.kernels.runtime import kernel_log_line  # noqa: E402
from flash_qla_cp.reference.layer_steps import token_positions  # noqa: E402
from flash_qla_cp.testing import random_cu_seqlens, rel_err  # noqa: E402

# kernel parameters each step is timed with (None: the plan's own, `kernels/layer.py`); the sizes
# each kernel lowers for (the layer-inputs backward adds 16 look-ahead rows to its tile); register
# caps (ptxas, sm_90a): the inputs backward takes 128 registers uncapped (blocks_per_sm 1: two blocks
# of 256 threads per SM), 80 at 3 (the plan's cap) with no spills at these sizes; the inputs forward
# (256 + 128 producer threads) 80 at 2 (the plan's), 168 at 1; the norm backward 112 uncapped (four
# blocks of 128 threads), 96 / 80 at 5 (the plan's) / 6 with 12 / 100 bytes spilled
VARIANTS = {
    "inputs": (None, {"tiles": 16}, {"stages": 2}, {"stages": 4}, {"blocks_per_sm": 1}),
    "inputs_bwd": (None, {"blocks_per_sm": 1}, {"block_tokens": 16}, {"block_tokens": 48}, {"block_tokens": 64}),
    "norm": (None, {"block_tokens": 32}, {"block_tokens": 64}),
    "norm_bwd": (None, {"blocks_per_sm": 1}, {"block_tokens": 16}, {"blocks_per_sm": 6}),
}
PARAMETER_GRADS = {"inputs_bwd": (1,), "norm_bwd": (2,)}  # outputs summed from per-block parts


def layer_of(shape, device):
    hidden, H, HV, D = SHAPES[shape][:4]
    return GatedDeltaNet(hidden, H, HV, D, D).to(device=device, dtype=torch.bfloat16)


def grad_parts(lay):
    """dq, dk parts the layer's backward hands the inputs step (GVA: one per v-head, as the fused
    walk writes them)."""
    return lay.num_v_heads // lay.num_heads


def variant_specs(shape):
    """[KernelSpec] of every step at every block size for the layer of `shape` (bf16)."""
    lay = layer_of(shape, "cpu").projection_layout
    inputs = steps.plan_layer_inputs(lay, 4, "bfloat16", False, grad_parts(lay))
    norm = steps.plan_gated_norm(lay, "bfloat16", 1e-6)
    plans = {"inputs": inputs.forward, "inputs_bwd": inputs.backward, "norm": norm.forward, "norm_bwd": norm.backward}
    return [plans[step].replace(**(tuning or {})) for step, variants in VARIANTS.items() for tuning in variants]


def step_calls(shape, device):
    """{step: f(tuning) -> outputs} on random inputs of `shape`'s layer."""
    _, _, _, _, B, T, lengths = SHAPES[shape]
    m = layer_of(shape, device)
    lay = m.projection_layout
    NT = B * T if lengths is None else sum(lengths)
    cu = random_cu_seqlens(lengths, device=device) if lengths else None
    positions = token_positions(B if cu is None else 1, T if cu is None else NT, cu, device)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape_, dtype=torch.bfloat16):
        return torch.randn(*shape_, generator=gen, device=device).to(dtype)

    P = rand(NT, lay.width)
    H, HV, dk, dv = lay.num_heads, lay.num_v_heads, lay.head_k_dim, lay.head_v_dim
    parts = H * grad_parts(lay)
    grads = (rand(NT, parts, dk), rand(NT, parts, dk), rand(NT, HV, dv), rand(NT, HV, dtype=torch.float32),
             rand(NT, HV, dtype=torch.float32), rand(NT, HV, dv))  # dq, dk (parts), dv, dg, dbeta, dz
    o, dy = rand(NT, HV, dv), rand(NT, HV * dv)
    weights = (m.conv1d.weight, m.A_log, m.dt_bias)
    dP = torch.zeros_like(P)  # every column written (z's from dz), all compared

    def inputs_bwd(tuning):
        rest = steps.op_inputs_backward(*grads, P, lay, *weights, positions, False, dP, tuning=tuning)
        return (dP.clone(), *rest[:3])

    return {
        "inputs": lambda tuning: steps.op_inputs_forward(P, lay, *weights, positions, tuning=tuning),
        "inputs_bwd": inputs_bwd,
        "norm": lambda tuning: (steps.gated_norm_forward(o, P, lay, m.norm.weight, 1e-6, tuning=tuning),),
        "norm_bwd": lambda tuning: steps.gated_norm_backward(dy, o, P, lay, m.norm.weight, 1e-6, tuning=tuning),
    }


def check(step, got, want):
    """None when `got` matches the default variant's `want`, else what differs."""
    for i, (a, b) in enumerate(zip(got, want)):
        if i in PARAMETER_GRADS.get(step, ()):
            if not rel_err(a, b) <= 1e-5:
                return f"output {i}: relative error {rel_err(a, b):.1e}"
        elif not torch.equal(a, b):
            return f"output {i} differs: relative error {rel_err(a, b):.1e}"
    return None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3_next_1x32k,recipe_1x32k")
    ap.add_argument("--steps", default=",".join(VARIANTS))
    ap.add_argument("--kernel-log", help="only write the variants' kernels to this kernel log (no GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args(argv)
    if args.kernel_log:
        with open(args.kernel_log, "w") as f:
            for shape in args.shapes.split(","):
                f.writelines(kernel_log_line(spec) for spec in variant_specs(shape))
        return
    import triton.testing

    rows = []
    for shape in args.shapes.split(","):
        calls = step_calls(shape, torch.device("cuda"))
        for step in args.steps.split(","):
            want = [t.clone() for t in calls[step](None)]
            for tuning in VARIANTS[step]:
                row = {"shape": shape, "step": step, "tuning": tuning or "default"}
                # timed either way: a mismatch is a difference to look into before a variant is adopted
                row["mismatch"] = check(step, calls[step](tuning), want)
                row["ms"] = round(triton.testing.do_bench(lambda: calls[step](tuning), return_mode="median"), 4)
                print(json.dumps(row), flush=True)
                rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_layer.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
