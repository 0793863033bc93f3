"""Token positions (each token's index inside its sequence) built once per batch layout.

The fused layer's kernels read each row's position (where its conv window stops at a sequence
start). Every layer of a model sees the same positions in one step, and repeated shapes see them
again, so they are kept for the last few layouts instead of formed by ~6 small kernels per call.
A packed layout is built on the host from the offsets the layer has read back already and sent
with one copy; where only the GPU has the offsets, or a CUDA graph is being captured, they are
formed on the device as before (not kept).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..reference.layer_steps import token_positions

KEPT_LAYOUTS = 4  # (1M tokens: 4 MiB each)
_kept: OrderedDict = OrderedDict()


def shared_token_positions(batch: int, seq_len: int, cu_seqlens, cu_host, device) -> torch.Tensor:
    """int32 [batch * seq_len] token positions (`reference.layer_steps.token_positions`), shared by
    every call with the same layout on `device`: read them, never write them. cu_host: the host
    copy of cu_seqlens (None with cu_seqlens None: a dense batch)."""
    device = torch.device(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if (cu_seqlens is not None and cu_host is None) or capturing:
        return token_positions(batch, seq_len, cu_seqlens, device)
    key = (str(device), batch, seq_len, None if cu_host is None else tuple(cu_host.tolist()))
    positions = _kept.get(key)
    if positions is None:
        positions = token_positions(batch, seq_len, cu_host, "cpu")
        if device.type == "cuda":
            positions = positions.pin_memory().to(device, non_blocking=True)
        _kept[key] = positions
        if len(_kept) > KEPT_LAYOUTS:
            _kept.popitem(last=False)
    else:
        _kept.move_to_end(key)
    return positions
