"""What every Hopper kernel file shares: the lazy TileLang import, dtype names, LOG2E, pass
configuration, the swizzle for elementwise-read tiles and the walk-order block mapping.

Nothing here touches a GPU or compiles anything at import time; TileLang itself is imported
only when a kernel is first built, so the package imports on machines without it.

The elementwise rule every kernel follows (the comments there point here): a `T.Parallel` loop
either loads (shared memory into a register fragment) or stores (`T.copy(fragment, shared)`,
which lowers to stmatrix), and no shared load sits under `T.if_then_else` (masks go in a loop
of their own without loads). Otherwise nvcc serialises load -> exp -> store per element: all
shared buffers are offsets into one array, so it cannot move a load above an earlier store, and
a condition around a load becomes a branch per element (docs/kernels.md).
"""

from __future__ import annotations

import torch

from ...constants import CHUNK

__all__ = ["CHUNK", "LOG2E", "import_tilelang", "tl_dtype", "pass_configs", "checks_own_bounds",
           "swizzle_read_tiles", "ordered_block"]

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): the kernels use the exp2 unit

_TORCH_TO_TL = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.int32: "int32",
}


def tl_dtype(dtype: torch.dtype | str) -> str:
    """TileLang dtype name for a torch dtype (strings pass through)."""
    if isinstance(dtype, str):
        return dtype
    try:
        return _TORCH_TO_TL[dtype]
    except KeyError as exc:
        raise TypeError(f"unsupported dtype for TileLang kernels: {dtype}") from exc


def import_tilelang():
    """(tilelang, tilelang.language) imported on demand."""
    import tilelang
    import tilelang.language as T

    return tilelang, T


def lowers_slowly(builder):
    """Marks a kernel builder whose PrimFunc takes several times longer than the others' to lower
    (the fused backward walk: ~17 of a cold start's ~24 s compile round): a parallel compile
    builds and starts it before building the others (`kernels.runtime.precompile`)."""
    builder.lowers_slowly = True
    return builder


def checks_own_bounds(builder):
    """Marks a kernel builder whose global reads and writes are all in bounds by construction
    (stores guarded by the sequence's valid rows, clamped reads, TMA's zero fill past a tensor's
    end): its kernel is compiled without TileLang's bounds check around every global access. In
    the fused backward walk those checks were a tenth of its instructions (8208 of them against
    7400 without, sm_90a SASS)."""
    builder.checks_own_bounds = True
    return builder


def pass_configs(builder=None) -> dict:
    """TileLang's pass configuration for the kernel of `builder` (a kernel factory)."""
    tilelang, _ = import_tilelang()
    configs = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
    if getattr(builder, "checks_own_bounds", False):
        configs[tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS] = True
    return configs


def swizzle_read_tiles(*tiles):
    """Give TMA-filled shared tiles that threads read elementwise (never as a GEMM operand, so
    TileLang picks no layout for them) the 128-byte swizzle: read in an accumulator's layout,
    the 8 rows a warp touches at once are 2^k * 128 bytes apart in a row-major tile and share
    their banks (8-way conflicts, ncu). The TMA writes the swizzle; reads follow it. Call inside
    a kernel body."""
    tilelang, T = import_tilelang()
    T.annotate_layout({t: tilelang.layout.make_swizzled_layout(t) for t in tiles})


def ordered_block(order, block_seq, block_head, num_seqs, HV):
    """(sequence, v-head) of the block at grid position (block_seq, block_head) of a (.., N, HV)
    walk grid: the grid's blocks in launch order take the sequences of `order` (a
    `kernels.tables.walk_order` table, longest first) in turn, all v-heads of one sequence
    together (expressions for a TileLang kernel body)."""
    slot = block_seq + num_seqs * block_head
    return order[slot // HV], slot % HV
