"""Host side of the layer's Hopper kernels around the op (`hopper/layer_inputs*.py`,
`hopper/gated_norm*.py`): a plan (forward and backward kernel) per step and configuration, and the
four steps with the signatures of their torch forms in `reference/layer_steps.py` (the fused layer,
`modules/fused_mixer.py`, calls either set the same way). The fused layer compiles both steps'
kernels with the op's on its first call (`layer_plans`); a step compiles the kernel it launches
on first use where nothing compiled it ahead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch

from . import runtime
from .hopper.common import tl_dtype
from .hopper.gated_norm import build_gated_norm_kernel
from .hopper.gated_norm_bwd import build_gated_norm_bwd_kernel
from .hopper.layer_inputs import WINDOW_ROWS, build_layer_inputs_kernel
from .hopper.layer_inputs_bwd import build_layer_inputs_bwd_kernel
from .runtime import KernelSpec, kernel_operand

MAX_CONV_SIZE = WINDOW_ROWS  # the conv window a block keeps
# Block sizes and register caps (`tools/tune_layer.py`, H100, Qwen3-Next, 2026-12-05 / -06).
# The inputs backward uses 128 registers uncapped (two blocks of 256 threads per SM); capped for
# three blocks (80 registers, no spills) it took 2.64 ms instead of 3.02. The inputs forward walks
# 8 tiles of 64 tokens per block, 3 tiles in flight, two blocks per SM (80 registers, no spills):
# 0.491 ms at 8 packed sequences in 32k, against 0.529 for one tile per block (three blocks per SM,
# plain loads); 16 tiles 0.495, three blocks per SM 0.568 (56 registers, spills). The norm forward:
# 16-token blocks 0.319 ms against 0.350 at 32. The norm backward (112 registers uncapped): five
# blocks per SM (96 registers) 0.678 against 0.728.
INPUTS_BLOCK_TOKENS = 64
INPUTS_TILES, INPUTS_STAGES, INPUTS_BLOCKS_PER_SM = 8, 3, 2
INPUTS_BWD_BLOCK_TOKENS = 32  # + 16 look-ahead tokens: 48-row tiles
INPUTS_BWD_BLOCKS_PER_SM = 3
NORM_BLOCK_TOKENS = 16
NORM_BWD_BLOCK_TOKENS = 32
NORM_BWD_BLOCKS_PER_SM = 5


@dataclass(frozen=True)
class StepPlan:
    """A layer step's forward and backward kernel."""

    forward: KernelSpec
    backward: KernelSpec

    def specs(self) -> tuple:
        return (self.forward, self.backward)


@functools.lru_cache(maxsize=None)
def plan_layer_inputs(layout, conv_size: int, dtype: str, allow_neg_eigval: bool, grad_parts: int = 1) -> StepPlan:
    """conv + SiLU, l2 norm and gates for a projection layout (`reference.layer_steps.ProjectionLayout`).
    grad_parts: how many per-v-head parts of dq and dk the backward kernel reads and sums (1: dq
    and dk summed already; the qk-heads' group size where the op's backward leaves them as parts)."""
    lay = {f.name: getattr(layout, f.name) for f in fields(layout) if not f.name.startswith("z_")}
    params = dict(H=lay.pop("num_heads"), HV=lay.pop("num_v_heads"), dk=lay.pop("head_k_dim"),
                  dv=lay.pop("head_v_dim"), conv_size=conv_size, dtype=tl_dtype(dtype),
                  allow_neg_eigval=bool(allow_neg_eigval), **lay)
    parts = dict(grad_parts=grad_parts) if grad_parts > 1 else {}
    forward = KernelSpec.of(build_layer_inputs_kernel, block_tokens=INPUTS_BLOCK_TOKENS, tiles=INPUTS_TILES,
                            stages=INPUTS_STAGES, blocks_per_sm=INPUTS_BLOCKS_PER_SM, **params)
    return StepPlan(forward,
                    KernelSpec.of(build_layer_inputs_bwd_kernel, block_tokens=INPUTS_BWD_BLOCK_TOKENS,
                                  blocks_per_sm=INPUTS_BWD_BLOCKS_PER_SM, **params,
                                  z_offset=layout.z_offset, z_head_stride=layout.z_head_stride, **parts))


