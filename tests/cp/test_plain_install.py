"""CP in a plain install: a fresh venv with torch and the package only (no extras, no numpy),
running a 2-rank CP forward and backward over gloo."""

import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys, tempfile
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, init_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    from flash_qla_cp import CPContext, chunk_gated_delta_rule
    from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens
    cp = CPContext.build(random_cu_seqlens([40, 88]))
    x = make_gdn_inputs(seq_len=128, num_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8)
    local = {n: cp.local_slice(t).clone().requires_grad_(True) for n, t in x.items()}
    o, final = chunk_gated_delta_rule(**local, output_final_state=True, cp_context=cp)
    (o.sum() + final.sum()).backward()
    assert all(t.grad is not None for t in local.values())
    dist.destroy_process_group()

if __name__ == "__main__":
    try:
        import numpy  # noqa: F401
        sys.exit("numpy is installed: not a plain install")
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "pg"),), nprocs=2)
    print("cp ok")
"""


@pytest.mark.slow
def test_cp_runs_in_a_fresh_venv_with_torch_and_the_package_only(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    torch_version = torch.__version__.split("+")[0]  # the machine's own torch (a local wheel here)

    def pip(*args):
        out = subprocess.run([py, "-m", "pip", "install", "-q", *args], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]

    pip(f"torch=={torch_version}")
    pip("--no-build-isolation", str(ROOT))  # the package with its own requirements, no extras
    script = tmp_path / "cp_plain.py"
    script.write_text(SCRIPT)
    out = subprocess.run([py, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and "cp ok" in out.stdout, (out.stdout[-2000:], out.stderr[-3000:])
