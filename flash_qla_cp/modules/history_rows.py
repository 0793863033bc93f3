"""A cache continued on the fused layer: each sequence's conv state goes in as K - 1 extra rows of
the projection output P, in front of the sequence's tokens. The fused steps read a sequence's
conv inputs from P alone (zeros before its start), so with those rows in place its first tokens
read the cached history instead, with the kernels of a fresh call.

At the history rows the b and a columns hold -inf: beta = sigmoid(-inf) = 0 and
g = -exp(A_log) softplus(-inf) = 0 exactly, so the delta rule carries the entering state through
them unchanged (S = exp(0) (I - 0 k k^T) S + 0); their outputs are dropped. The cost is K - 1 rows
per sequence and one copy of P: small next to a prompt's work, and for decoding (one token per
sequence) four rows instead of one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..reference.layer_steps import ProjectionLayout, layout_columns


@dataclass(frozen=True)
class HistoryRows:
    """Where the rows go: the call's B x T tokens (N sequences, by batch row or by cu_seqlens) with
    `width` history rows in front of each sequence. Read-only: a batch's are made once per shape."""

    width: int
    source: torch.Tensor  # [N * width + NT] int64: each extended row's row of cat([history rows, tokens])
    tokens: torch.Tensor  # [NT] int64: the extended rows of the call's tokens, in order
    cu_seqlens: torch.Tensor  # [N + 1] int32: the extended sequences, on the call's device
    cu_seqlens_cpu: torch.Tensor  # the same on the host (the op plans from it without a read-back)
    positions: torch.Tensor  # [N * width + NT] int32: each extended row's index inside its sequence
    last_rows: torch.Tensor  # [N, width] int64: each extended sequence's last rows (its conv state after the call)

    @classmethod
    def of(cls, batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
           width: int, device) -> "HistoryRows":
        """The call's packed sequences (cu_seqlens with its host copy, batch == 1), or one sequence
        per batch row (both None). Indices are formed on the device: no host-to-device copy (which
        would wait for the GPU's queue); a batch's once per shape (decoding repeats one shape, and
        every index op is a launch: host time, or replay time in a CUDA graph)."""
        if cu_seqlens is None:
            return _batch_rows(batch, seq_len, width, torch.device(device))
        return cls._formed(batch, seq_len, cu_seqlens, cu_seqlens_cpu, width, device)

    @classmethod
    def _formed(cls, batch, seq_len, cu_seqlens, cu_seqlens_cpu, width, device) -> "HistoryRows":
        if cu_seqlens is None:
            cu = torch.arange(batch + 1, device=device) * seq_len
            cu_cpu = torch.arange(batch + 1) * seq_len
        else:
            cu, cu_cpu = cu_seqlens.to(device=device, dtype=torch.int64), cu_seqlens_cpu.to(torch.int64)
        N, NT = cu_cpu.numel() - 1, int(cu_cpu[-1])
        lengths = cu[1:] - cu[:-1]
        ext_cu = cu + width * torch.arange(N + 1, device=device)
        seqs = torch.arange(N, device=device)
        seq = torch.repeat_interleave(seqs, lengths + width, output_size=NT + N * width)
        offset = torch.arange(NT + N * width, device=device) - ext_cu[:-1][seq]  # row inside its extended sequence
        source = torch.where(offset < width, seq * width + offset, N * width + cu[:-1][seq] + offset - width)
        tokens = torch.arange(NT, device=device) + width * (
            torch.repeat_interleave(seqs, lengths, output_size=NT) + 1)
        ext_cu_cpu = cu_cpu + width * torch.arange(N + 1)
        last_rows = ext_cu[1:, None] - width + torch.arange(width, device=device)  # (every sequence has >= width rows)
        return cls(width, source, tokens, ext_cu.to(torch.int32), ext_cu_cpu.to(torch.int32), offset.to(torch.int32),
                   last_rows)

    def extend(self, P: torch.Tensor, conv_state: torch.Tensor, layout: ProjectionLayout) -> torch.Tensor:
        """P [B, T, width] and conv_state [N, C, >= width] (the last `width` columns read) -> the
        extended rows [1, N * width + B * T, width] (differentiable in both)."""
        N, C, _ = conv_state.shape
        W = self.width
        history = P.new_zeros(N * W, P.shape[-1])
        state = conv_state[..., conv_state.shape[-1] - W :].transpose(1, 2).reshape(N * W, C)
        history[:, layout_columns(layout, "conv", P.device)] = state.to(P.dtype)
        # (index_fill_ takes the value as a scalar: an indexed assignment of a Python float would
        # copy it to the device as a tensor, which a CUDA graph capture refuses)
        for part in ("a", "b"):
            history.index_fill_(1, layout_columns(layout, part, P.device), float("-inf"))
        return torch.cat([history, P.reshape(-1, P.shape[-1])])[self.source][None]

    def drop(self, y: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
        """The call's rows of an extended output [1, N * width + NT, ...] -> [batch, seq_len, ...]."""
        return y[0, self.tokens].view(batch, seq_len, *y.shape[2:])


@functools.lru_cache(maxsize=64)
def _batch_rows(batch: int, seq_len: int, width: int, device: torch.device) -> HistoryRows:
    return HistoryRows._formed(batch, seq_len, None, None, width, device)
