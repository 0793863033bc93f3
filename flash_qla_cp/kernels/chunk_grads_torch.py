"""Every chunk's gradients at once, in torch, from the chunk states the backward walks wrote.

The TileLang backward's grad kernel (`tilelang_bwd_impl.build_bwd_grad_group_kernel`) does not fit
in shared memory for head dims above 128. For those, the h walk and the dh walk still run in
TileLang (they fit at block_v 32 for K = V = 256), and the per-chunk gradients come from the
V-sliced kernel (`tilelang_bwd_grad_wide`) or, with `tilelang_bwd_impl.WIDE_GRADS = "torch"`,
from this module (about 3x slower there, and twice the memory): the same inputs (packed [1, T, ...] tensors, the states entering and the gradients leaving each
chunk in chunk-table order), the same outputs (dq, dk per qk-head, dg, dbeta per v-head).

The formulas are `reference_backward.chunk_gradients` (the hand-written backward's per-chunk
step), here for a batch of chunks at a time: every chunk is independent given its two states.
Padding rows of a short last chunk are zero (q, k, do, vres, dvn, beta) and keep the last
valid row's G, as in the kernels.
"""

from __future__ import annotations

import torch

from .reference_backward import chunk_gradients, ut_inverse
from .tilelang_common import CHUNK


def _rows(ctab: torch.Tensor, cu_seqlens: torch.Tensor, T: int):
    """(token index [NC, C] clamped to each chunk's last valid row, valid mask [NC, C])."""
    seq, chunk = ctab[:, 0].long(), ctab[:, 1].long()
    cu = cu_seqlens.long()
    t0 = cu[seq] + chunk * CHUNK
    length = torch.clamp(cu[seq + 1] - t0, max=CHUNK)
    offs = torch.arange(CHUNK, device=ctab.device)
    valid = offs[None, :] < length[:, None]
    rows = t0[:, None] + torch.minimum(offs[None, :], length[:, None] - 1)
    return rows.clamp(0, max(T - 1, 0)), valid


def chunk_grads_from_states(q, k, do, vres, dvn, gcum, beta, h_states, dh_states, cu_seqlens, chunk_table, scale,
                            chunks_per_batch: int | None = None):
    """(dq [1,T,H,K] and dk in q's dtype, dg [1,T,HV] and dbeta in the compute dtype).

    q, k [1, T, H, K]; do, vres (v - exp(G) k S), dvn (gradient of v_new) [1, T, HV, V];
    gcum [1, T, HV] the chunk-local cumulative gate; beta [1, T, HV]; h_states / dh_states
    [NC, HV, K, V] (the state entering / the gradient of the state leaving each chunk of
    `chunk_table` [NC, 2]); cu_seqlens [N + 1]. Computed in fp32 (float64 for float64 inputs),
    `chunks_per_batch` chunks at a time (memory: a dozen [chunks, HV, 64, max(K, V)] tensors; by
    default as many chunks as keep each one at 2^25 elements, 128 MB in fp32)."""
    _, T, H, K = q.shape
    HV = do.shape[2]
    grp = HV // H
    f32 = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(1, T, H, K, dtype=f32, device=q.device)
    dk = torch.zeros_like(dq)
    dg = torch.zeros(1, T, HV, dtype=f32, device=q.device)
    dbeta = torch.zeros_like(dg)
    if chunks_per_batch is None:
        chunks_per_batch = max(1, 2**25 // (HV * CHUNK * max(K, do.shape[3])))
    rows_all, valid_all = _rows(chunk_table, cu_seqlens, T)

    for c0 in range(0, chunk_table.shape[0], chunks_per_batch):
        rows, valid = rows_all[c0:c0 + chunks_per_batch], valid_all[c0:c0 + chunks_per_batch]
        vm = valid[:, None, :, None]  # [nb, 1, C, 1]

        def heads(x, per_qk_head=False):  # [1, T, heads, D] -> [nb, HV, C, D] fp32, padding rows 0
            x = x[0, rows].to(f32).permute(0, 2, 1, 3)
            if per_qk_head:
                x = x.repeat_interleave(grp, dim=1)
            return x * vm

        qc, kc = heads(q, True), heads(k, True)
        doc, vrc, dvc = heads(do), heads(vres), heads(dvn)
        G = gcum[0, rows].to(f32).permute(0, 2, 1)  # [nb, HV, C]; padding keeps the last valid G
        b = beta[0, rows].to(f32).permute(0, 2, 1) * valid[:, None, :]
        S = h_states[c0:c0 + chunks_per_batch].to(f32)
        dS = dh_states[c0:c0 + chunks_per_batch].to(f32)

        Tm = ut_inverse(kc, G, b)
        t = (Tm * b[..., None, :]).transpose(-1, -2) @ dvc  # = dv (the dh walk wrote it too)
        dq_c, dk_c, db_c, dg_c = chunk_gradients(qc, kc, doc, vrc, dvc, t, G, b, Tm, S, dS, scale)

        # back to tokens: the valid rows of each chunk (chunks do not overlap), v-heads summed
        # into their qk-head for dq and dk
        tok = rows[valid]
        per_qk = (lambda x: x.unflatten(1, (H, grp)).sum(2).permute(0, 2, 1, 3)[valid])
        dq[0, tok] = per_qk(dq_c)
        dk[0, tok] = per_qk(dk_c)
        dg[0, tok] = dg_c.permute(0, 2, 1)[valid]
        dbeta[0, tok] = db_c.permute(0, 2, 1)[valid]
    return dq.to(q.dtype), dk.to(q.dtype), dg, dbeta
