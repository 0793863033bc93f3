"""Every kernel the plans choose, lowered to CUDA source for sm_90a on the CPU (no GPU, no nvcc).

Each kernel must build, pass TileLang's lowering, fit in a block's shared memory, and show its
entry point and instructions (wgmma, TMA, register hand-off). Skipped without tilelang.
"""

import inspect
import pkgutil
import re

import pytest

pytest.importorskip("tilelang")

from flash_qla_cp.kernels import hopper  # noqa: E402
from flash_qla_cp.kernels.backward import plan_backward  # noqa: E402
from flash_qla_cp.kernels.hopper.bwd_grad import build_bwd_grad_group_kernel  # noqa: E402
from flash_qla_cp.kernels.hopper.split_scan import build_partition_scan_kernel  # noqa: E402
from flash_qla_cp.kernels.hopper.v_head_chain import CHAIN_PRELUDE  # noqa: E402
from flash_qla_cp.kernels.lowering import (MAX_SHARED_MEMORY_SM90, lower_for_cuda, lower_spec,  # noqa: E402
                                           lowering_cases)
from flash_qla_cp.kernels.runtime import KernelSpec  # noqa: E402
from flash_qla_cp.kernels.split import SPLIT_MAX_HEAD_DIM, scan_block_v  # noqa: E402

CASES = lowering_cases()


def test_cases_reach_every_kernel_of_the_package():
    factories = set()
    for info in pkgutil.iter_modules(hopper.__path__):
        module = __import__(f"{hopper.__name__}.{info.name}", fromlist=["_"])
        factories |= {name for name, fn in inspect.getmembers(module, inspect.isfunction)
                      if name.startswith("build_") and fn.__module__ == module.__name__}
    assert factories == {c.spec.name for c in CASES}
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lower_kernel(case):
    kernel = lower_spec(case.spec, arch="sm_90a")
    src = kernel.source
    # more shared memory than a block may have lowers and compiles, then fails at launch
    assert kernel.shared_memory_bytes <= MAX_SHARED_MEMORY_SM90, (case.name, kernel.shared_memory_bytes)
    assert "__global__" in src and re.search(rf"\b{case.entry}_kernel\b", src), f"{case.name}: entry {case.entry!r}"
    for needle in case.expect:
        assert needle in src, f"{case.name}: expected {needle!r} in the generated CUDA source"
    # atomics would break determinism; the v-head chain's reductions are ordered (v_head_chain.py)
    assert "atomic" not in without_chain_reductions(src).lower(), f"{case.name}: atomics would break determinism"
    if case.spec.name == "build_bwd_fused_ws_kernel":
        assert_cross_warp_reductions_in_the_grad_warpgroup_only(src)
        # compiled without TileLang's bounds checks (`checks_own_bounds`), each of which compares a
        # global index with the tensor's dynamic length; the walk reads by TMA or at clamped rows
        body = "\n".join(line for line in src.splitlines() if "__global__" not in line)
        assert "num_tokens" not in body, f"{case.name}: TileLang's bounds checks were not left out"


def without_chain_reductions(src):
    """src without the v-head chain's ordered reductions: its prelude (which maps TileLang's
    column-pair adds to them), TileLang's atomics header and those adds; any other atomic stays."""
    if CHAIN_PRELUDE not in src:
        return src
    src = src.replace(CHAIN_PRELUDE, "").replace("#include <tl_templates/cuda/atomic.h>", "")
    return re.sub(r"\bAtomicAddx2\(", "(", src)


def assert_cross_warp_reductions_in_the_grad_warpgroup_only(src):
    """TileLang's cross-warp reductions (over 64 threads or more) sync on fixed named barriers
    (bar.sync 1 / 2): if both consumer warpgroups of the fused walk ran one, a barrier could
    complete with warps of both (non-deterministic dg). Only the grad warpgroup, threads
    128-255, may."""
    reduces = re.findall(r"AllReduce<tl::SumOp, (\d+), (\d+), (\d+), tl::NamedBarrier", src)
    assert reduces, "no reductions found: the pattern no longer matches the lowered source"
    cross_warp = [(int(t), int(off)) for t, _, off in reduces if int(t) >= 64]
    assert cross_warp and all(off == 128 for _, off in cross_warp), cross_warp


def test_zero_entry_scan_does_not_read_its_entry_states():
    """use_s0 off: the scan starts from zero without reading s0 (so callers need not fill one)."""
    def kernel_body(**params):
        src = lower_for_cuda(build_partition_scan_kernel(HV=4, K=128, V=128, block_v=16, **params)).source
        return src[src.index("__launch_bounds__"):]

    assert "(s0 +" in kernel_body(reverse=True)
    assert "s0" not in kernel_body(reverse=True, use_s0=False)


def test_split_kernels_past_the_supported_head_dim_do_not_fit():
    """Why split.SPLIT_MAX_HEAD_DIM is 128: at K = V = 256 the partition scan's K x K map needs
    more shared memory than a block may have (the forward then leaves such heads whole). Should
    a change make it fit, this fails: lift the limit."""
    assert SPLIT_MAX_HEAD_DIM == 128
    scan = build_partition_scan_kernel(HV=4, K=256, V=256, reverse=False, block_v=scan_block_v(256, 1, 4, 132))
    assert lower_for_cuda(scan).shared_memory_bytes > MAX_SHARED_MEMORY_SM90


WIDE = plan_backward(2, 4, 256, 256, "bfloat16", 256**-0.5, True, True, 1, 132)


@pytest.mark.parametrize("spec", [KernelSpec(build_bwd_grad_group_kernel, WIDE.grad.params),
                                  WIDE.dh_walk.replace(block_v=64)], ids=["grad_group", "dh_walk_block_v64"])
def test_wide_heads_backward_fits_only_without_the_grad_kernel(spec):
    """Why the backward of head dims past 128 takes the V-sliced grad kernel and runs the dh walk
    at block_v 32: at K = V = 256 the grad kernel, and the dh walk at block_v 64, need more shared
    memory than a block may have (the H200 refused that dh walk). Should the grad kernel come to
    fit, this fails: use it there."""
    assert lower_spec(spec).shared_memory_bytes > MAX_SHARED_MEMORY_SM90, spec.name


@pytest.mark.parametrize("K, V", [(128, 256), (256, 128)])
def test_wide_path_walks_fit(K, V):
    """The walks the wide path runs where one head dim is 256 and the other 128 (K = V = 256 is
    among the lowering cases; a head dim below 128 only shrinks the walks' tiles)."""
    wide = plan_backward(2, 4, K, V, "bfloat16", K**-0.5, True, True, 1, 132)
    for spec in (wide.h_walk, wide.dh_walk):
        smem = lower_spec(spec).shared_memory_bytes
        assert smem <= MAX_SHARED_MEMORY_SM90, (spec.name, K, V, smem)
