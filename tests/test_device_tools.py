"""The device workflow's scripts (tests/gpu/) stay runnable: the session script parses, and the
precompile spec files name kernels that build (the PrimFunc only: no GPU, no nvcc)."""

import importlib.util
import os
import shutil
import subprocess

import pytest

GPU_DIR = os.path.join(os.path.dirname(__file__), "gpu")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_session_script_parses():
    subprocess.run(["bash", "-n", os.path.join(GPU_DIR, "device_session.sh")], check=True)


def load_specs(filename):
    """specs(132) of a precompile spec file in tests/gpu (H200: 132 SMs)."""
    pytest.importorskip("tilelang")
    spec = importlib.util.spec_from_file_location(filename[:-3], os.path.join(GPU_DIR, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.specs(132)


def test_check_bwd_precompile_specs_build():
    specs = load_specs("precompile_specs_check_bwd.py")
    factories = {factory.__name__ for factory, _ in specs}
    assert {"build_bwd_grad_group_kernel", "build_prepare_kernel"} <= factories
    for factory, params in specs[:4]:
        func = factory(**params)  # parses the kernel into a PrimFunc: a broken spec raises here
        assert len(func.params) >= 5, factory.__name__


def test_fused_ws_precompile_specs_build():
    specs = load_specs("precompile_specs_fused_ws.py")
    assert {factory.__name__ for factory, _ in specs} == {"build_bwd_fused_ws_kernel"}
    factory, params = specs[0]
    assert len(factory(**params).params) == 18  # the fused walk's argument list (with its walk order)
