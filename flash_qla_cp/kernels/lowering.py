"""Lower TileLang kernels to CUDA source on a machine without a GPU (used by CI).

`lower_to_cuda_source(prim_func)` runs TileLang's lowering for an explicit CUDA target, so
wgmma / TMA code paths are generated and can be inspected without a device or nvcc.
`lowering_cases()` lists the kernels the CPU tests lower: every spec the forward and backward
plans choose for a set of configurations that reaches every kernel family and variant.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..reference.layer_steps import ProjectionLayout
from .backward import plan_backward
from .forward import gated_norm_key, plan_forward
from .layer import plan_gated_norm, plan_layer_inputs
from .hopper.common import pass_configs
from .runtime import KernelSpec

# Shared memory one block may opt into on Hopper (sm_90: 227 KiB); a kernel asking for more
# lowers and compiles but fails at launch, so the CPU tests check it.
MAX_SHARED_MEMORY_SM90 = 227 * 1024


@dataclass(frozen=True)
class LoweredKernel:
    source: str  # CUDA C++ of the device code
    shared_memory_bytes: int  # dynamic shared memory per block (0 if none)


def lower_for_cuda(prim_func, arch: str = "sm_90a", configs: dict | None = None) -> LoweredKernel:
    """Lower `prim_func` for `arch` (no GPU, no nvcc needed): its CUDA source and shared memory.
    configs: TileLang's pass configuration (default `hopper.common.pass_configs()`; `lower_spec`
    lowers a spec's kernel with its own)."""
    import tilelang
    import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(opt_level=3, config=configs if configs is not None else pass_configs()), target:
        artifact = tilelang.lower(prim_func, target=target)
    smem = max((int(fn.attrs["dyn_shared_memory_buf"]) for fn in artifact.device_mod.functions.values()
                if fn.attrs is not None and "dyn_shared_memory_buf" in fn.attrs), default=0)
    return LoweredKernel(artifact.kernel_source, smem)


def lower_spec(spec: KernelSpec, arch: str = "sm_90a", extra_configs: dict | None = None) -> LoweredKernel:
    """Lower a spec's kernel as the runtime compiles it: with its builder's pass configuration
    (`pass_configs(spec.factory)`), changed by `extra_configs`."""
    return lower_for_cuda(spec.build(), arch, {**pass_configs(spec.factory), **(extra_configs or {})})


def lower_to_cuda_source(prim_func, arch: str = "sm_90a") -> str:
    """CUDA C++ source of `prim_func` lowered for `arch` (no GPU, no nvcc needed)."""
    return lower_for_cuda(prim_func, arch).source




@dataclass(frozen=True)
class LoweringCase:
    """One kernel spec the plans choose, with what its lowered source must show."""

    name: str
    spec: KernelSpec
    entry: str  # the __global__ function's name
    expect: tuple  # substrings of the source (e.g. "wgmma")


SMS = 132  # an H200
# (H, HV, K, V, dtype): GVA and MHA heads, both head sizes, both dtypes, wide and mixed heads
_HEADS = {"k128": (2, 4, 128, 128, "bfloat16"), "k64": (2, 4, 64, 64, "float16"),
          "k256": (2, 4, 256, 256, "bfloat16"), "k256v128": (2, 4, 256, 128, "bfloat16"),
          "k128v256": (2, 4, 128, 256, "bfloat16"), "k128_mha": (4, 4, 128, 128, "bfloat16")}


