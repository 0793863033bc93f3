"""Lower TileLang kernels to CUDA source on a machine without a GPU (used by CI).

`lower_to_cuda_source(prim_func)` runs TileLang's lowering for an explicit CUDA target, so
wgmma / TMA code paths are generated and can be inspected without a device or nvcc.
`KERNEL_REGISTRY` names every kernel factory with representative parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


# Shared memory one block may opt into on Hopper (sm_90: 227 KiB); a kernel asking for more
# lowers and compiles but fails at launch, so the CPU tests check it.
MAX_SHARED_MEMORY_SM90 = 227 * 1024


@dataclass(frozen=True)
class LoweredKernel:
    source: str  # CUDA C++ of the device code
    shared_memory_bytes: int  # dynamic shared memory per block (0 if none)


def lower_for_cuda(prim_func, arch: str = "sm_90a") -> LoweredKernel:
    """Lower `prim_func` for `arch` (no GPU, no nvcc needed): its CUDA source and shared memory."""
    import tilelang
    import tvm

    from .tilelang_common import default_pass_configs

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(opt_level=3, config=default_pass_configs()), target:
        artifact = tilelang.lower(prim_func, target=target)
    smem = max((int(fn.attrs["dyn_shared_memory_buf"]) for fn in artifact.device_mod.functions.values()
                if fn.attrs is not None and "dyn_shared_memory_buf" in fn.attrs), default=0)
    return LoweredKernel(artifact.kernel_source, smem)


def lower_to_cuda_source(prim_func, arch: str = "sm_90a") -> str:
    """CUDA C++ source of `prim_func` lowered for `arch` (no GPU, no nvcc needed)."""
    return lower_for_cuda(prim_func, arch).source


@dataclass(frozen=True)
class KernelCase:
    """One kernel factory with one set of parameters and what its source must show."""

    name: str
    factory: Callable
    params: dict
    entry: str  # name of the __global__ function expected in the source
    expect: tuple = field(default=())  # substrings that must appear (e.g. "wgmma")

    def build(self):
        return self.factory(**self.params)


def _forward_cases() -> list[KernelCase]:
    from .tilelang_fwd import build_fused_fwd_kernel, build_prepare_kernel

    cases = []
    for dtype in ("bfloat16", "float16"):
        for dim in (128, 64):
            for varlen in (False, True):
                tag = f"{dtype}_k{dim}_{'varlen' if varlen else 'dense'}"
                cases.append(
                    KernelCase(
                        name=f"fwd_prepare_{tag}",
                        factory=build_prepare_kernel,
                        params=dict(H=2, HV=4, K=dim, dtype=dtype, is_varlen=varlen),
                        entry="gdn_fwd_prepare_varlen" if varlen else "gdn_fwd_prepare",
                        expect=("mma",),
                    )
                )
                cases.append(
                    KernelCase(
                        name=f"fwd_fused_{tag}",
                        factory=build_fused_fwd_kernel,
                        params=dict(
                            H=2,
                            HV=4,
                            K=dim,
                            V=dim,
                            dtype=dtype,
                            scale=dim**-0.5,
                            is_varlen=varlen,
                            use_initial_state=True,
                            store_final_state=True,
                            state_v_first=varlen and dim == 128,
                            block_v=64,
                        ),
                        entry="gdn_fwd_fused_varlen" if varlen else "gdn_fwd_fused",
                        expect=("wgmma",),
                    )
                )
    # the other tile configurations default_fused_config picks
    for bv, threads in ((32, 256), (16, 128)):
        cases.append(
            KernelCase(
                name=f"fwd_fused_bfloat16_k128_varlen_bv{bv}_t{threads}",
                factory=build_fused_fwd_kernel,
                params=dict(
                    H=16, HV=32, K=128, V=128, dtype="bfloat16", scale=128**-0.5, is_varlen=True,
                    use_initial_state=False, store_final_state=True, block_v=bv, threads=threads,
                ),
                entry="gdn_fwd_fused_varlen",
                expect=("wgmma",),
            )
        )
    return cases + _warp_specialized_cases() + _wide_head_cases()


def _wide_head_cases() -> list[KernelCase]:
    """Head dims of 256 (and 256 mixed with 128): the tiles `default_fused_config` picks there,
    every one of which must fit in a block's shared memory."""
    from .tilelang_fwd import build_fused_fwd_kernel, build_prepare_kernel
    from .tilelang_fwd_ws import build_fused_fwd_ws_kernel
    from .tilelang_fwd_ws4 import build_fused_fwd_ws4_kernel

    cases = [KernelCase(name="fwd_prepare_bfloat16_k256_varlen", factory=build_prepare_kernel,
                        params=dict(H=2, HV=4, K=256, dtype="bfloat16", is_varlen=True),
                        entry="gdn_fwd_prepare_varlen", expect=("mma",))]
    # (factory, K, V, block_v, varlen, state_v_first, options)
    for factory, K, V, bv, varlen, v_first, opts in (
        (build_fused_fwd_kernel, 256, 256, 16, True, False, {"threads": 128}),
        (build_fused_fwd_kernel, 256, 256, 32, False, True, {"threads": 128}),
        (build_fused_fwd_kernel, 256, 128, 16, False, False, {"threads": 128}),
        (build_fused_fwd_ws_kernel, 128, 256, 16, False, False, {}),
        (build_fused_fwd_ws4_kernel, 128, 256, 128, True, False, {"o_tma": True}),
    ):
        kind = {build_fused_fwd_ws_kernel: "ws_", build_fused_fwd_ws4_kernel: "ws4_"}.get(factory, "")
        cases.append(
            KernelCase(
                name=f"fwd_fused_{kind}k{K}v{V}_bv{bv}_{'varlen' if varlen else 'dense'}",
                factory=factory,
                params=dict(H=2, HV=4, K=K, V=V, dtype="bfloat16", scale=K**-0.5, is_varlen=varlen,
                            use_initial_state=True, store_final_state=True, state_v_first=v_first, block_v=bv,
                            **opts),
                entry="gdn_fwd_fused_varlen" if varlen else "gdn_fwd_fused",
                expect=("wgmma",),
            )
        )
    return cases


