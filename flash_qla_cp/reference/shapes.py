"""Shape helpers shared by the torch references: head expansion, sequence bounds, the chunk layout."""

from __future__ import annotations

from dataclasses import dataclass

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


def l2norm_backward(x: torch.Tensor, dy: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The gradient of `l2norm` at x for the output gradient dy (by hand, no autograd: it also
    runs inside custom ops, below autograd): r dy - x r^3 <x, dy> with r = (sum(x^2) + eps)^-1/2."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    dyf = dy.to(xf.dtype)
    r = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)
    return (r * dyf - xf * r.pow(3) * (xf * dyf).sum(-1, keepdim=True)).to(x.dtype)


@dataclass
class ChunkLayout:
    """Every chunk of every sequence, packed without padding to the longest sequence, in walk
    order: the rows of step c are chunk c of each sequence that has more than c chunks, the
    sequences sorted longest first. So step c's rows are `rows(c)` and its sequences the first
    `active[c]` of `order`: a walk over the steps does work in proportion to the total number of
    chunks, whatever the packing (one long document among many one-token ones included).

    index [NC, C]: each row's token positions in the flat B*T token axis; the positions past a
    sequence's end point at the extra zero row num_tokens, which `gather` appends (padding
    tokens carry g = 0, beta = 0 and k = 0: they leave the state unchanged)."""

    index: torch.Tensor
    order: list  # sequence indices, longest first (ties in index order)
    active: list  # per step, how many sequences are still walking
    offsets: list  # per step, its first row; offsets[-1] = NC
    num_tokens: int

    @classmethod
    def build(cls, bounds, seq_len: int, num_tokens: int, chunk_size: int, device) -> "ChunkLayout":
        """bounds: (batch index, start, end) per sequence (`sequence_bounds`) of a [B, seq_len]
        token axis flattened to num_tokens = B * seq_len."""
        chunks = [-(-(end - start) // chunk_size) for _, start, end in bounds]
        order = sorted(range(len(bounds)), key=lambda n: -chunks[n])
        active = [sum(1 for n in chunks if n > c) for c in range(max(chunks, default=0))]
        firsts, ends, offsets = [], [], [0]
        for c, a in enumerate(active):
            for n in order[:a]:
                b, start, end = bounds[n]
                firsts.append(b * seq_len + start + c * chunk_size)
                ends.append(b * seq_len + end)
            offsets.append(len(firsts))
        pos = torch.tensor(firsts, dtype=torch.long)[:, None] + torch.arange(chunk_size)
        index = torch.where(pos < torch.tensor(ends, dtype=torch.long)[:, None], pos, num_tokens)
        return cls(index.to(device), order, active, offsets, num_tokens)

    @property
    def num_chunks(self) -> int:
        return self.index.shape[0]

    def rows(self, step: int) -> slice:
        return slice(self.offsets[step], self.offsets[step + 1])

    def gather(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, T, HV, ...] -> [NC, HV, C, ...] in the compute dtype (padding rows zero)."""
        flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).to(dtype)
        flat = torch.cat([flat, flat.new_zeros(self.num_tokens + 1 - flat.shape[0], *flat.shape[1:])])
        return flat[self.index].movedim(2, 1)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[NC, HV, C, ...] -> [num_tokens, HV, ...]: `gather`'s inverse, padding dropped."""
        rows = x.movedim(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])
        flat_index = self.index.reshape(-1)
        valid = flat_index < self.num_tokens
        return rows.new_zeros(self.num_tokens, *rows.shape[1:]).index_put((flat_index[valid],), rows[valid])
