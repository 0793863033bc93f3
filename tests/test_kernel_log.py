"""The kernel log a GPU run writes (FLASH_QLA_CP_KERNEL_LOG) reads back as precompile specs."""

import importlib.util
import os

from flash_qla_cp.kernels import tilelang_common
from flash_qla_cp.kernels.tilelang_bwd_fused_ws import build_bwd_fused_ws_kernel
from flash_qla_cp.kernels.tilelang_fwd import build_prepare_kernel


def _precompile_cache_module():
    path = os.path.join(os.path.dirname(__file__), "gpu", "precompile_cache.py")
    spec = importlib.util.spec_from_file_location("precompile_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_logged_kernels_read_back_as_specs(tmp_path, monkeypatch):
    log = tmp_path / "kernels.jsonl"
    monkeypatch.setenv(tilelang_common.KERNEL_LOG_ENV, str(log))
    logged = [
        (build_prepare_kernel, dict(H=2, HV=4, K=128, dtype="bfloat16", is_varlen=True)),
        (build_bwd_fused_ws_kernel, dict(H=16, HV=32, K=128, V=128, dtype="bfloat16", scale=128**-0.5,
                                         use_dht=True, store_dh0=False)),
    ]
    for factory, params in logged:
        tilelang_common._log_kernel(factory, params)
    assert _precompile_cache_module().load_specs(str(log), 132) == logged


def test_no_log_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(tilelang_common.KERNEL_LOG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    tilelang_common._log_kernel(build_prepare_kernel, dict(H=2, HV=4, K=64, dtype="bfloat16", is_varlen=False))
    assert list(tmp_path.iterdir()) == []
