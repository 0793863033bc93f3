"""Lower the TileLang backward kernels to CUDA source for sm_90a on the CPU (no GPU, no nvcc).

By default every backward kernel is lowered for bf16 with K = V = 128 and for fp16 with
K = V = 64 (all kernels take packed, varlen inputs, so dense input is the same code); set
FLASH_QLA_CP_LOWER_ALL=1 to lower the whole matrix (both dtypes x both head sizes, plus the
MHA / no-state variant). Skipped when tilelang is not importable.
"""

import functools
import os
import re

import pytest

pytest.importorskip("tilelang")

from flash_qla_cp.kernels.lowering import MAX_SHARED_MEMORY_SM90, lower_for_cuda  # noqa: E402
from flash_qla_cp.kernels.tilelang_bwd_impl import lowering_cases  # noqa: E402

ALL = lowering_cases()
if os.environ.get("FLASH_QLA_CP_LOWER_ALL", "0") not in ("1", "true", "yes"):
    CASES = [c for c in ALL if c[0].endswith("_bfloat16_k128") or c[0].endswith("_float16_k64") or "_ws_" in c[0]
             or c[3] in ("gdn_bwd_fused_ws", "gdn_bwd_grad_wide")]
else:
    CASES = ALL


def test_cases_cover_every_kernel():
    entries = {c[3] for c in CASES}
    assert {"gdn_bwd_h", "gdn_bwd_dh", "gdn_bwd_dh_limited", "gdn_bwd_grad_group", "gdn_bwd_fused_ws",
            "gdn_v_head_sum", "gdn_bwd_grad_wide"} <= entries
    assert any("float16_k64" in c[0] for c in CASES) and any("bfloat16_k128" in c[0] for c in CASES)


@functools.lru_cache(maxsize=None)
def lowered(name):
    _, factory, params, _ = next(c for c in CASES if c[0] == name)
    return lower_for_cuda(factory(**params), arch="sm_90a")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lower_bwd_kernel(case):
    name, factory, params, entry = case
    kernel = lowered(name)
    src = kernel.source
    # more shared memory than a block may have lowers and compiles, then fails at launch
    assert kernel.shared_memory_bytes <= MAX_SHARED_MEMORY_SM90, (name, kernel.shared_memory_bytes)
    assert "__global__" in src and entry in src, f"{name}: entry {entry!r} missing"
    if entry != "gdn_v_head_sum":  # the GVA sum is elementwise: no GEMM, no shared memory
        assert kernel.shared_memory_bytes > 0, name
        assert "wgmma" in src, f"{name}: no wgmma in the generated source"
    assert "atomic" not in src.lower(), f"{name}: atomics would break determinism"


def test_fused_ws_walk_reduces_across_warps_only_in_grad_warpgroup():
    """TileLang's cross-warp reductions (over 64 threads or more) sync on fixed named barriers
    (bar.sync 1 / 2): if both consumer warpgroups of the ws walk ran one, a barrier could
    complete with warps of both (the v2 race: non-deterministic dg). Only the grad warpgroup,
    threads 128-255, may."""
    src = lowered("gdn_bwd_fused_ws_k128").source
    reduces = re.findall(r"AllReduce<tl::SumOp, (\d+), (\d+), (\d+), tl::NamedBarrier", src)
    assert reduces, "no reductions found: the pattern no longer matches the lowered source"
    cross_warp = [(int(t), int(off)) for t, _, off in reduces if int(t) >= 64]
    assert cross_warp and all(off == 128 for _, off in cross_warp), cross_warp


def test_wide_heads_backward_fits_only_without_the_grad_kernel():
    """Why the backward's wide path (head dims past 128) replaces the grad kernel and runs the dh
    walk at block_v 32: at K = V = 256 the grad kernel, and the dh walk at its default block_v 64,
    need more shared memory than a block may have (the H200 refused that dh walk); the walks at
    32 fit. Should the grad kernel come to fit, this fails: use it there."""
    from flash_qla_cp.kernels.tilelang_bwd_impl import bwd_kernel_specs

    _, (dh_factory, dh_params), (grad_factory, grad_params) = bwd_kernel_specs(
        2, 4, 256, 256, "bfloat16", 256**-0.5, True, True)
    for factory, params in ((dh_factory, dh_params), (grad_factory, grad_params)):
        assert lower_for_cuda(factory(**params)).shared_memory_bytes > MAX_SHARED_MEMORY_SM90, factory.__name__
    # the walks the wide path runs, at every head-dim pair with a 256 in it
    for K, V in ((256, 256), (128, 256), (256, 128), (64, 256), (256, 64)):
        for factory, params in bwd_kernel_specs(2, 4, K, V, "bfloat16", K**-0.5, True, True, block_v=32)[:2]:
            smem = lower_for_cuda(factory(**params)).shared_memory_bytes
            assert smem <= MAX_SHARED_MEMORY_SM90, (factory.__name__, K, V, smem)