def _forward_plans():
    """(tag, ForwardPlan): unsplit with few walks (narrow tiles) and many (four warpgroups, with
    kept states), dense and varlen, [V, K] states, the split forward, wide and mixed heads."""
    for tag in ("k128", "k64", "k256", "k256v128", "k128v256"):
        H, HV, K, V, dtype = _HEADS[tag]
        for walks, varlen, save in ((1, False, False), (1000, True, True)):
            yield f"{tag}_{walks}walks", plan_forward(H, HV, K, V, dtype, K**-0.5, varlen, True, True, varlen, walks,
                                                      SMS, 0, save)
        if K <= 128 and V <= 128:
            yield f"{tag}_32walks_dense_states", plan_forward(H, HV, K, V, dtype, K**-0.5, False, False, True, False,
                                                              32, SMS, 0, True)
            yield f"{tag}_split", plan_forward(H, HV, K, V, dtype, K**-0.5, True, False, True, False, 8, SMS, 1, True)
            yield f"{tag}_split_h0", plan_forward(H, HV, K, V, dtype, K**-0.5, True, True, True, False, 64, SMS, 2)
    # MHA (one v-head per qk-head: a prepare block per v-head)
    H, HV, K, V, dtype = _HEADS["k128_mha"]
    yield "k128_mha_1walks", plan_forward(H, HV, K, V, dtype, K**-0.5, False, True, True, False, 1, SMS, 0, False)
    # inference with the layer's gated norm in the walk, dense and split (whole 128-wide rows only)
    H, HV, K, V, dtype = _HEADS["k128"]
    lay = ProjectionLayout.qwen3_next(H, HV, K, V)
    norm = gated_norm_key(lay.width, lay.z_offset, lay.z_head_stride, 1e-6)
    yield "k128_1000walks_normed", plan_forward(H, HV, K, V, dtype, K**-0.5, False, False, False, False, 1000, SMS,
                                                gated_norm=norm)
    yield "k128_split_normed", plan_forward(H, HV, K, V, dtype, K**-0.5, True, False, True, False, 64, SMS, 2,
                                            gated_norm=norm)


def _backward_plans():
    """(tag, BackwardPlan): the three-kernel backward (few walks; with and without initial state /
    exit gradients), the fused walk (many walks; with and without), the split backward (serial h
    walk, chunk-limited dh walk, reverse scan), wide heads."""
    scale = 128**-0.5
    yield "k128_1walks", plan_backward(2, 4, 128, 128, "bfloat16", scale, True, True, 1, SMS)
    yield "k128_1000walks", plan_backward(2, 4, 128, 128, "bfloat16", scale, True, True, 1000, SMS)
    yield "k128_1000walks_parts", plan_backward(2, 4, 128, 128, "bfloat16", scale, True, True, 1000, SMS,
                                                sum_v_heads=False)
    yield "k128_split", plan_backward(2, 4, 128, 128, "bfloat16", scale, False, True, 8, SMS, 1)
    yield "k128_split_fused", plan_backward(2, 4, 128, 128, "bfloat16", scale, True, False, 64, SMS, 2, True)
    yield "k64_1walks", plan_backward(2, 4, 64, 64, "float16", 64**-0.5, True, True, 1, SMS)
    yield "k64_1walks_nostate", plan_backward(2, 4, 64, 64, "float16", 64**-0.5, False, False, 1, SMS)
    yield "k64_1000walks", plan_backward(2, 4, 64, 64, "float16", 64**-0.5, False, False, 1000, SMS)
    yield "k256_1walks", plan_backward(2, 4, 256, 256, "bfloat16", 256**-0.5, True, True, 1, SMS)


def _layer_plans():
    """(tag, StepPlan): the layer's steps for both projection layouts, equal and mixed head dims
    (one set of buffers or two), both dtypes, beta in (0, 1) and (0, 2); the inputs step's
    backward reading dq, dk summed and as per-v-head parts."""
    for tag, layout, dtype, neg in (("qwen3_next_k128", ProjectionLayout.qwen3_next(2, 4, 128, 128), "bfloat16", False),
                                    ("qwen3_5_k64v128", ProjectionLayout.qwen3_5(2, 4, 64, 128), "float16", True)):
        yield tag, plan_layer_inputs(layout, 4, dtype, neg)
        yield f"{tag}_v_head_parts", plan_layer_inputs(layout, 4, dtype, neg, grad_parts=2)
        yield tag, plan_gated_norm(layout, dtype, 1e-6)


