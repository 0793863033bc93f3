"""Compiling and launching the Hopper kernels: kernel specs, the in-process cache, parallel
precompilation, the direct launch path and the operand rules.

Host code launches every kernel as `runtime.compile_kernel(spec)(*args)`; that one call is where
tests record launches instead of running them, and where a GPU run logs the kernels it built.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import prim_func_store
from .hopper.common import import_tilelang, pass_configs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its factory (a function of `kernels.hopper` returning a PrimFunc) and the
    parameters it is built with (sorted (name, value) pairs, so that a spec is hashable and
    two equal specs are one cache entry)."""

    factory: Callable
    params: tuple

    @classmethod
    def of(cls, factory, **params) -> "KernelSpec":
        return cls(factory, tuple(sorted(params.items())))

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    @property
    def name(self) -> str:
        return self.factory.__name__

    def replace(self, **params) -> "KernelSpec":
        return KernelSpec.of(self.factory, **{**self.kwargs, **params})

    def build(self):
        """The PrimFunc (no GPU needed)."""
        return self.factory(**self.kwargs)


_SM_COUNTS: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device; grids are sized by it)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(idx)
    if count is None:
        count = _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return count


# The walk kernels run one block per SM (their shared memory), so a grid "fills the GPU" once
# its blocks cover ~90% of the SMs: the rule behind the forward's V tiles, the split backward's
# V tiles and the fused backward walk.
GRID_FILL_FRACTION = 0.9


def grid_fills_gpu(blocks: int, sms: int) -> bool:
    return blocks >= GRID_FILL_FRACTION * sms


# When set, every kernel built in this process is appended to this file as one JSON line
# (module, factory, params): a GPU run lists the kernels it used, so that the next one can have
# them built beforehand on a CPU machine (tools/precompile_cache.py reads the file).
KERNEL_LOG_ENV = "FLASH_QLA_CP_KERNEL_LOG"


def kernel_log_line(spec: KernelSpec) -> str:
    """spec as a line of a kernel log (what tools/precompile_cache.py --log reads back)."""
    return json.dumps({"module": spec.factory.__module__, "factory": spec.factory.__qualname__,
                       "params": spec.kwargs}) + "\n"


