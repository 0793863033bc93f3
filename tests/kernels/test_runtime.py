"""Compiling and launching: one launcher per spec, the direct launch path, the kernel log that
a GPU run writes and tools/precompile_cache.py reads back."""

import importlib.util
import pathlib
from unittest import mock

import pytest

from flash_qla_cp.kernels import runtime
from flash_qla_cp.kernels.hopper.bwd_fused import build_bwd_fused_ws_kernel
from flash_qla_cp.kernels.hopper.prepare import build_prepare_kernel
from flash_qla_cp.kernels.runtime import KernelSpec

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


def _precompile_cache_module():
    spec = importlib.util.spec_from_file_location("precompile_cache", TOOLS / "precompile_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_specs_are_equal_and_hashable_by_value():
    a = KernelSpec.of(build_prepare_kernel, H=2, HV=4, K=128, dtype="bfloat16", is_varlen=True)
    b = KernelSpec.of(build_prepare_kernel, is_varlen=True, dtype="bfloat16", K=128, HV=4, H=2)
    assert a == b and hash(a) == hash(b) and a.kwargs["K"] == 128
    assert a.replace(K=64) != a and a.replace(K=64).kwargs["K"] == 64


def test_logged_kernels_read_back_as_specs(tmp_path, monkeypatch):
    log = tmp_path / "kernels.jsonl"
    monkeypatch.setenv(runtime.KERNEL_LOG_ENV, str(log))
    logged = [
        KernelSpec.of(build_prepare_kernel, H=2, HV=4, K=128, dtype="bfloat16", is_varlen=True),
        KernelSpec.of(build_bwd_fused_ws_kernel, H=16, HV=32, K=128, V=128, dtype="bfloat16", scale=128**-0.5,
                      use_dht=True, store_dh0=False),
    ]
    for spec in logged:
        runtime._log_kernel(spec)
    assert _precompile_cache_module().load_log(str(log)) == logged


def test_no_log_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(runtime.KERNEL_LOG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    runtime._log_kernel(KernelSpec.of(build_prepare_kernel, H=2, HV=4, K=64, dtype="bfloat16", is_varlen=False))
    assert list(tmp_path.iterdir()) == []


def test_launcher_calls_the_compiled_module_entry_once_looked_up():
    """compile_kernel hands out one launcher per spec that passes the arguments straight to the
    module's entry function (looked up on the first launch only)."""
    pytest.importorskip("tilelang")
    entry_calls, lookups, compiled_specs = [], [], []

    class Module:
        def main(self, *args):
            entry_calls.append(args)

    class Executable:  # what TileLang gives for a kernel compiled in this process
        def jit(self):
            return Module()

    class Adapter:
        def __init__(self, executable):
            self.executable = executable

        def _get_executable(self):
            lookups.append(1)
            return self.executable

    class Kernel:
        def __init__(self, executable):
            self.adapter = Adapter(executable)

    def factory(n):
        compiled_specs.append(n)
        return ("prim_func", n)

    def compile_(prim_func, **kw):
        return Kernel(Module())  # as loaded from TileLang's disk cache

    with mock.patch("tilelang.compile", compile_), mock.patch.dict(runtime._launchers, clear=True):
        launch = runtime.compile_kernel(KernelSpec.of(factory, n=3))
        assert runtime.compile_kernel(KernelSpec.of(factory, n=3)) is launch
        assert lookups == [] and compiled_specs == [3]  # built once, nothing loaded before the first launch
        launch("a", 1)
        launch("b", 2)
        assert runtime.compile_kernel(KernelSpec.of(factory, n=4)) is not launch
        assert entry_calls == [("a", 1), ("b", 2)] and lookups == [1]
    fresh = runtime.DirectLaunch(Kernel(Executable()))  # as compiled in this process
    fresh("c")
    assert entry_calls[-1] == ("c",)