_ENTRIES = {
    "build_prepare_kernel": "gdn_fwd_prepare", "build_fused_fwd_kernel": "gdn_fwd_fused",
    "build_fused_fwd_ws_kernel": "gdn_fwd_fused", "build_fused_fwd_ws4_kernel": "gdn_fwd_fused",
    "build_decay_tables_kernel": "gdn_decay_tables", "build_state_summary_kernel": "gdn_state_summary",
    "build_partition_scan_kernel": "gdn_partition_scan", "build_bwd_h_kernel": "gdn_bwd_h",
    "build_bwd_h_ws_kernel": "gdn_bwd_h", "build_bwd_dh_kernel": "gdn_bwd_dh", "build_bwd_dh_ws_kernel": "gdn_bwd_dh",
    "build_bwd_grad_group_kernel": "gdn_bwd_grad_group", "build_bwd_grad_wide_kernel": "gdn_bwd_grad_wide",
    "build_bwd_fused_ws_kernel": "gdn_bwd_fused_ws", "build_v_head_sum_kernel": "gdn_v_head_sum",
    "build_layer_inputs_kernel": "gdn_layer_inputs", "build_layer_inputs_bwd_kernel": "gdn_layer_inputs_bwd",
    "build_gated_norm_kernel": "gdn_gated_norm", "build_gated_norm_bwd_kernel": "gdn_gated_norm_bwd",
}
_ELEMENTWISE = ("build_v_head_sum_kernel", "build_layer_inputs_kernel", "build_layer_inputs_bwd_kernel",
                "build_gated_norm_kernel", "build_gated_norm_bwd_kernel")
_WARP_SPECIALISED = ("build_fused_fwd_ws_kernel", "build_fused_fwd_ws4_kernel", "build_bwd_h_ws_kernel",
                     "build_bwd_dh_ws_kernel", "build_bwd_fused_ws_kernel")


def _case(tag: str, spec: KernelSpec) -> LoweringCase:
    p = spec.kwargs
    entry = _ENTRIES[spec.name]
    if "fused_fwd" in spec.name or spec.name == "build_prepare_kernel" and p["is_varlen"]:
        entry += "_varlen"  # (the walks always take packed sequences)
    entry += "_states" if p.get("store_states") else "_normed" if p.get("gated_norm") else ""
    entry += "_limited" if p.get("limit_chunks") else ""
    if spec.name in _ELEMENTWISE:
        expect = ()
    elif spec.name == "build_decay_tables_kernel":
        expect = ("double",)  # the decay sums in float64
    elif spec.name in ("build_prepare_kernel", "build_partition_scan_kernel"):
        expect = ("mma",)
    else:
        expect = ("wgmma",)
    if spec.name in _WARP_SPECIALISED:
        expect += ("tma_load", "warpgroup_reg_alloc")
    if p.get("store_states") or spec.name == "build_fused_fwd_ws4_kernel":
        expect += ("tma_store",)
    if p.get("gated_norm"):
        expect += ("wgmma_rs", "AllReduce")  # P from registers; the norm's row sums
    name = spec.name.removeprefix("build_").removesuffix("_kernel")
    name += "_limited" if p.get("limit_chunks") else "_reverse" if p.get("reverse") else ""
    name += "_normed" if p.get("gated_norm") else ""
    return LoweringCase(f"{name}[{tag}]", spec, entry, expect)


@functools.lru_cache(maxsize=None)
def lowering_cases() -> tuple:
    """Every distinct spec of the plans above, once (named by the first plan that chose it)."""
    seen, cases = set(), []
    for tag, plan in (*_forward_plans(), *_backward_plans(), *_layer_plans()):
        for spec in plan.specs():
            if spec not in seen:
                seen.add(spec)
                cases.append(_case(tag, spec))
    return tuple(cases)
