"""Halo for the short causal conv under inter-card CP.

A causal conv of width w needs the w - 1 tokens before each position. On rank r those for
its first tokens live on rank r - 1, so each rank sends its last w - 1 conv inputs to the
next rank (one point-to-point pair per direction; the backward sends the halo gradient
back). Halo rows from another sequence are zeroed, exactly as the conv's zero padding at a
sequence start would be.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .context import CPContext, CPError, comm_device


def halo_mask(cp: CPContext, width: int, device) -> torch.Tensor:
    """[width] 1.0 where the halo token belongs to this rank's first sequence, else 0."""
    start, _ = cp.token_range
    mask = torch.zeros(width, device=device)
    if cp.first_continues:
        seq = cp.layout.segments[0][2]
        seq_start = cp.cu_seqlens_global[seq]
        pos = torch.arange(start - width, start, device=device)
        mask = (pos >= seq_start).to(mask.dtype)
    return mask


def _shift(x: torch.Tensor, cp: CPContext, forward: bool) -> torch.Tensor:
    """Send x to the next rank and return what the previous one sent (reversed if not forward)."""
    dst, src = (cp.rank + 1, cp.rank - 1) if forward else (cp.rank - 1, cp.rank + 1)
    out_device = x.device
    x = x.to(comm_device(cp.group)).contiguous()  # gloo: through the CPU; p2p buffers must be dense
    recv = torch.zeros_like(x)
    ops = []
    to_global = (lambda r: dist.get_global_rank(cp.group, r)) if cp.group is not dist.group.WORLD else (lambda r: r)
    if 0 <= dst < cp.world:
        ops.append(dist.P2POp(dist.isend, x, to_global(dst), cp.group))
    if 0 <= src < cp.world:
        ops.append(dist.P2POp(dist.irecv, recv, to_global(src), cp.group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return recv.to(out_device)


def _mask_like(x: torch.Tensor, cp: CPContext, width: int) -> torch.Tensor:
    return halo_mask(cp, width, x.device).to(x.dtype).view(1, width, *([1] * (x.dim() - 2)))


def send_halo(tail: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """Forward half without autograd: tail [1, width, ...] (this rank's last conv inputs) goes to the
    next rank; returns the previous rank's, zeroed where they belong to another sequence."""
    halo = _shift(tail, cp, forward=True)
    return halo * _mask_like(halo, cp, tail.shape[1])


def return_halo_grad(dhalo: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """Backward half: the halo's gradient [1, width, ...] goes back to the previous rank; returns
    the gradient of this rank's tail (what the next rank sent)."""
    return _shift(dhalo * _mask_like(dhalo, cp, dhalo.shape[1]), cp, forward=False)


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, cp, width):
        fctx.cp, fctx.width, fctx.T = cp, width, x.shape[1]
        return send_halo(x[:, x.shape[1] - width :], cp)

    @staticmethod
    def backward(fctx, dhalo):
        dx = torch.zeros(dhalo.shape[0], fctx.T, *dhalo.shape[2:], dtype=dhalo.dtype, device=dhalo.device)
        dx[:, fctx.T - fctx.width :] = return_halo_grad(dhalo, fctx.cp)
        return dx, None, None


def exchange_conv_halo(x_local: torch.Tensor, cp_context: CPContext, conv_size: int) -> torch.Tensor:
    """The (conv_size - 1) conv inputs preceding this rank's slice: [B, conv_size - 1, ...].

    x_local: [1, T_local, ...] (any trailing dims). Zeros on rank 0, where this rank's first
    token starts a sequence, and before the start of a sequence that began late on the
    previous rank. Differentiable; prepend it to x_local and run the conv with its first
    sequence extended by conv_size - 1 tokens (or use it as the conv's initial cache).
    """
    width = conv_size - 1
    if width <= 0:
        return x_local[:, :0]
    if x_local.shape[1] < width:
        raise CPError(f"exchange_conv_halo: {x_local.shape[1]} local tokens < conv_size - 1 = {width}")
    if cp_context.world == 1:
        return x_local.new_zeros(x_local.shape[0], width, *x_local.shape[2:])
    return _Halo.apply(x_local, cp_context, width)
