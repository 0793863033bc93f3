"""Input checks for the public op: every bad input gets a clear error, never a wrong answer."""

from __future__ import annotations

import math

import torch

from .options import DEFAULT_OPTIONS, KernelOptions

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(message: str):
    raise ValueError(f"chunk_gated_delta_rule: {message}")


def check_inputs(q, k, v, g, beta, initial_state=None, cu_seqlens=None, state_v_first=False,
                 cu_seqlens_cpu=None) -> int:
    """Validate shapes, dtypes, devices and cu_seqlens; return the number of sequences N.

    With `cu_seqlens_cpu` (the caller's host copy, as FLA takes it) the offsets are checked on
    that copy, so a GPU cu_seqlens is not read back: no host sync, and the call can be captured
    in a CUDA graph. The copy must hold the same offsets: its length is compared, and its values
    too where cu_seqlens is itself on the CPU (no read-back needed)."""
    check_tensors(q, k, v, g, beta)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype not in FLOAT_DTYPES:
            _fail(f"{name} must be a floating tensor, got {t.dtype}")
        if t.device != q.device:
            _fail(f"all inputs must be on one device: q is on {q.device}, {name} on {t.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        _fail(f"q, k, v must be 4-D [B, T, H, K] / [B, T, HV, V]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape != k.shape:
        _fail(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    HV = v.shape[2]
    for dim, size in (("B", B), ("H", H), ("K", K), ("HV", v.shape[2]), ("V", v.shape[3])):
        if size == 0:
            _fail(f"{dim} = 0 in q {tuple(q.shape)} / v {tuple(v.shape)}: every dimension but T must be positive")
    if v.shape[:2] != (B, T):
        _fail(f"v must be [B={B}, T={T}, HV, V], got {tuple(v.shape)}")
    if HV % H != 0:
        _fail(f"the number of v heads ({HV}) must be a multiple of the q/k heads ({H})")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, HV):
            _fail(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(t.shape)}")

    num_seqs = B
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type == "cpu" and q.device.type != "cpu":
        # the kernels would read a host address
        _fail(f"cu_seqlens is a CPU tensor but the inputs are on {q.device}: pass it on {q.device} "
              "(its CPU copy may go in cu_seqlens_cpu as well)")
    if cu_seqlens is not None:
        host = cu_seqlens
        if cu_seqlens_cpu is not None:  # check the copy's values
            if not (isinstance(cu_seqlens_cpu, torch.Tensor) and cu_seqlens_cpu.device.type == "cpu"
                    and cu_seqlens_cpu.shape == cu_seqlens.shape):
                _fail(f"cu_seqlens_cpu must be a CPU tensor of cu_seqlens' shape {tuple(cu_seqlens.shape)}")
            if cu_seqlens.dtype not in (torch.int32, torch.int64):
                _fail("cu_seqlens must be an int32/int64 tensor [N+1]")
            if cu_seqlens.device.type == "cpu" and not torch.equal(cu_seqlens.long(), cu_seqlens_cpu.long()):
                _fail(f"cu_seqlens_cpu {cu_seqlens_cpu.tolist()} differs from cu_seqlens {cu_seqlens.tolist()}")
            host = cu_seqlens_cpu
        num_seqs = check_cu_seqlens(host, B, T)
    if initial_state is not None:
        V = v.shape[3]
        expected = (num_seqs, HV, V, K) if state_v_first else (num_seqs, HV, K, V)
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != expected:
            got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
            _fail(f"initial_state must be {layout} = {expected}, got {got}")
        if initial_state.dtype not in (torch.float32, torch.float64):
            _fail(f"initial_state must be float32 (or float64), got {initial_state.dtype}")
        if initial_state.device != q.device:
            _fail(f"initial_state is on {initial_state.device}, inputs on {q.device}")
    return num_seqs


def check_tensors(q, k, v, g, beta):
    """The five inputs are tensors (checked before anything reads their attributes)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_scale(scale):
    """scale: None (K ** -0.5) or a finite Python number. A tensor would get no gradient: rejected;
    NaN or inf would make every output NaN."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        _fail(f"scale must be a Python float (or None for K ** -0.5), got {type(scale).__name__}")
    if scale is not None and not math.isfinite(scale):
        _fail(f"scale must be finite, got {scale}")


def is_intra_option(value) -> bool:
    """An intra-card CP setting: 'auto', 'off' or a positive int (partitions per sequence; not a bool)."""
    return value in ("auto", "off") or (type(value) is int and value >= 1)


def check_intra_cp(value):
    if not is_intra_option(value):
        _fail(f"intra_cp must be 'auto', 'off' or a positive int, got {value!r}")


def check_options(options):
    """The call's KernelOptions (the defaults for None)."""
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, KernelOptions):
        _fail(f"kernel_options must be a flash_qla_cp.KernelOptions, got {type(options).__name__}")
    return options


def check_cu_seqlens(cu_seqlens, batch: int, seq_len: int) -> int:
    """cu_seqlens must be a 1-D integer tensor [N+1] from 0 to T, non-decreasing, with B == 1."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        _fail("cu_seqlens must be an int32/int64 tensor [N+1]")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _fail(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        _fail(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={batch}")
    edges = cu_seqlens.tolist()
    check_cu_seqlens_values(edges, seq_len)
    return len(edges) - 1


def check_cu_seqlens_values(edges: list, seq_len: int) -> None:
    """cu_seqlens' values (a host list) must run from 0 to T without falling."""
    if edges[0] != 0 or edges[-1] != seq_len:
        _fail(f"cu_seqlens must start at 0 and end at T={seq_len}, got {edges[0]} .. {edges[-1]}")
    if any(b < a for a, b in zip(edges, edges[1:])):
        _fail(f"cu_seqlens must be non-decreasing, got {edges}")
