"""Short causal depthwise conv1d + SiLU over [B, T, C], aware of packed sequences and of a carried state.

The state of a sequence is its last W = kernel_size - 1 inputs, [N, C, W] (channel first, oldest
column first). It serves both decoding (the tail of the previous step) and context parallelism
(the tail of the previous rank's shard).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _sequence_layout(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device):
    """Per flat token: its sequence id and position inside the sequence; plus each sequence's end."""
    if cu_seqlens is None:
        pos = torch.arange(seq_len, device=device).repeat(batch)
        seq = torch.arange(batch, device=device).repeat_interleave(seq_len)
        lengths = torch.full((batch,), seq_len, device=device, dtype=torch.long)
        ends = (torch.arange(batch, device=device) + 1) * seq_len
        return seq, pos, lengths, ends
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=seq_len)
    pos = torch.arange(seq_len, device=device) - cu[:-1][seq]
    return seq, pos, lengths, cu[1:]


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = "silu",
):
    """y_t = act(sum_i w[:, i] x_{t - (K-1) + i} + bias), where x before a sequence's start is its state (or 0).

    x: [B, T, C] (B == 1 with cu_seqlens); weight: [C, K] or [C, 1, K]; conv_state: [N, C, >= K-1]
    (only the last K-1 columns are read). Returns (y [B, T, C] in x's dtype, new state [N, C, K-1] or None).
    Computed in the weight's dtype, like nn.Conv1d would.
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    B, T, C = x.shape
    K = weight.shape[-1]
    W = K - 1
    seq, pos, lengths, ends = _sequence_layout(B, T, cu_seqlens, x.device)
    N = lengths.numel()
    xf = x.reshape(B * T, C).to(weight.dtype)
    if conv_state is not None:
        hist = conv_state[..., conv_state.shape[-1] - W :].to(weight.dtype)  # [N, C, W]
        hist = hist.transpose(1, 2).reshape(N * W, C)
    else:
        hist = xf.new_zeros(N * W, C)
    # one table holds the carried history rows, then the tokens, then a zero row for "before the start"
    table = torch.cat([hist, xf, xf.new_zeros(1, C)])
    zero_row = table.shape[0] - 1
    have_hist = conv_state is not None
    starts = ends - lengths

    def gather_index(seq_id, p):
        """Row of `table` for position p (may be negative) of sequence seq_id."""
        token_row = N * W + starts[seq_id] + p
        hist_row = seq_id * W + (W + p)  # p in [-W, -1] -> history column W + p
        before = torch.full_like(p, zero_row)
        inside = torch.where(p >= -W, hist_row, before) if have_hist else before
        return torch.where(p >= 0, token_row, inside)

    offsets = torch.arange(-W, 1, device=x.device)  # window slot i reads position pos - W + i
    idx = gather_index(seq[:, None], pos[:, None] + offsets[None, :])  # [B*T, K]
    windows = table[idx]  # [B*T, K, C]
    y = torch.einsum("tkc,ck->tc", windows, weight)
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d_varlen: unsupported activation {activation!r}")
    y = y.to(x.dtype).reshape(B, T, C)

    final = None
    if output_final_state and W > 0:
        cols = lengths[:, None] - W + torch.arange(W, device=x.device)[None, :]  # positions of the last W inputs
        sid = torch.arange(N, device=x.device)[:, None].expand(N, W)
        final = table[gather_index(sid, cols)].transpose(1, 2).contiguous()  # [N, C, W]
    elif output_final_state:
        final = x.new_zeros(N, C, 0)
    return y, final


class ShortConvolution(nn.Conv1d):
    """Depthwise causal conv + SiLU. Parameters laid out as nn.Conv1d(C, C, K, groups=C), so
    a Hugging Face `conv1d.weight` [C, 1, K] loads unchanged."""

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: str | None = "silu",
                 device=None, dtype=None):
        if kernel_size < 2:
            raise ValueError(f"ShortConvolution: kernel_size must be >= 2, got {kernel_size}")
        super().__init__(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=bias,
                         device=device, dtype=dtype)
        self.activation = activation

    @property
    def state_width(self) -> int:
        return self.kernel_size[0] - 1

    def forward(self, x, cu_seqlens=None, conv_state=None, output_final_state=False):
        """x [B, T, C] -> (y [B, T, C], new state [N, C, K-1] or None). See `causal_conv1d_varlen`."""
        return causal_conv1d_varlen(x, self.weight, self.bias, cu_seqlens, conv_state, output_final_state,
                                    self.activation)
