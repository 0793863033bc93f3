"""Gated RMSNorm: rmsnorm(x) * weight * silu(gate), over the last dim (one head's values)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise before gating; in at least fp32 (half inputs would lose the variance); output in x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.to(dtype) * F.silu(gate.to(dtype))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Parameter `weight` [dim] initialised to ones (a Hugging Face `norm.weight` loads unchanged)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