@functools.lru_cache(maxsize=None)
def plan_gated_norm(layout, dtype: str, eps: float) -> StepPlan:
    params = dict(H=layout.num_heads, HV=layout.num_v_heads, dv=layout.head_v_dim, width=layout.width,
                  z_offset=layout.z_offset, z_head_stride=layout.z_head_stride, eps=float(eps), dtype=tl_dtype(dtype))
    return StepPlan(KernelSpec.of(build_gated_norm_kernel, block_tokens=NORM_BLOCK_TOKENS, **params),
                    KernelSpec.of(build_gated_norm_bwd_kernel, block_tokens=NORM_BWD_BLOCK_TOKENS,
                                  blocks_per_sm=NORM_BWD_BLOCKS_PER_SM, **params))


@dataclass(frozen=True)
class ForwardSteps:
    """The forward kernels of step plans alone: what an inference call compiles."""

    plans: tuple

    def specs(self) -> tuple:
        return tuple(p.forward for p in self.plans)


def layer_plans(layout, conv_size: int, dtype, allow_neg_eigval: bool, norm_eps: float, grad_parts: int = 1) -> tuple:
    """Both steps' plans: what a layer's first call compiles together, with the op's kernels where
    it can (`modules/fused_mixer.py`), or on their own (`compile_layer`)."""
    return (plan_layer_inputs(layout, conv_size, tl_dtype(dtype), bool(allow_neg_eigval), grad_parts),
            plan_gated_norm(layout, tl_dtype(dtype), norm_eps))


def compile_layer(layout, conv_size: int, dtype, allow_neg_eigval: bool, norm_eps: float) -> None:
    """Both steps' kernels (forward and backward) compiled together."""
    runtime.compile_plan(*layer_plans(layout, conv_size, dtype, allow_neg_eigval, norm_eps))


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return kernel_operand(t.float())


def inputs_plan(P, layout, conv_weight, allow_neg_eigval, grad_parts=1):
    """The inputs step's plan for projection rows P. (A step compiles the kernel it launches on
    first use, unless its plan was compiled ahead.)"""
    return plan_layer_inputs(layout, conv_weight.shape[-1], tl_dtype(P.dtype), bool(allow_neg_eigval), grad_parts)


def _history(P, conv_weight, history):
    """The conv history operand: given, or zeros where none is read (positions from 0)."""
    if history is not None:
        return kernel_operand(history.to(P.dtype))
    return P.new_zeros(conv_weight.shape[-1] - 1, conv_weight.shape[0])


def _tuned(spec: KernelSpec, tuning: dict | None) -> KernelSpec:
    """spec with other kernel parameters (`tools/tune_layer.py`: block_tokens, blocks_per_sm); the
    plan's own spec without."""
    return spec.replace(**tuning) if tuning else spec


def op_inputs_forward(P, layout, conv_weight, A_log, dt_bias, positions, allow_neg_eigval=False, history=None,
                      tuning=None):
    """As `reference.layer_steps.op_inputs_forward` (P [NT, width] bf16 / fp16)."""
    spec = inputs_plan(P, layout, conv_weight, allow_neg_eigval).forward
    NT, H, HV = P.shape[0], layout.num_heads, layout.num_v_heads
    q = P.new_empty(NT, H, layout.head_k_dim)
    k = P.new_empty(NT, H, layout.head_k_dim)
    v = P.new_empty(NT, HV, layout.head_v_dim)
    g = P.new_empty(NT, HV, dtype=torch.float32)
    beta = P.new_empty(NT, HV, dtype=torch.float32)
    runtime.compile_kernel(_tuned(spec, tuning))(
        kernel_operand(P), _history(P, conv_weight, history), _fp32(conv_weight.reshape(conv_weight.shape[0], -1)),
        kernel_operand(positions),
        _fp32(A_log), _fp32(dt_bias), q, k, v, g, beta)
    return q, k, v, g, beta


