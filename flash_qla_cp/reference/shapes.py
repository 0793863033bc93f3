"""Shape helpers shared by the torch references: head expansion, sequence bounds, chunk padding."""

from __future__ import annotations

import torch


def expand_qk_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """GVA: v-head i reads qk-head i // (HV / H), so repeat each qk head HV / H times."""
    groups = num_v_heads // x.shape[2]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def sequence_bounds(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None):
    """List of (batch index, start, end) for every sequence, packed (B == 1) or batched."""
    if cu_seqlens is None:
        return [(b, 0, seq_len) for b in range(batch)]
    edges = cu_seqlens.tolist()
    return [(0, edges[n], edges[n + 1]) for n in range(len(edges) - 1)]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in at least fp32."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


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
