"""Chunk bookkeeping of packed sequences, as the kernels read it: the chunk table, each
sequence's first chunk, the walk order of the sequences. Device versions build from a
cu_seqlens tensor; host versions from host offsets (no read-back from the GPU).
"""

from __future__ import annotations

import torch

from ..constants import CHUNK


def chunk_table(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """[NC, 2] int32 table of (sequence index, chunk index inside the sequence) for packed inputs.

    Built with torch on the device of `cu_seqlens`; reading the total chunk count costs one
    host sync (the grid size must be known on the host).
    """
    offsets = chunk_offsets(cu_seqlens, chunk).to(torch.int64)
    n_chunks = offsets[1:] - offsets[:-1]
    total = int(offsets[-1].item())
    seq_ids = torch.repeat_interleave(torch.arange(len(n_chunks), device=offsets.device), n_chunks,
                                      output_size=total)
    local = torch.arange(total, device=offsets.device) - offsets[:-1][seq_ids]
    return torch.stack([seq_ids, local], dim=1).to(torch.int32).contiguous()


def chunk_offsets(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """[N + 1] int32: the index of each sequence's first chunk in the packed chunk order of
    `chunk_table` (the last entry is the total), computed on the device of `cu_seqlens`."""
    cu = cu_seqlens.to(torch.int64)
    n_chunks = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    out = torch.zeros(cu.shape[0], dtype=torch.int32, device=cu.device)
    out[1:] = torch.cumsum(n_chunks, 0).to(torch.int32)
    return out


# Walk order of varlen grids. A walk kernel runs one block per (sequence, v-head) for the whole
# sequence; with more blocks than SMs the GPU starts them in grid order as SMs free up, so a long
# sequence started last sets the kernel's end. Blocks take their sequence from an order table,
# longest first (greedy longest-processing-time scheduling): the bench's 8 uneven documents in 32k
# (TP1, 256 walks on 132 SMs) finish after ~132 chunk steps per SM instead of ~188 in order.
def walk_order(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] int32 sequence indices of `cu_seqlens`, longest first (ties in index order), computed
    on its device."""
    lengths = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1].to(torch.int64)
    return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)


def host_chunk_table(offsets: list, device) -> torch.Tensor:
    """[NC, 2] int32 (segment, chunk in segment) of packed segments given by host `offsets`;
    the same table as `chunk_table` without reading the offsets back from the GPU."""
    counts = torch.tensor([-(-(b - a) // CHUNK) for a, b in zip(offsets, offsets[1:])], dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(counts)), counts)
    local = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[seg]
    return torch.stack([seg, local], 1).to(torch.int32).to(device)


def host_chunk_offsets(offsets: list, device) -> torch.Tensor:
    """[N + 1] int32: where each segment's chunks start in the packed chunk numbering."""
    counts = [-(-(b - a) // CHUNK) for a, b in zip(offsets, offsets[1:])]
    return torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
