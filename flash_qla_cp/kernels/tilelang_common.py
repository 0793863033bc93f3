"""Helpers shared by the TileLang kernels: lazy imports, dtype names, compile cache, chunk tables.

Nothing here touches a GPU or compiles anything at import time; TileLang itself is imported
only when a kernel is first built, so the package imports on machines without it.

The elementwise rule every kernel follows (the comments there point here): a `T.Parallel` loop
either loads (shared memory into a register fragment) or stores (`T.copy(fragment, shared)`,
which lowers to stmatrix), and no shared load sits under `T.if_then_else` (masks go in a loop
of their own without loads). Otherwise nvcc serialises load -> exp -> store per element: all
shared buffers are offsets into one array, so it cannot move a load above an earlier store, and
a condition around a load becomes a branch per element (H200: ~1.3k cycles per such step of a
64 x 64 tile; benchmarks/NOTES.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

import torch

CHUNK = 64  # chunk length used by every chunked kernel

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
    except KeyError as exc:  # pragma: no cover - guarded by callers
        raise TypeError(f"unsupported dtype for TileLang kernels: {dtype}") from exc


def tilelang_available() -> bool:
    """True when `import tilelang` works (it does on CPU-only machines too)."""
    try:
        import tilelang  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


_SM_COUNTS: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device; grids are sized by it)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(idx)
    if count is None:
        count = _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return count


def import_tilelang():
    """(tilelang, tilelang.language) imported on demand."""
    import tilelang
    import tilelang.language as T

    return tilelang, T


def swizzle_read_tiles(*tiles):
    """Give TMA-filled shared tiles that threads read elementwise (never as a GEMM operand, so
    TileLang picks no layout for them) the 128-byte swizzle: read in an accumulator's layout,
    the 8 rows a warp touches at once are 2^k * 128 bytes apart in a row-major tile and share
    their banks (8-way conflicts, ncu). The TMA writes the swizzle; reads follow it. Call inside
    a kernel body."""
    tilelang, T = import_tilelang()
    T.annotate_layout({t: tilelang.layout.make_swizzled_layout(t) for t in tiles})


# The walk kernels run one block per SM (their shared memory), so a grid "fills the GPU" once
# its blocks cover ~90% of the SMs: the rule behind the forward's V tiles, the split backward's
# V tiles and the fused backward walk (H200 measurements at each use).
GRID_FILL_FRACTION = 0.9


def grid_fills_gpu(blocks: int, sm_count: int) -> bool:
    return blocks >= GRID_FILL_FRACTION * sm_count


def default_pass_configs() -> dict:
    tilelang, _ = import_tilelang()
    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


_compile_lock = threading.Lock()
_kernel_cache: dict = {}


def _key(factory, params: dict):
    return (factory.__module__, factory.__qualname__, tuple(sorted(params.items())))


# When set, every kernel built in this process (compile_kernel or precompile; compiled or loaded
# from TileLang's disk cache) is appended to this file as one JSON line (module, factory,
# params): a GPU run lists the kernels it used, so that the next one can have
# those kernels built beforehand on a CPU machine (tests/gpu/precompile_cache.py reads the file).
KERNEL_LOG_ENV = "FLASH_QLA_CP_KERNEL_LOG"


def _log_kernel(factory, params: dict):
    path = os.environ.get(KERNEL_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"module": factory.__module__, "factory": factory.__qualname__,
                                "params": params}) + "\n")


# Launch kernels through the compiled module's entry function instead of TileLang's adapter
# (`DirectLaunch`). H200, host us per launch (results/launch_paths_h200_2026-12-04.json): 10-19
# through the adapter, 6-13 direct; TP8 1x32k eager fwd 0.230 -> 0.194 ms, fwd+bwd 1.389 ->
# 1.217 (results/bench_kernels_h200_2026-12-04_switches.md). Off: TileLang's own call path.
DIRECT_LAUNCH = True


def switches(**values):
    """Set this module's switches (DIRECT_LAUNCH) inside a `with` block."""
    return switched_globals(globals(), **values)


class DirectLaunch:
    """A compiled kernel called through its module's entry function. Our kernels take every
    output as an argument (no `out_idx`), so TileLang's adapter, which would allocate outputs,
    only re-packs the arguments on each call: Python time on every launch. The entry function
    still checks each argument's shape, dtype and device against the kernel's signature."""

    __slots__ = ("kernel", "_entry")

    def __init__(self, kernel):
        self.kernel = kernel
        self._entry = None

    def __call__(self, *args):
        entry = self._entry
        if entry is None:  # looked up on first launch: loading the module needs the GPU
            entry = self._entry = self._entry_function()
        entry(*args)

    def _entry_function(self):
        get_executable = getattr(self.kernel.adapter, "_get_executable", None)  # TileLang's tvm-ffi adapter
        if get_executable is None:  # another execution backend: its own call path
            return self.kernel
        executable = get_executable()
        # a kernel compiled in this process gives a tvm Executable (its runnable module comes from
        # jit()); one loaded from TileLang's disk cache gives the module itself
        module = executable.jit() if hasattr(executable, "jit") else executable
        return module.main


