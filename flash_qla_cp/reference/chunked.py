"""Chunked gated delta rule in plain torch (chunk C = 64, WY/UT representation).

This is the CPU path of the library and the reference for the TileLang kernels. It is
differentiable through autograd, handles varlen (cu_seqlens), GVA, initial/final states
and any float dtype: half inputs are computed in fp32, float64 stays float64.

Per chunk of length C, with G = cumsum(g) inside the chunk (in float64, gates floored at
GATE_FLOOR) and S the incoming state:
    A_ij   = beta_i (k_i . k_j) exp(G_i - G_j)          for i > j   (strictly lower)
    Tm     = (I + A)^-1
    w      = Tm (beta exp(G) k),     u = Tm (beta v)
    v_new  = u - w S                                    (the delta-rule corrected values)
    o      = scale [ (q exp(G)) S + tril(q k^T exp(G_i - G_j)) v_new ]
    S_next = exp(G_C) S + (k exp(G_C - G))^T v_new
so a chunk maps S_next = M_c S + h_c with M_c = exp(G_C) I - (k exp(G_C - G))^T w.
"""

from __future__ import annotations

import torch

from ..constants import CHUNK
from .shapes import ChunkLayout, expand_qk_heads, l2norm, sequence_bounds


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else fp32 (half inputs are accumulated in fp32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# Gates below this count as this: exp(-700) ~ 1e-304 is zero at either precision, so a gate of -inf
# (a hard reset) or -1e30 clears the state as the recurrence does, and a chunk's cumulative gate
# stays within 64 x 700, where float64 still resolves the small gates that follow it (to ~1e-11;
# a cumulative sum through -1e9 would absorb them).
GATE_FLOOR = -700.0


def chunk_cumsum(g: torch.Tensor) -> torch.Tensor:
    """G, the chunk-local inclusive cumulative gate [..., C], in float64, gates floored at GATE_FLOOR."""
    return g.to(torch.float64).clamp(min=GATE_FLOOR).cumsum(-1)


def decay(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp(x) of float64 gate sums, in the compute dtype."""
    return torch.exp(x).to(dtype)


def _decay_diff(G: torch.Tensor, include_diagonal: bool, dtype: torch.dtype) -> torch.Tensor:
    """exp(G_i - G_j) on the causal triangle, exactly 0 above it (no inf * 0), in `dtype`."""
    C = G.shape[-1]
    mask = torch.ones(C, C, dtype=torch.bool, device=G.device).tril(0 if include_diagonal else -1)
    diff = G[..., :, None] - G[..., None, :]
    return decay(diff.masked_fill(~mask, float("-inf")), dtype)


def chunk_scan(q, k, v, g, beta, scale, initial_state, layout: ChunkLayout, with_transition=False):
    """Core scan on the chunks of a `ChunkLayout`.

    q, k: [NC, HV, C, K]; v: [NC, HV, C, V]; g, beta: [NC, HV, C]; initial_state [N, HV, K, V]
    (compute dtype, sequences in their own order). Returns (o [NC, HV, C, V], final states
    [N, HV, K, V], transitions M [N, HV, K, K] or None) where final = M initial + (final from a
    zero start). The walk carries only the sequences still walking: work in proportion to NC.
    """
    dt = q.dtype
    G = chunk_cumsum(g)
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * _decay_diff(G, False, dt)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    lhs = eye + A
    w = torch.linalg.solve_triangular(lhs, kb * decay(G, dt)[..., None], upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(lhs, v * beta[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * _decay_diff(G, True, dt)
    q_dec = q * decay(G, dt)[..., None]
    k_dec = k * decay(G[..., -1:] - G, dt)[..., None]
    chunk_decay = decay(G[..., -1], dt)[..., None, None]  # [NC, HV, 1, 1]

    order = torch.tensor(layout.order, dtype=torch.long, device=initial_state.device)
    S = initial_state.index_select(0, order)  # the sequences longest first
    K = k.shape[-1]
    M = torch.eye(K, dtype=S.dtype, device=S.device).expand(*S.shape[:2], K, K) if with_transition else None
    finals, transitions, outputs = [], [], []
    for c, walking in enumerate(layout.active):
        if walking < S.shape[0]:  # the shortest sequences are done: their states are final
            finals.append(S[walking:])
            S = S[:walking]
            if with_transition:
                transitions.append(M[walking:])
                M = M[:walking]
        r = layout.rows(c)
        v_new = u[r] - w[r] @ S
        outputs.append(scale * (q_dec[r] @ S + attn[r] @ v_new))
        S = chunk_decay[r] * S + k_dec[r].transpose(-1, -2) @ v_new
        if with_transition:
            M = chunk_decay[r] * M - k_dec[r].transpose(-1, -2) @ (w[r] @ M)
    unsort = torch.argsort(order)
    final = torch.cat([S, *reversed(finals)]).index_select(0, unsort)
    if with_transition:
        M = torch.cat([M, *reversed(transitions)]).index_select(0, unsort)
    o = torch.cat(outputs) if outputs else v.new_zeros(v.shape)
    return o, final, M


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
    return_transition: bool = False,
):
    """Chunked GDN forward in torch, differentiable. Shapes as in the public API.

    Returns (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] or None).
    With return_transition=True also returns M [N, HV, K, K] so that, for every sequence,
    final_state = M @ initial_state + final_state(initial_state = 0).
    States are fp32 (float64 for float64 inputs); state_v_first means [N, HV, V, K].
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K**-0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    dtype = compute_dtype(q, k, v)
    bounds = sequence_bounds(B, T, cu_seqlens)
    layout = ChunkLayout.build(bounds, T, B * T, chunk_size, q.device)
    qc, kc = layout.gather(expand_qk_heads(q, HV), dtype), layout.gather(expand_qk_heads(k, HV), dtype)
    vc, gc, bc = (layout.gather(x, dtype) for x in (v, g, beta))

    if initial_state is None:
        S0 = torch.zeros(len(bounds), HV, K, V, dtype=dtype, device=q.device)
    else:
        S0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
        S0 = S0.to(dtype)
    o_chunks, S, M = chunk_scan(qc, kc, vc, gc, bc, scale, S0, layout, with_transition=return_transition)

    o = layout.scatter(o_chunks).reshape(B, T, HV, V).to(v.dtype)

    final_state = None
    if output_final_state:
        final_state = S.transpose(-1, -2) if state_v_first else S
        final_state = final_state.contiguous()
    if return_transition:
        return o, final_state, M
    return o, final_state
