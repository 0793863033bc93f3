"""tools/kernel_sass.py: a kernel built as the device builds it (sm_90a cubin, no GPU), with its
registers, spills and SASS instruction count. Skipped without tilelang or nvcc."""

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("tilelang")
TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import kernel_sass  # noqa: E402

if kernel_sass.tool_path("nvcc") is None:
    pytest.skip("no nvcc", allow_module_level=True)


def test_pass_configuration_shows_in_the_counts(tmp_path):
    """TileLang's bounds checks are instructions of their own: leaving them out of a kernel that
    has them (the v-head sum is compiled with them) gives fewer."""
    import tilelang

    from flash_qla_cp.kernels.lowering import lowering_cases

    case = next(c for c in lowering_cases() if c.name == "v_head_sum[k256_1walks]")
    plain = kernel_sass.measure(case, {}, str(tmp_path))
    unchecked = kernel_sass.measure(case, {tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}, str(tmp_path))
    assert plain["registers"] > 0 and plain["spill_stores"] == 0 and plain["sass_instructions"] > 50
    assert unchecked["sass_instructions"] < plain["sass_instructions"]


def test_unknown_case_and_config_are_refused():
    for args in (["no_such_case"], ["v_head_sum[k256_1walks]", "--config", "NOT_A_KEY=1"]):
        run = subprocess.run([sys.executable, str(TOOLS / "kernel_sass.py"), *args], capture_output=True, text=True)
        assert run.returncode != 0 and ("unknown cases" in run.stderr or "NOT_A_KEY" in run.stderr), run.stderr[-500:]