_direct_launchers: dict = {}


def compile_kernel(factory, **params):
    """Build `factory(**params)` into a runnable TileLang kernel on first use, then reuse it.

    The cache key is the factory and its (hashable) shape/dtype parameters; dynamic sizes
    (token count, number of chunks, number of sequences) are symbolic inside the kernels, so
    they do not trigger recompilation.
    """
    key = _key(factory, params)
    kern = _kernel_cache.get(key)
    if kern is None:
        with _compile_lock:
            kern = _kernel_cache.get(key)
            if kern is None:
                tilelang, _ = import_tilelang()
                kern = tilelang.compile(factory(**params), target="cuda", pass_configs=default_pass_configs())
                _kernel_cache[key] = kern
                _log_kernel(factory, params)
    if DIRECT_LAUNCH:
        launcher = _direct_launchers.get(key)
        if launcher is None:
            launcher = _direct_launchers.setdefault(key, DirectLaunch(kern))
        return launcher
    return kern


def precompile(specs, num_workers: int = 8) -> int:
    """Compile many (factory, params) pairs in parallel (tilelang.par_compile) into the cache.

    Returns the number of kernels compiled. Kernels already cached are skipped.
    """
    todo = {}  # cache key -> (factory, params): each missing kernel once, in the specs' order
    for factory, params in specs:
        key = _key(factory, params)
        if key not in _kernel_cache:
            todo.setdefault(key, (factory, params))
    if not todo:
        return 0
    tilelang, _ = import_tilelang()
    kernels = tilelang.par_compile(
        [factory(**params) for factory, params in todo.values()], target="cuda",
        pass_configs=default_pass_configs(), num_workers=num_workers,
    )
    with _compile_lock:
        for (key, (factory, params)), kern in zip(todo.items(), kernels):
            _kernel_cache[key] = kern
            _log_kernel(factory, params)
    return len(todo)


def kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and 16-byte aligned, as the kernels' vector and TMA loads need. A view at an
    odd element offset (e.g. x[1:] of a gathered buffer) is contiguous but misaligned: copy it."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def state_kv_layout(state: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    """fp32 contiguous state as [..., K, V] when the caller's layout is [..., V, K]
    (state_v_first), else as given; the same swap turns a [..., K, V] result back."""
    state = state.float()
    return kernel_operand(state.transpose(-1, -2) if state_v_first else state)


def chunk_table(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """[NC, 2] int32 table of (sequence index, chunk index inside the sequence) for packed inputs.

    Built with torch on the device of `cu_seqlens`; reading the total chunk count costs one
    host sync (the grid size must be known on the host).
    """
    offsets = chunk_offsets(cu_seqlens, chunk).to(torch.int64)
    n_chunks = offsets[1:] - offsets[:-1]
    total = int(offsets[-1].item())
    seq_ids = torch.repeat_interleave(torch.arange(len(n_chunks), device=offsets.device), n_chunks,
                                      output_size=total)
    local = torch.arange(total, device=offsets.device) - offsets[:-1][seq_ids]
    return torch.stack([seq_ids, local], dim=1).to(torch.int32).contiguous()


def chunk_offsets(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """[N + 1] int32: the index of each sequence's first chunk in the packed chunk order of
    `chunk_table` (the last entry is the total), computed on the device of `cu_seqlens`."""
    cu = cu_seqlens.to(torch.int64)
    n_chunks = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    out = torch.zeros(cu.shape[0], dtype=torch.int32, device=cu.device)
    out[1:] = torch.cumsum(n_chunks, 0).to(torch.int32)
    return out


# Walk order of varlen grids. A walk kernel runs one block per (sequence, v-head) for the whole
# sequence; with more blocks than SMs the GPU starts them in grid order as SMs free up, so a long
# sequence started last sets the kernel's end. Blocks take their sequence from an order table,
# longest first (greedy longest-processing-time scheduling): the bench's 8 uneven documents in 32k
# (TP1, 256 walks on 132 SMs) finish after ~132 chunk steps per SM instead of ~188 in order.
def walk_order(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] int32 sequence indices of `cu_seqlens`, longest first (ties in index order), computed
    on its device."""
    lengths = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1].to(torch.int64)
    return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)


def ordered_block(order, block_seq, block_head, num_seqs, HV):
    """(sequence, v-head) of the block at grid position (block_seq, block_head) of a (.., N, HV)
    walk grid: the grid's blocks in launch order take the sequences of `order` (a `walk_order`
    table) in turn, all v-heads of one sequence together (expressions for a TileLang kernel body)."""
    slot = block_seq + num_seqs * block_head
    return order[slot // HV], slot % HV


@contextlib.contextmanager
def switched_globals(namespace: dict, **values):
    """Set module-level kernel switches (names already in `namespace`, a module's globals())
    for the duration of a `with` block, then restore them; a misspelt switch raises KeyError."""
    old = {name: namespace[name] for name in values}
    namespace.update(values)
    try:
        yield
    finally:
        namespace.update(old)
