"""State-only pass: the affine map S_out = M S_in + h of every segment, without computing o.

CP needs (h, M) of a span before it knows the span's incoming state. Running the full forward
with a zero start gives h but also a wasted o; this pass builds per-chunk maps in one batched
step (WY form, as the chunked reference) and multiplies them with a log-depth tree inside
groups of chunks, so memory stays at `group` chunk matrices per segment and head.
"""

from __future__ import annotations

import torch

from ..constants import CHUNK
from ..reference.chunked import _decay_diff, chunk_cumsum, compute_dtype, decay
from ..reference.shapes import expand_qk_heads


def _chunk_maps(k, v, g, beta, with_h: bool):
    """Per-chunk (M_c [.., K, K], h_c [.., K, V] or None) from chunked k, v, g, beta."""
    dt = k.dtype
    G = chunk_cumsum(g)
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * _decay_diff(G, False, dt)
    lhs = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device) + A
    w = torch.linalg.solve_triangular(lhs, kb * decay(G, dt)[..., None], upper=False, unitriangular=True)
    k_dec = (k * decay(G[..., -1:] - G, dt)[..., None]).transpose(-1, -2)  # [.., K, C]
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    M = decay(G[..., -1], dt)[..., None, None] * eye - k_dec @ w
    h = None
    if with_h:
        u = torch.linalg.solve_triangular(lhs, v * beta[..., None], upper=False, unitriangular=True)
        h = k_dec @ u
    return M, h


def _compose(first, second):
    """Apply `first` then `second`: (M2 M1, M2 h1 + h2)."""
    M1, h1 = first
    M2, h2 = second
    return M2 @ M1, (None if h1 is None else M2 @ h1 + h2)


def _tree_reduce(M, h):
    """Compose maps along dim 2 (chunk order) pairwise until one is left."""
    while M.shape[2] > 1:
        if M.shape[2] % 2:  # odd count: the last map waits for the next round
            tail = (M[:, :, -1:], None if h is None else h[:, :, -1:])
            M, h = M[:, :, :-1], (None if h is None else h[:, :, :-1])
        else:
            tail = None
        a = (M[:, :, 0::2], None if h is None else h[:, :, 0::2])
        b = (M[:, :, 1::2], None if h is None else h[:, :, 1::2])
        M, h = _compose(a, b)
        if tail is not None:
            M = torch.cat([M, tail[0]], 2)
            h = None if h is None else torch.cat([h, tail[1]], 2)
    return M[:, :, 0], (None if h is None else h[:, :, 0])


@torch.no_grad()
def padded_chunk_index(bounds, seq_len: int, num_tokens: int, chunk_size: int, device):
    """Token index table [N, Tp] (Tp a multiple of chunk_size) into the flat B*T token axis.

    Each sequence starts at column 0; columns past its end point at the extra zero row
    with index num_tokens (= B*T), which the caller appends. Padding tokens carry g = 0, beta = 0 and
    k = 0, so they leave the state unchanged and the final state stays exact.
    """
    longest = max((end - start for _, start, end in bounds), default=0)
    padded = max(chunk_size, -(-longest // chunk_size) * chunk_size)
    index = torch.full((len(bounds), padded), num_tokens, dtype=torch.long)
    for n, (b, start, end) in enumerate(bounds):
        index[n, : end - start] = torch.arange(b * seq_len + start, b * seq_len + end)
    return index.to(device), padded


def _to_chunks(x: torch.Tensor, index: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, HV, ...] -> [N, HV, NT, C, ...] gathered through a padded token index
    (`padded_chunk_index`)."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).to(dtype)
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
    gathered = flat[index]  # [N, Tp, HV, ...]
    N, Tp = index.shape
    gathered = gathered.reshape(N, Tp // chunk_size, chunk_size, *gathered.shape[2:])
    # move the head axis in front of the chunk axes
    return gathered.movedim(3, 1)


def segment_transitions(k, v, g, beta, cu_seqlens=None, with_h=True, group=64, chunk_size=CHUNK):
    """(M [N, HV, K, K], h [N, HV, K, V] or None) per sequence of a packed [1, T, ...] batch.

    h is the final state from a zero start, so final(S0) = M @ S0 + h. fp32 (float64 stays
    float64). Padding tokens have k = g = beta = 0, i.e. the identity map.
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = compute_dtype(k, v)
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        edges = cu_seqlens.tolist()
        bounds = [(0, edges[n], edges[n + 1]) for n in range(len(edges) - 1)]
    index, _ = padded_chunk_index(bounds, T, B * T, chunk_size, k.device)
    kc = _to_chunks(expand_qk_heads(k, HV), index, chunk_size, dtype)
    vc = _to_chunks(v, index, chunk_size, dtype) if with_h else None
    gc = _to_chunks(g, index, chunk_size, dtype)
    bc = _to_chunks(beta, index, chunk_size, dtype)
    N, NT = kc.shape[0], kc.shape[2]
    acc = None
    for c0 in range(0, NT, group):
        sl = slice(c0, c0 + group)
        M, h = _chunk_maps(kc[:, :, sl], None if vc is None else vc[:, :, sl], gc[:, :, sl], bc[:, :, sl], with_h)
        part = _tree_reduce(M, h)
        acc = part if acc is None else _compose(acc, part)
    M, h = acc
    return M.reshape(N, HV, K, K), (None if h is None else h.reshape(N, HV, K, V))
