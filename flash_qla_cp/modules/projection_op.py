"""The layer's input projection as a custom op of its own under torch.compile.

Inductor lays out a matmul's output with its row stride padded to a multiple of 128 bytes where
the width is not one already (comprehensive padding, on by default on GPUs), and hands a custom op
that takes its inputs' exact strides, as the fused layer's op does, a contiguous copy of it. Where
the projection width is not a multiple of 64 bf16 columns (e.g. 16 v-heads of 128: the training
recipe's 6,176, or Qwen3-Next's heads split over 2 or more ranks) the compiled layer copied P
twice per fwd+bwd: ~0.26 ms each at 32k tokens of the recipe on an H100 (torch 2.11). The matmul
run inside this op gives P the op's (contiguous) strides, which the fused op takes as they are.
Eager calls use `F.linear` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("flash_qla_cp::projection_rows", mutates_args=())
def projection_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ weight [N, D]^T -> [..., N] (both in one dtype: the caller applies autocast's)."""
    return F.linear(x, weight)


@projection_rows.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dP):
    x, weight = ctx.saved_tensors
    dx = dP @ weight if ctx.needs_input_grad[0] else None
    dw = dP.reshape(-1, dP.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    return dx, dw


projection_rows.register_autograd(_backward, setup_context=_setup_context)