def _warp_specialized_cases() -> list[KernelCase]:
    from .tilelang_fwd_ws import build_fused_fwd_ws_kernel
    from .tilelang_fwd_ws4 import build_fused_fwd_ws4_kernel

    cases = []
    # three warpgroups: the default tiles, then the options: a three-stage ring; the chunk states
    # kept for the backward (TMA stores from the output warpgroup). Four warpgroups
    # (tilelang_fwd_ws4.py): a whole 128-wide state per block, with and without the stores, and
    # o through a shared tile and a TMA store.
    for factory, bv, dim, varlen, v_first, opts in (
        (build_fused_fwd_ws_kernel, 64, 128, False, False, {}),
        (build_fused_fwd_ws_kernel, 32, 128, True, True, {}),
        (build_fused_fwd_ws_kernel, 16, 64, True, False, {}),
        (build_fused_fwd_ws_kernel, 64, 128, True, False, {"num_stages": 3}),
        (build_fused_fwd_ws_kernel, 64, 128, True, False, {"store_states": True}),
        (build_fused_fwd_ws_kernel, 32, 128, False, True, {"store_states": True}),
        (build_fused_fwd_ws4_kernel, 128, 128, True, False, {}),
        (build_fused_fwd_ws4_kernel, 128, 128, False, True, {"store_states": True}),
        (build_fused_fwd_ws4_kernel, 64, 128, True, False, {"store_states": True}),
        (build_fused_fwd_ws4_kernel, 128, 128, True, False, {"o_tma": True}),
        (build_fused_fwd_ws4_kernel, 128, 128, False, False, {"store_states": True, "o_tma": True}),
    ):
        tag = "".join(f"_{k}{int(v)}" for k, v in opts.items())
        kind = "ws4" if factory is build_fused_fwd_ws4_kernel else "ws"
        entry = "gdn_fwd_fused_varlen" if varlen else "gdn_fwd_fused"
        # TMA loads into mbarriers, register hand-off between warpgroups
        expect = ("wgmma", "tma_load", "warpgroup_reg_alloc")
        if opts.get("store_states"):
            entry = entry + "_states"
        if opts.get("store_states") or opts.get("o_tma"):
            expect = expect + ("tma_store",)
        cases.append(
            KernelCase(
                name=f"fwd_fused_{kind}_k{dim}_bv{bv}_{'varlen' if varlen else 'dense'}{tag}",
                factory=factory,
                params=dict(
                    H=2, HV=4, K=dim, V=dim, dtype="bfloat16", scale=dim**-0.5, is_varlen=varlen,
                    use_initial_state=True, store_final_state=True, state_v_first=v_first, block_v=bv, **opts,
                ),
                entry=entry,
                expect=expect,
            )
        )
    return cases


def _split_cases() -> list[KernelCase]:
    from .tilelang_split import split_kernel_specs

    cases = []
    for dim in (128, 64):
        for factory, params in split_kernel_specs(2, 4, dim, dim, "bfloat16"):
            if factory.__name__ == "build_decay_tables_kernel":
                if dim == 128:  # depends on HV only
                    cases.append(KernelCase(name="split_decay_tables", factory=factory, params=params,
                                            entry="gdn_decay_tables", expect=("double",)))
                continue
            is_scan = "reverse" in params
            if is_scan:  # e.g. scan_reverse_bv16, scan_bv32_zero_entry (use_s0 off: the scan enters at zero)
                tag = (("scan_reverse" if params["reverse"] else "scan") + f"_bv{params['block_v']}"
                       + ("" if params.get("use_s0", True) else "_zero_entry"))
            else:
                tag = "summary"
            cases.append(
                KernelCase(
                    name=f"split_{tag}_k{dim}",
                    factory=factory,
                    params=params,
                    entry="gdn_partition_scan" if is_scan else "gdn_state_summary",
                    expect=("mma",) if is_scan else ("wgmma",),
                )
            )
    return cases


def kernel_registry() -> list[KernelCase]:
    """The forward and intra-card split kernel factories with representative parameters (the
    backward kernels are lowered by tests/test_kernels_lower_bwd.py)."""
    return _forward_cases() + _split_cases()
