"""Naive token-by-token recurrence: the ground truth every other path is checked against.

It follows the definition literally, one token at a time, in the dtype of its inputs
(pass float64 tensors for checking). It is slow and meant for short sequences only.
"""

from __future__ import annotations

import torch

from .shapes import expand_qk_heads, sequence_bounds


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T ;  o_t = scale * S_t^T q_t.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; states [N, HV, K, V].
    Returns (o [B, T, HV, V], final_state [N, HV, K, V] or None), in the input dtype.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K**-0.5
    q, k = expand_qk_heads(q, HV), expand_qk_heads(k, HV)
    bounds = sequence_bounds(B, T, cu_seqlens)
    o = torch.zeros(B, T, HV, V, dtype=v.dtype, device=v.device)
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        if initial_state is not None:
            S = initial_state[n].to(v.dtype).clone()
        else:
            S = torch.zeros(HV, K, V, dtype=v.dtype, device=v.device)
        for t in range(start, end):
            kt, vt, qt = k[b, t], v[b, t], q[b, t]  # [HV, K], [HV, V], [HV, K]
            S = S * torch.exp(g[b, t])[:, None, None]
            # delta rule: move the value read at k_t towards v_t by beta_t
            err = vt - torch.einsum("hkv,hk->hv", S, kt)
            S = S + beta[b, t][:, None, None] * kt[:, :, None] * err[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, qt)
        finals.append(S)
    final_state = torch.stack(finals) if output_final_state else None
    return o, final_state
