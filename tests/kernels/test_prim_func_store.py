"""Built PrimFuncs kept on disk (`kernels/prim_func_store.py`): a later process reads them back
instead of running the builders, and must get the PrimFunc the builder gives (the same script,
hence the same TileLang cache entry)."""

import pytest

pytest.importorskip("tilelang")

from flash_qla_cp.kernels import prim_func_store  # noqa: E402
from flash_qla_cp.kernels.hopper.prepare import build_prepare_kernel  # noqa: E402
from flash_qla_cp.kernels.runtime import KernelSpec  # noqa: E402

SPEC = KernelSpec.of(build_prepare_kernel, H=2, HV=4, K=64, dtype="bfloat16", is_varlen=True, blocks_per_sm=5)


@pytest.fixture
def builds(tmp_path, monkeypatch):
    """A fresh store (TileLang's cache directory in tmp_path, also where TileLang was imported
    before, having read the variable then); counts the builders' runs."""
    import tilelang

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tilelang.env, "TILELANG_CACHE_DIR", str(tmp_path))
    count = []
    real = KernelSpec.build
    monkeypatch.setattr(KernelSpec, "build", lambda self: count.append(self) or real(self))
    return count


def test_a_saved_prim_func_reads_back_as_the_built_one(builds):
    first = prim_func_store.prim_func(SPEC)
    again = prim_func_store.prim_func(SPEC)
    assert len(builds) == 1  # the second came from the store
    assert again.script() == first.script() == SPEC.build().script()


def test_changed_builders_or_params_do_not_read_an_old_entry(builds, monkeypatch):
    prim_func_store.prim_func(SPEC)
    other = SPEC.replace(K=128)
    assert prim_func_store.prim_func(other).script() == other.build().script()
    monkeypatch.setattr(prim_func_store, "builders_hash", lambda: "an edited builder")
    prim_func_store.prim_func(SPEC)
    assert [s for s in builds if s == SPEC] == [SPEC, SPEC]


def test_a_damaged_entry_is_built_again_and_replaced(builds):
    prim_func_store.prim_func(SPEC)
    with open(prim_func_store.entry_path(SPEC), "w") as f:
        f.write('{"root": 1, "nodes": [')  # cut short
    assert prim_func_store.prim_func(SPEC).script() == SPEC.build().script()
    prim_func_store.prim_func(SPEC)
    assert len(builds) == 3  # first, after the damage, and the check above; the last read it back
