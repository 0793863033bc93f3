"""The GatedDeltaNet layer between its projections as one autograd.Function: projection rows P in,
gated-norm output (the input of out_proj) out.

    P [B, T, width] --op_inputs--> q, k (l2-normalised), v, g, beta --op--> o --gated_norm(z from P)--> y

Three steps, no torch autograd graph around them: the short conv + SiLU, the l2 normalisation and
the gates are one step (`op_inputs_forward`), the gated RMSNorm another; each reads its parts of P
where the projection wrote them (`ProjectionLayout`), so nothing is split, concatenated or copied
between the projection and the kernels, and the backward writes every column of one dP.

Memory: the Function keeps P, o and the parameters; the backward recomputes q, k, v, g, beta
from P (one pass over P) instead of holding them from the forward.

Steps: the Hopper kernels (`kernels/layer.py`) on the TileLang backend, their torch forms
(`reference/layer_steps.py`) on the torch backend; both compute in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels import layer as kernel_steps
from ..ops import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from ..options import KernelOptions
from ..reference import layer_steps as torch_steps
from ..reference.layer_steps import ProjectionLayout, token_positions


@dataclass(frozen=True)
class MixerConfig:
    """Everything about a fused call that is not a tensor."""

    layout: ProjectionLayout
    allow_neg_eigval: bool
    norm_eps: float
    scale: float
    backend: str  # 'torch' or 'tilelang', already chosen
    intra_cp: object  # 'auto', 'off' or partitions per sequence (the TileLang split)
    save_states: bool
    kernel_options: KernelOptions | None = None


def _steps(config: MixerConfig):
    return kernel_steps if config.backend == "tilelang" else torch_steps


class FusedMixer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, config: MixerConfig):
        B, T, width = P.shape
        lay = config.layout
        steps = _steps(config)
        rows = P.view(B * T, width)
        positions = token_positions(B, T, cu_seqlens, P.device)
        q, k, v, g, beta = steps.op_inputs_forward(rows, lay, conv_weight, A_log, dt_bias, positions,
                                                   config.allow_neg_eigval)
        o, _, gdn = chunk_gated_delta_rule_fwd(
            q.view(B, T, lay.num_heads, -1), k.view(B, T, lay.num_heads, -1), v.view(B, T, lay.num_v_heads, -1),
            g.view(B, T, -1), beta.view(B, T, -1), scale=config.scale, initial_state=initial_state,
            cu_seqlens=cu_seqlens, backend=config.backend, intra_cp=config.intra_cp, save_states=config.save_states,
            kernel_options=config.kernel_options)
        y = steps.gated_norm_forward(o.view(B * T, lay.num_v_heads, -1), rows, lay, norm_weight, config.norm_eps)
        # the op's inputs are recomputed from P in the backward (identical values), not kept
        ctx.gdn = replace(gdn, q=None, k=None, v=None, g=None, beta=None, initial_state=None)
        ctx.config = config
        ctx.save_for_backward(P, conv_weight, A_log, dt_bias, norm_weight, o, initial_state, positions)
        return y.view(B, T, -1)

    @staticmethod
    def backward(ctx, dy):
        P, conv_weight, A_log, dt_bias, norm_weight, o, initial_state, positions = ctx.saved_tensors
        config = ctx.config
        lay = config.layout
        steps = _steps(config)
        B, T, width = P.shape
        rows = P.view(B * T, width)
        dP = torch.empty_like(rows)  # the two steps' backwards write every column
        do, dnorm_weight = steps.gated_norm_backward(dy.reshape(B * T, -1), o.view(B * T, lay.num_v_heads, -1), rows,
                                                     lay, norm_weight, config.norm_eps, dP)
        q, k, v, g, beta = steps.op_inputs_forward(rows, lay, conv_weight, A_log, dt_bias, positions,
                                                   config.allow_neg_eigval)
        gdn = replace(ctx.gdn, q=q.view(B, T, lay.num_heads, -1), k=k.view(B, T, lay.num_heads, -1),
                      v=v.view(B, T, lay.num_v_heads, -1), g=g.view(B, T, -1), beta=beta.view(B, T, -1),
                      initial_state=initial_state)
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(do.view(B, T, lay.num_v_heads, -1), None, gdn)
        dconv, dA_log, ddt_bias = steps.op_inputs_backward(
            dq.reshape(B * T, lay.num_heads, -1), dk.reshape(B * T, lay.num_heads, -1),
            dv.reshape(B * T, lay.num_v_heads, -1), dg.reshape(B * T, -1), dbeta.reshape(B * T, -1), rows, lay,
            conv_weight, A_log, dt_bias, positions, config.allow_neg_eigval, dP)
        return dP.view(B, T, width), dconv, dA_log, ddt_bias, dnorm_weight, dh0, None, None


def fused_mixer(P, conv_weight, A_log, dt_bias, norm_weight, config: MixerConfig, initial_state=None,
                cu_seqlens=None) -> torch.Tensor:
    """P [B, T, width] (B == 1 with cu_seqlens) -> the gated-norm output [B, T, HV * dv]."""
    return FusedMixer.apply(P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, config)
