"""Backends behind the public op and how one is chosen.

`torch`: the chunked torch reference (any device, any float dtype; its backward is the hand-written
chunked backward of `kernels/reference_backward.py`).
`tilelang`: the fused Hopper kernels (CUDA, sm_90, bf16/fp16). The GPU is only asked
about when an op is called, never at import time.
"""

from __future__ import annotations

import functools
import importlib

import torch

BACKENDS = ("auto", "torch", "tilelang")
TILELANG_HEAD_DIMS = (64, 128, 256)


@functools.lru_cache(maxsize=None)
def tilelang_importable() -> bool:
    try:
        importlib.import_module("tilelang")
    except Exception:  # a broken install must not break the torch path
        return False
    return True


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple:
    """(major, minor) of a CUDA device, asked once per device: torch's query costs ~10-20 us of
    host time per call, paid on every op call before."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def tilelang_unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the TileLang kernels cannot run these inputs, or None if they can."""
    if not q.is_cuda:
        return f"inputs are on {q.device}; the TileLang kernels need a CUDA tensor"
    major, minor = device_capability(q.device)
    if (major, minor) != (9, 0):
        return f"the TileLang kernels are built for Hopper (sm_90); this GPU is sm_{major}{minor}"
    if q.dtype not in (torch.bfloat16, torch.float16) or v.dtype != q.dtype:
        return f"the TileLang kernels take bf16 or fp16 q/k/v of one dtype, got {q.dtype} and {v.dtype}"
    K, V = q.shape[-1], v.shape[-1]
    if K not in TILELANG_HEAD_DIMS or V not in TILELANG_HEAD_DIMS:
        return f"the TileLang kernels support head dims {TILELANG_HEAD_DIMS}, got K={K}, V={V}"
    if not tilelang_importable():
        return "tilelang is not installed (pip install 'flash-qla-cp[gpu]')"
    return None


def choose_backend(requested: str, q: torch.Tensor, v: torch.Tensor) -> str:
    """Resolve 'auto'; raise a clear error when an explicit backend cannot take the inputs."""
    if requested not in BACKENDS:
        raise ValueError(f"chunk_gated_delta_rule: backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch"
    reason = tilelang_unsupported_reason(q, v)
    if requested == "tilelang" and reason is not None:
        raise NotImplementedError(f"chunk_gated_delta_rule: backend 'tilelang' cannot run this call: {reason}")
    return "tilelang" if reason is None else "torch"