def op_inputs_backward(dq, dk, dv, dg, dbeta, dz, P, layout, conv_weight, A_log, dt_bias, positions, allow_neg_eigval,
                       dP, history=None, tuning=None):
    """As `reference.layer_steps.op_inputs_backward` (dq, dk summed or as per-v-head parts, read
    and summed by the kernel)."""
    NT, H, HV = P.shape[0], layout.num_heads, layout.num_v_heads
    parts = dq.shape[1] // H
    plan = inputs_plan(P, layout, conv_weight, allow_neg_eigval, parts)
    if parts > 1:
        dq, dk = dq.view(NT, H, parts, -1), dk.view(NT, H, parts, -1)
    C, K = conv_weight.shape[0], conv_weight.shape[-1]
    spec = _tuned(plan.backward, tuning)
    blocks = -(-NT // spec.kwargs["block_tokens"])
    dweight_part = P.new_empty(blocks, C, K, dtype=torch.float32)
    # per-token terms of dA_log and d dt_bias in one buffer, so that one reduction sums both (rows
    # rounded up to 4: the second starts 16-byte aligned, as kernel operands do)
    gate_tokens = P.new_empty(2, -(-NT // 4) * 4, HV, dtype=torch.float32)[:, :NT]
    dA_log_tokens, da_tokens = gate_tokens[0], gate_tokens[1]
    dy_head = P.new_empty(K - 1, C, dtype=torch.float32)
    weight = _fp32(conv_weight.reshape(C, K))
    runtime.compile_kernel(spec)(
        kernel_operand(P), _history(P, conv_weight, history), weight, kernel_operand(positions), _fp32(A_log),
        _fp32(dt_bias), kernel_operand(dq.to(P.dtype)), kernel_operand(dk.to(P.dtype)), kernel_operand(dv.to(P.dtype)),
        _fp32(dg), _fp32(dbeta), kernel_operand(dz.reshape(NT, HV, -1).to(P.dtype)), dP, dweight_part, da_tokens,
        dA_log_tokens, dy_head)
    dweight = dweight_part.sum(0).reshape(conv_weight.shape).to(conv_weight.dtype)
    dhistory = _history_grad(dy_head, weight, positions).to(history.dtype) if history is not None else None
    dA_log, ddt_bias = gate_tokens.sum(1)
    return dweight, dA_log.to(A_log.dtype), ddt_bias.to(dt_bias.dtype), dhistory


def _history_grad(dy_head, weight, positions):
    """d history [W, C]: row h (the input W - h tokens before the first) reaches token h - j through
    tap j, where that token continues the history (positions[u] == u + W)."""
    W, C = dy_head.shape
    n = min(W, positions.shape[0])
    u = torch.arange(n, device=dy_head.device)
    continues = (positions[:n] == u + W)[:, None]
    dy = torch.cat([dy_head.new_zeros(1, C), dy_head[:n] * continues, dy_head.new_zeros(W - n, C)])  # row 0: none
    h = torch.arange(W, device=dy_head.device)[:, None]
    j = torch.arange(W + 1, device=dy_head.device)[None, :]
    rows = torch.where(h >= j, h - j + 1, 0)  # [W, K]: dy row of token h - j, or the zero row
    return torch.einsum("hjc,cj->hc", dy[rows], weight)


def gated_norm_forward(o, P, layout, weight, eps, tuning=None):
    """As `reference.layer_steps.gated_norm_forward`."""
    plan = plan_gated_norm(layout, tl_dtype(P.dtype), eps)
    y = torch.empty_like(o)
    runtime.compile_kernel(_tuned(plan.forward, tuning))(
        kernel_operand(o.to(P.dtype)), kernel_operand(P), _fp32(weight), y)
    return y.view(o.shape[0], -1)


def gated_norm_backward(dy, o, P, layout, weight, eps, tuning=None):
    """As `reference.layer_steps.gated_norm_backward`."""
    plan = plan_gated_norm(layout, tl_dtype(P.dtype), eps)
    NT = o.shape[0]
    do = torch.empty_like(o)
    dz = torch.empty(o.shape, dtype=P.dtype, device=P.device)
    spec = _tuned(plan.backward, tuning)
    dweight_part = P.new_empty(-(-NT // spec.kwargs["block_tokens"]), layout.num_v_heads, layout.head_v_dim,
                               dtype=torch.float32)
    runtime.compile_kernel(spec)(
        kernel_operand(dy.reshape(o.shape).to(P.dtype)), kernel_operand(o), kernel_operand(P), _fp32(weight), do, dz,
        dweight_part)
    return do, dz, dweight_part.sum((0, 1)).to(weight.dtype)
