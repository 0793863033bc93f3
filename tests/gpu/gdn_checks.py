"""What the GPU tests share: cases, inputs, the float64 reference, the error limits and memory
poisoning. The functions take a device and a backend, so the CPU suite runs them too (on the
torch backend, tests/reference/test_gpu_checks.py) and a broken check fails before a GPU sees it.

Every reference runs in float64 on the inputs as the bf16 / fp16 run sees them (q, k, v rounded
to that dtype, g and beta to fp32). Limits, relative L2: o and states 5e-3, gradients 1e-2;
a non-finite result never passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flash_qla_cp import chunk_gated_delta_rule
from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens, rel_err

NAMES = ("q", "k", "v", "g", "beta")
LIMITS = {"o": 5e-3, "final": 5e-3}
GRAD_LIMIT = 1e-2


@dataclass(frozen=True)
class Case:
    """One call of the op: sequences `lengths` (packed with cu_seqlens, or as a [B, T] batch when
    dense), heads, dtype, which states it takes and gives, and its intra-card split."""

    lengths: tuple
    dense: bool = False
    H: int = 2
    HV: int = 4
    K: int = 128
    V: int = 128
    dtype: torch.dtype = torch.bfloat16
    with_h0: bool = True
    with_dht: bool = True
    state_v_first: bool = False
    intra_cp: object = "off"
    slow_heads: bool = False  # three slowly decaying heads: warm-ups of many chunks in a split
    resets: bool = False  # g = -inf (a reset), -1e30, -1e4 and -100 at scattered tokens of two heads
    seed: int = 0
    gates: dict = field(default_factory=dict, hash=False)  # extra make_gdn_inputs arguments


@dataclass
class Inputs:
    x: dict  # q, k, v, g, beta in float64, [B, T, ...] ([1, T, ...] packed)
    h0: torch.Tensor
    do: torch.Tensor
    dfinal: torch.Tensor
    cu: torch.Tensor | None


def make_inputs(case: Case) -> Inputs:
    """Fresh random inputs (q, k l2-normalised, g = -exp(A) softplus(x) with strong-decay and g = 0
    heads), an initial state, an output gradient and a final-state gradient, in float64 on the CPU."""
    gen = torch.Generator().manual_seed(case.seed)
    T = sum(case.lengths)
    x = make_gdn_inputs(seq_len=T, num_heads=case.H, num_v_heads=case.HV, head_k_dim=case.K, head_v_dim=case.V,
                        dtype=torch.float64, generator=gen, **case.gates)
    if case.slow_heads:  # about -0.2, -0.6, -2 per chunk
        n = max(0, min(3, case.HV - 1))
        x["g"][..., 1:1 + n] *= torch.tensor([0.003, 0.01, 0.03], dtype=torch.float64)[:n]
    if case.resets:
        idx = torch.randperm(T, generator=gen)[: max(8, T // 50)]
        extremes = torch.tensor([float("-inf"), -1e30, -1e4, -100.0], dtype=torch.float64)
        x["g"][:, idx, 0] = extremes.repeat(len(idx) // 4 + 1)[: len(idx)]
        x["g"][:, idx.flip(0), min(2, case.HV - 1)] = float("-inf")
    N = len(case.lengths)
    h0 = torch.randn(N, case.HV, case.K, case.V, generator=gen, dtype=torch.float64) * 0.1
    do = torch.randn(1, T, case.HV, case.V, generator=gen, dtype=torch.float64)
    dfinal = torch.randn(N, case.HV, case.K, case.V, generator=gen, dtype=torch.float64) * 0.1
    cu = None
    if case.dense:  # equal lengths as a [B, T] batch
        L = case.lengths[0]
        assert all(n == L for n in case.lengths)
        x = {k: t.reshape(N, L, *t.shape[2:]) for k, t in x.items()}
        do = do.reshape(N, L, *do.shape[2:])
    else:
        cu = random_cu_seqlens(case.lengths)
    return Inputs(x, h0, do, dfinal, cu)


def run_op(case: Case, inputs: Inputs, device, backend, reference=False, intra_cp=None, backward_twice=False,
           op=chunk_gated_delta_rule, **op_options) -> dict:
    """o, the final state and every gradient of one forward + backward through the public op (or
    `op`, e.g. it compiled), as float32 CPU tensors. reference: in float64 (on the inputs rounded
    as the case's dtype sees them) and without a split. backward_twice: the gradients of a second
    backward over the same forward (the first with retain_graph)."""
    cast = {n: (t.to(case.dtype) if n in "qkv" else t.float()) for n, t in inputs.x.items()}
    if reference:
        cast = {n: t.double() for n, t in cast.items()}
    xs = {n: t.to(device, copy=True).requires_grad_(True) for n, t in cast.items()}
    h = dfinal = None
    if case.with_h0:
        h = inputs.h0.to(device, torch.float64 if reference else torch.float32, copy=True)
        h = (h.transpose(-1, -2).contiguous() if case.state_v_first else h).requires_grad_(True)
    if case.with_dht:
        dfinal = inputs.dfinal.to(device)
        dfinal = dfinal.transpose(-1, -2) if case.state_v_first else dfinal
    o, final = op(
        **xs, initial_state=h, output_final_state=True, cu_seqlens=None if inputs.cu is None else inputs.cu.to(device),
        backend=backend, state_v_first=case.state_v_first,
        intra_cp="off" if reference else (case.intra_cp if intra_cp is None else intra_cp), **op_options)
    loss = (o.double() * inputs.do.to(device)).sum()
    if dfinal is not None:
        loss = loss + (final.double() * dfinal).sum()
    if backward_twice:
        loss.backward(retain_graph=True)
        for t in (*xs.values(), h):
            if t is not None:
                t.grad = None
    loss.backward()
    out = {"o": o.detach(), "final": final.detach(), **{"d" + n: xs[n].grad for n in NAMES}}
    if h is not None:
        out["dh0"] = h.grad
    return {k: v.float().cpu() for k, v in out.items()}


def errors(got: dict, want: dict) -> dict:
    """{output: relative L2 error} (inf where a result is not finite)."""
    return {k: rel_err(got[k], want[k]) for k in want}


def over_limits(errs: dict) -> dict:
    """The outputs past their limit (o and states 5e-3, gradients 1e-2; NaN / inf fail)."""
    return {k: e for k, e in errs.items() if not e <= LIMITS.get(k, GRAD_LIMIT)}


def check_case(case: Case, device, backend, **op_options) -> dict:
    """Run `case` twice on `backend` and once in float64; returns the errors. Raises when an
    output is past its limit or the two runs differ in any bit."""
    inputs = make_inputs(case)
    want = run_op(case, inputs, device, "torch", reference=True)
    got = [run_op(case, inputs, device, backend, **op_options) for _ in range(2)]
    errs = errors(got[0], want)
    bad = over_limits(errs)
    assert not bad, f"past the limits: {bad} (all: {errs})"
    differ = [k for k in got[0] if not torch.equal(got[0][k], got[1][k])]
    assert not differ, f"not deterministic: {differ}"
    return errs


def poison_free_memory(device, nbytes=1 << 30):
    """Fill `nbytes` of the caching allocator's free memory with NaN, so that a buffer a kernel
    forgets to write reads NaN (and fails the limits) instead of an old, plausible value."""
    if torch.device(device).type == "cuda":
        x = torch.full((nbytes // 4,), float("nan"), device=device)
        del x
