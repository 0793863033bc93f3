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

    One F.conv1d runs over the whole stream; only the first K-1 tokens of each sequence, whose windows
    reach past its start, are recomputed from gathered windows (memory stays O(T C), not O(T K C)).
    """
    weight3 = weight if weight.dim() == 3 else weight[:, None]
    weight2 = weight3[:, 0]
    if activation not in ("silu", None):
        raise ValueError(f"causal_conv1d_varlen: unsupported activation {activation!r}")
    B, T, C = x.shape
    K = weight2.shape[-1]
    W = K - 1
    xw = x.to(weight2.dtype)
    y = F.conv1d(xw.transpose(1, 2), weight3, bias, padding=W, groups=C)[..., :T].transpose(1, 2)

    seq, pos, lengths, ends = _sequence_layout(B, T, cu_seqlens, x.device)
    N = lengths.numel()
    if conv_state is not None:
        hist = conv_state[..., conv_state.shape[-1] - W :].to(weight2.dtype)  # [N, C, W]
        hist = hist.transpose(1, 2).reshape(N * W, C)
    else:
        hist = xw.new_zeros(N * W, C)
    # one table holds the carried history rows, then the tokens, then a zero row for "before the start"
    table = torch.cat([hist, xw.reshape(B * T, C), xw.new_zeros(1, C)])
    zero_row = table.shape[0] - 1
    starts = ends - lengths

    def gather_index(seq_id, p):
        """Row of `table` for position p (>= -W) of sequence seq_id."""
        token_row = N * W + starts[seq_id] + p
        hist_row = seq_id * W + (W + p)  # p in [-W, -1] -> history column W + p
        before = hist_row if conv_state is not None else torch.full_like(p, zero_row)
        return torch.where(p >= 0, token_row, before)

    # plain rows already saw zeros before their start; packed sequences and carried states need the fix
    if cu_seqlens is not None or conv_state is not None:
        offsets = torch.arange(-W, 1, device=x.device)  # window slot i reads position pos - W + i
        # a few tokens per sequence (decoding): every row is recomputed, so that no index depends
        # on the values (a CUDA graph can capture the call); else only the rows that need it
        every_row = B * T <= N * K
        fix = None if every_row else (pos < W).nonzero().squeeze(1)
        fseq, fpos = (seq, pos) if every_row else (seq[fix], pos[fix])
        idx = gather_index(fseq[:, None], fpos[:, None] + offsets[None, :])  # [F, K]
        y_fix = torch.einsum("fkc,ck->fc", table[idx], weight2)
        if bias is not None:
            y_fix = y_fix + bias
        y = y.reshape(B * T, C)
        y = torch.where((pos < W)[:, None], y_fix, y) if every_row else y.index_put((fix,), y_fix)
        y = y.reshape(B, T, C)
    if activation == "silu":
        y = F.silu(y)
    y = y.to(x.dtype)

    final = None
    if output_final_state:
        cols = lengths[:, None] - W + torch.arange(W, device=x.device)[None, :]  # positions of the last W inputs
        sid = torch.arange(N, device=x.device)[:, None].expand(N, W)
        final = table[gather_index(sid, cols)].transpose(1, 2).to(x.dtype).contiguous()  # [N, C, W]
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


def last_inputs(x: torch.Tensor, cu_seqlens: torch.Tensor | None, width: int) -> torch.Tensor:
    """Conv state after a call that began with none: the last `width` inputs of each sequence, 0
    before its start. x [B, T, C] (B == 1 with cu_seqlens) -> [N, C, width]."""
    B, T, C = x.shape
    _, _, lengths, ends = _sequence_layout(B, T, cu_seqlens, x.device)
    rows = ends[:, None] - width + torch.arange(width, device=x.device)[None, :]  # [N, width]
    taken = x.reshape(B * T, C)[rows.clamp(min=0)]
    return torch.where((rows >= (ends - lengths)[:, None])[..., None], taken, 0).transpose(1, 2).contiguous()


def last_kept_inputs(x: torch.Tensor, keep: torch.Tensor, width: int, conv_state: torch.Tensor | None = None):
    """Conv state after a padded batch: the last `width` inputs of each row whose keep is True
    (older ones from conv_state, else 0). x [B, T, C], keep [B, T] bool -> [B, C, width]."""
    B, T, C = x.shape
    pos = torch.arange(T, device=x.device).expand(B, T)
    kept_first = torch.sort(torch.where(keep, pos, pos + T), dim=1).values  # kept positions first, in order
    n = keep.sum(1, keepdim=True)  # [B, 1]
    k = n - width + torch.arange(width, device=x.device)  # index among kept tokens, [B, width]
    # (rows past the kept tokens, k < 0, are not used: clamped into range for the gather)
    rows = torch.gather(kept_first, 1, k.clamp(0, T - 1)).clamp(max=T - 1) if T > 0 else torch.zeros_like(k)
    out = torch.gather(x, 1, rows[..., None].expand(B, width, C))  # [B, width, C]
    if conv_state is not None:
        hist = conv_state[..., conv_state.shape[-1] - width :].transpose(1, 2).to(x.dtype)  # [B, width, C]
        older = torch.gather(hist, 1, (width + k).clamp(0, width - 1)[..., None].expand(B, width, C))
    else:
        older = torch.zeros_like(out)
    return torch.where((k >= 0)[..., None], out, older).transpose(1, 2).contiguous()
