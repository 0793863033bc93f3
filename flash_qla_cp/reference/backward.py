"""The chunked backward written out by hand, one reverse walk per sequence (torch).

The TileLang backward splits this work over kernels (h walk, dh walk, grad kernel, or the fused
walk; docs/kernels.md). Here the same per-chunk formulas run in one reverse walk over the
whole state, with dq and dk formed per v-head and summed over each qk-head's v-heads at the
end: the structure of the fused walk, executable on the CPU and tested against autograd
through `chunk_gated_delta_rule_torch` (tests/reference/test_backward.py).

Per chunk (notation of `chunked.py`; E = diag(exp G), Gam_ij = exp(G_i - G_j) on
the causal triangle, GL = G at the chunk's last row, S the state entering the chunk and dS'
the gradient of the state leaving it; padding rows have q = k = v = beta = 0, g = 0):
    Tm = (I + A)^-1,  Ag = Tm diag(beta),  vres = v - E k S,  v_new = Ag vres
    P    = scale tril_incl(q k^T o Gam)
    dvn  = P^T dO + diag(exp(GL - G)) k dS'           (gradient of v_new)
    t    = Ag^T dvn                                     (= dv, the gradient of vres)
    dS   = exp(GL) dS' + (scale E q)^T dO - (E k)^T t
    dAg  = tril_incl(dvn vres^T),  dA = -strict_lower(Tm^T dAg diag(beta) Tm^T)
    Pm   = scale tril_incl(dO v_new^T o Gam)
    dq   = scale E dO S^T + Pm k
    dk   = -E t S^T + diag(exp(GL - G)) v_new dS'^T + Pm^T q + X k + X^T k,
           X = diag(beta) dA o Gam (strictly lower)
    dbeta = rowsum(dA o k k^T o Gam) + colsum(dAg o Tm)
    dG   = rowsum(Y) - colsum(Y) for Y = Pm o q k^T and Y = X o k k^T, + rowsum of the
           E-terms (scale E dO S^T o q, -E t S^T o k), - rowsum(diag(exp(GL - G)) v_new dS'^T o k),
           and at the last row exp(GL) <S, dS'> + sum of that last rowsum;
    dg   = reverse cumsum of dG inside the chunk.
"""

from __future__ import annotations

import torch

from ..constants import CHUNK
from .chunked import GATE_FLOOR, _decay_diff, chunk_cumsum, compute_dtype, decay
from .shapes import ChunkLayout, expand_qk_heads, sequence_bounds


def ut_inverse(k, G, beta):
    """Tm = (I + A)^-1 of chunks [..., C, K] (A = strict_lower(diag(beta) k k^T o Gam))."""
    C = k.shape[-2]
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    kk = k @ k.transpose(-1, -2)
    return torch.linalg.solve_triangular(eye + beta[..., :, None] * kk * _decay_diff(G, False, k.dtype),
                                         eye.expand_as(kk), upper=False, unitriangular=True)


def chunk_gradients(q, k, do, vres, dvn, t, G, beta, Tm, S, dS, scale):
    """(dq, dk, dbeta, dg) of chunks [..., C, ...] (the formulas of the module docstring), given
    each chunk's vres, dvn, t = Ag^T dvn, G (chunk-local cumulative gate), Tm (`ut_inverse`), the
    state S entering it and the gradient dS' of the state leaving it [..., K, V]. No recurrence:
    any batch of chunks at once (the reverse walk below takes one step's chunks at a time)."""
    C, dt = q.shape[-2], q.dtype
    GL = G[..., -1]
    gam_incl = _decay_diff(G, True, dt)
    gam_strict = _decay_diff(G, False, dt)
    kk = k @ k.transpose(-1, -2)
    eG = decay(G, dt)[..., None]
    tail = decay(GL[..., None] - G, dt)[..., None]  # exp(GL - G) per row
    v_new = (Tm * beta[..., None, :]) @ vres

    dAg = (dvn @ vres.transpose(-1, -2)) * torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    dA = -(Tm.transpose(-1, -2) @ (dAg * beta[..., None, :]) @ Tm.transpose(-1, -2)).tril(-1)
    X = beta[..., :, None] * dA * gam_strict
    Pm = scale * (do @ v_new.transpose(-1, -2)) * gam_incl
    qk = q @ k.transpose(-1, -2)

    q_term = scale * eG * (do @ S.transpose(-1, -2))  # scale E dO S^T
    w_term = -eG * (t @ S.transpose(-1, -2))  # -E t S^T
    s_term = tail * (v_new @ dS.transpose(-1, -2))  # exp(GL - G) v_new dS'^T
    dq = q_term + Pm @ k
    dk = w_term + s_term + Pm.transpose(-1, -2) @ q + X @ k + X.transpose(-1, -2) @ k
    dbeta = (dA * kk * gam_strict).sum(-1) + (dAg * Tm).sum(-2)

    YP, YA = Pm * qk, X * kk
    dG = (YP.sum(-1) - YP.sum(-2) + YA.sum(-1) - YA.sum(-2) + (q_term * q).sum(-1) + (w_term * k).sum(-1)
          - (s_term * k).sum(-1))
    dG[..., -1] += decay(GL, dt) * (S * dS).sum((-1, -2)) + (s_term * k).sum((-1, -2))
    return dq, dk, dbeta, dG.flip(-1).cumsum(-1).flip(-1)


