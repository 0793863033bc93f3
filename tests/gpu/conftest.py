"""GPU tests: collected everywhere, run only where a Hopper GPU and TileLang are present
(`pytest -m gpu tests/gpu`); each test starts with NaN-poisoned memory."""

import functools

import pytest
import torch


@functools.lru_cache(maxsize=None)
def _hopper_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs a Hopper GPU (sm_90), this is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"tilelang does not import: {exc!r}"
    return None


def pytest_collection_modifyitems(config, items):
    here = str(config.rootpath / "tests" / "gpu")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
            reason = _hopper_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def poisoned_memory(monkeypatch):
    """Every buffer the TileLang backward allocates starts as NaN, and so does the free memory
    the forward's outputs are carved from: an element no kernel writes shows up as a failure."""
    from flash_qla_cp.kernels import backward
    from gdn_checks import poison_free_memory

    def nan_filled(*shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(backward, "empty", nan_filled)
    poison_free_memory("cuda")
    yield
    torch.cuda.empty_cache()
