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
             or c[3] == "gdn_bwd_fused_ws"]
else:
    CASES = ALL


def test_cases_cover_every_kernel():
    entries = {c[3] for c in CASES}
    assert {"gdn_bwd_h", "gdn_bwd_dh", "gdn_bwd_dh_limited", "gdn_bwd_grad_group", "gdn_bwd_fused_ws",
            "gdn_v_head_sum"} <= entries
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
    # atomic adds into sums would make them order-dependent; the one atomic allowed is the
    # integer count of v-heads done per chunk (sum_v_heads), which picks who adds, not the order
    rest = src
    if "sum_v_heads" in name:
        rest = re.sub(r"#include[^\n]*", "", src).replace("AtomicAddRet((&(arrivals[", "")
    assert "atomic" not in rest.lower(), f"{name}: atomics would break determinism"


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


def test_last_v_head_to_arrive_adds_the_parts():
    """sum_v_heads: the grad warpgroup fences its part stores, syncs on its own named barrier (8,
    not TileLang's reduction barriers), counts the v-head in with one acq_rel atomic add (memory
    order 4) on the arrivals, and only the last arriver fences again and reads the parts back."""
    src = lowered("gdn_bwd_fused_ws_k128_sum_v_heads").source
    assert len(re.findall(r"AtomicAddRet\(\(&\(arrivals\[[^;]*, 1, 4\)", src)) == 1
    assert src.count("__sync_thread_partial(8, 128)") == 2
    assert src.count("__threadfence()") == 2
    assert "arrivals" not in lowered("gdn_bwd_fused_ws_k128").source