def _chunk_backward(q, k, v, g, beta, scale, S0, do, dS_last, layout: ChunkLayout):
    """Gradients on the chunks of a `ChunkLayout` ([NC, HV, C, ...], see `chunk_scan`); S0 and
    dS_last [N, HV, K, V] in the sequences' own order. Both walks carry only the sequences still
    walking: work in proportion to NC."""
    dt = q.dtype
    G = chunk_cumsum(g)
    GL = decay(G[..., -1], dt)[..., None, None]  # each chunk's decay exp(G_L)
    Tm = ut_inverse(k, G, beta)
    Ag = Tm * beta[..., None, :]
    eG = decay(G, dt)[..., None]
    k_tail = decay(G[..., -1:] - G, dt)[..., None]  # exp(GL - G) per row
    P = scale * (q @ k.transpose(-1, -2)) * _decay_diff(G, True, dt)
    order = torch.tensor(layout.order, dtype=torch.long, device=S0.device)

    # forward walk: the state entering every chunk, and vres
    states = k.new_empty(*k.shape[:2], k.shape[-1], v.shape[-1])  # [NC, HV, K, V]
    vres = torch.empty_like(v)
    S = S0.index_select(0, order)
    for c, walking in enumerate(layout.active):
        S, r = S[:walking], layout.rows(c)
        vres[r] = v[r] - eG[r] * (k[r] @ S)
        states[r] = S
        S = GL[r] * S + (k_tail[r] * k[r]).transpose(-1, -2) @ (Ag[r] @ vres[r])

    # reverse walk: a sequence joins at its last chunk with its final-state gradient
    dq, dk, dv, dg, dbeta = (torch.empty_like(x) for x in (q, k, v, g, beta))
    dS_sorted = dS_last.index_select(0, order)
    dS = dS_sorted[:0]
    for c in reversed(range(len(layout.active))):
        walking, r = layout.active[c], layout.rows(c)
        dS = torch.cat([dS, dS_sorted[dS.shape[0]:walking]])
        dvn = P[r].transpose(-1, -2) @ do[r] + k_tail[r] * (k[r] @ dS)
        t = Ag[r].transpose(-1, -2) @ dvn
        dv[r] = t
        dq[r], dk[r], dbeta[r], dg[r] = chunk_gradients(q[r], k[r], do[r], vres[r], dvn, t, G[r], beta[r], Tm[r],
                                                        states[r], dS, scale)
        dS = GL[r] * dS + (scale * eG[r] * q[r]).transpose(-1, -2) @ do[r] - (eG[r] * k[r]).transpose(-1, -2) @ t
    dh0 = torch.cat([dS, dS_sorted[dS.shape[0]:]]).index_select(0, torch.argsort(order))
    dg = torch.where(g >= GATE_FLOOR, dg, 0.0)  # floored gates: their state factor is 0 whatever they are
    return dq, dk, dv, dg, dbeta, dh0


def chunk_gated_delta_rule_bwd_reference(q, k, v, g, beta, do, scale=None, initial_state=None, dht=None,
                                         cu_seqlens=None, chunk_size: int = CHUNK):
    """(dq, dk, dv, dg, dbeta, dh0) of `chunk_gated_delta_rule_torch`'s (o, final state) for the
    output gradient `do` [B, T, HV, V] and final-state gradient `dht` [N, HV, K, V] (or None),
    by the hand-written chunk formulas of the module docstring. Computed in float64 for
    float64 inputs, else fp32; gradients come back in the inputs' dtypes (dh0 fp32 / float64,
    None without an initial state)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    dtype = compute_dtype(q, k, v)
    bounds = sequence_bounds(B, T, cu_seqlens)
    layout = ChunkLayout.build(bounds, T, B * T, chunk_size, q.device)
    chunks = [layout.gather(x, dtype) for x in (expand_qk_heads(q, HV), expand_qk_heads(k, HV), v, g, beta, do)]
    N = len(bounds)
    S0 = torch.zeros(N, HV, K, V, dtype=dtype, device=q.device) if initial_state is None else initial_state.to(dtype)
    dS_last = torch.zeros_like(S0) if dht is None else dht.to(dtype)
    dq, dk, dv, dg, dbeta, dh0 = _chunk_backward(*chunks[:5], scale, S0, chunks[5], dS_last, layout)

    def tokens(x, like):
        return layout.scatter(x).reshape(B, T, *x.shape[1:2], *x.shape[3:]).to(like.dtype)

    grp = HV // H
    dq, dk = (tokens(x, q).unflatten(2, (H, grp)).sum(3) for x in (dq, dk))  # v-heads -> their qk-head
    return dq, dk, tokens(dv, v), tokens(dg, g), tokens(dbeta, beta), (None if initial_state is None else dh0)