def _log_kernel(spec: KernelSpec):
    path = os.environ.get(KERNEL_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(kernel_log_line(spec))


class DirectLaunch:
    """A compiled kernel called through its module's entry function. Our kernels take every
    output as an argument (no `out_idx`), so TileLang's adapter, which would allocate outputs,
    only re-packs the arguments on each call (H200: 10-19 us of host time per launch through
    the adapter, 6-13 direct). The entry function still checks each argument's shape, dtype and
    device against the kernel's signature.

    The module is loaded when the launcher is made, in the compile pool's thread. A kernel
    compiled in this process is loaded from the library TileLang's cache has just saved for it;
    without one (cache disabled) its host code is built into a library again (0.2-1 s each).
    Done one by one at the first launches, that build cost a cold first fwd+bwd of the layer
    5.3 s on the H100 machine. Loading needs no GPU."""

    __slots__ = ("kernel", "_entry")

    def __init__(self, kernel):
        self.kernel = kernel
        self._entry = self._entry_function()

    def __call__(self, *args):
        self._entry(*args)

    def _entry_function(self):
        get_executable = getattr(self.kernel.adapter, "_get_executable", None)  # TileLang's tvm-ffi adapter
        if get_executable is None:  # another execution backend: its own call path
            return self.kernel
        executable = get_executable()
        if hasattr(executable, "jit"):  # compiled in this process: a tvm Executable, not yet a module
            saved = _saved_library(self.kernel)
            module = tilelang_runtime_module(saved) if saved else executable.jit()
        else:  # loaded from TileLang's disk cache: the module itself
            module = executable
        return module.main


def _saved_library(kernel) -> str | None:
    """The library TileLang's kernel cache saved for a kernel it just compiled, if there is one
    (TileLang 0.1.15 tags the kernel with its cache folder; the tvm-ffi backend's file name)."""
    folder = getattr(kernel, "_tilelang_cache_path", None)
    path = os.path.join(folder, "executable.so") if folder else None
    return path if path and os.path.isfile(path) else None


def tilelang_runtime_module(path: str):
    from tilelang import tvm

    return tvm.runtime.load_module(path)


_compile_lock = threading.Lock()
_launchers: dict = {}
_ready_plans: set = set()


@contextlib.contextmanager
def _compiling():
    """Held while this process compiles: a thread lock, and a file lock in TileLang's kernel
    cache directory, so that ranks starting together compile each kernel once; the others wait,
    then load it from the disk cache (TileLang's cache, TILELANG_CACHE_DIR, ~/.tilelang/cache by
    default)."""
    from tilelang import env

    os.makedirs(env.TILELANG_CACHE_DIR, exist_ok=True)
    with _compile_lock, open(os.path.join(env.TILELANG_CACHE_DIR, "flash_qla_cp.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def compile_kernel(spec: KernelSpec) -> DirectLaunch:
    """The launcher of `spec`, compiled (or loaded from the disk cache) on first use.

    Dynamic sizes (token count, number of chunks, number of sequences) are symbolic inside the
    kernels, so they do not trigger recompilation."""
    launcher = _launchers.get(spec)
    if launcher is None:
        precompile([spec], num_workers=1)
        launcher = _launchers[spec]
    return launcher


_round_records: list = []


@contextlib.contextmanager
def recorded_rounds():
    """Within it, every round of building or loading kernels (a `precompile` call that had any)
    is appended to the list it yields as {"kernels": n, "s": wall seconds} (the first round's
    seconds include TileLang's import): what a cold start spends compiling."""
    rounds = []
    _round_records.append(rounds)
    try:
        yield rounds
    finally:
        _round_records.remove(rounds)


def precompile(specs, num_workers: int = 8) -> int:
    """Compile many specs in parallel (a pool of TileLang compiles) into the cache; returns how
    many were compiled or loaded (those already in this process are skipped)."""
    called = time.perf_counter()
    built = _precompile(specs, num_workers)
    if built:
        for rounds in _round_records:
            rounds.append({"kernels": built, "s": round(time.perf_counter() - called, 2)})
    return built


def _precompile(specs, num_workers: int) -> int:
    todo = list(dict.fromkeys(s for s in specs if s not in _launchers))
    if not todo:
        return 0
    tilelang, _ = import_tilelang()
    with _compiling():
        todo = [s for s in todo if s not in _launchers]  # (another thread may have built them)
        if not todo:
            return 0
        start = time.perf_counter()
        # (a new configuration's first call waits here: tens of seconds when nothing is cached)
        log.info("%d TileLang kernel(s) to load from the disk cache %s or compile there", len(todo),
                 tilelang.env.TILELANG_CACHE_DIR)
        with _short_gil_turns():
            launchers = _compile_in_pool(todo, num_workers)
        for spec, launcher in zip(todo, launchers):
            _launchers[spec] = launcher
            _log_kernel(spec)
        log.info("%d TileLang kernel(s) ready in %.1f s", len(todo), time.perf_counter() - start)
    return len(todo)


def compile_spec(spec: KernelSpec, prim_func):
    """TileLang's compiled kernel of `prim_func` (the spec's PrimFunc), with the pass
    configuration of the spec's builder (`hopper.common.pass_configs`)."""
    tilelang, _ = import_tilelang()
    return tilelang.compile(prim_func, target="cuda", pass_configs=pass_configs(spec.factory))


def _compile_in_pool(specs, num_workers: int) -> list:
    """The specs' launchers (compiled, their modules loaded). Each PrimFunc goes to the pool as
    soon as it is built (its builder runs here, in Python: ~2 s for a layer's 15 kernels when
    none is saved), the slow lowering ones (`hopper.common.lowers_slowly`) built and started
    first: a cold start's round lasts about as long as its slowest kernel's build, counted from
    when that kernel started."""
    def compile_one(spec, prim_func):
        return DirectLaunch(compile_spec(spec, prim_func))

    if len(specs) == 1:  # (in the calling thread, as a lone launch's compile always ran)
        return [compile_one(specs[0], prim_func_store.prim_func(specs[0]))]
    order = sorted(range(len(specs)), key=lambda i: not getattr(specs[i].factory, "lowers_slowly", False))
    launchers = [None] * len(specs)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(num_workers, len(specs))), "flash-qla-cp-compile") as pool:
        # (TileLang's lowering releases the GIL and nvcc is a subprocess: threads run in parallel)
        futures = {pool.submit(compile_one, specs[i], prim_func_store.prim_func(specs[i])): i for i in order}
        for future, i in futures.items():
            launchers[i] = future.result()
    return launchers


# Python's thread switch interval during a compile round (the default is 5 ms)
COMPILE_SWITCH_INTERVAL_S = 1e-4


@contextlib.contextmanager
def _short_gil_turns():
    """Shorter GIL turns while this process compiles. TileLang's kernel builders and lowering run
    mostly in C++ with the GIL released but take it back many times; each time another thread
    holds it, they wait out that thread's whole turn. Beside one pure-Python
    thread the fused backward walk's build (its builder and lowering) took 120 s at the default
    5 ms, 25 s at 0.1 ms, 18 s alone (2-core CPU machine, `tools/gil_turns.py`). Restored after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, COMPILE_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def compiled(spec: KernelSpec) -> bool:
    """Whether this process has `spec`'s launcher (compiled or loaded)."""
    return spec in _launchers


def compile_plan(plan, *companions) -> None:
    """Every kernel of a plan (`forward.ForwardPlan`, `backward.BackwardPlan`) compiled at once
    on its first use, in parallel, instead of one after another as the launches reach them, with
    those of `companions` (plans the call will use next, e.g. the backward after a training
    forward); after that a set lookup per call."""
    todo = [p for p in (plan, *companions) if p not in _ready_plans]
    if todo:
        specs = [s for p in todo for s in p.specs()]
        precompile(specs, num_workers=max(1, min(len(specs), os.cpu_count() or 1)))
        _ready_plans.update(todo)


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


def as_dtype(x: torch.Tensor, dtype) -> torch.Tensor:
    """x in `dtype`, without a torch call when it already is (host time on every launch path)."""
    return x if x.dtype == dtype else x.to(dtype)
