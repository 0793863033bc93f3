"""The fused layer's two steps as autograd nodes of their own, around the public op: the path of
`GatedDeltaNet` under context parallelism, where the op (`parallel/`) is an autograd call with
collectives of its own.

    P --LayerInputs--> q, k, v, g, beta, z --op(cp_context)--> o --GatedNorm(o, z)--> y

LayerInputs runs the conv + SiLU, l2 norm and gates step (`op_inputs_forward`) with the conv
history of this rank's first sequence: the previous rank's last K - 1 conv inputs, exchanged in
its forward (and their gradient sent back in its backward). It also hands on z as a copy, so
that P has one consumer and the backward writes one dP (two would add two full-size gradients).
GatedNorm reads that z. Steps: the Hopper kernels or their torch forms, as in `fused_mixer.py`.
"""

from __future__ import annotations

import torch

from ..kernels import layer as kernel_steps
from ..parallel.conv_halo import return_halo_grad, send_halo
from ..parallel.context import CPError
from ..reference.layer_steps import layout_columns
from .fused_mixer import MixerConfig, _steps


class LayerInputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, P, conv_weight, A_log, dt_bias, positions, config: MixerConfig, cp_context):
        B, T, width = P.shape
        lay = config.layout
        W = conv_weight.shape[-1] - 1
        if T < W:
            raise CPError(f"GatedDeltaNet: {T} local tokens < conv_size - 1 = {W}")
        rows = P.view(B * T, width)
        conv_cols = layout_columns(lay, "conv", P.device)
        halo = send_halo(rows[B * T - W :, conv_cols][None], cp_context)[0]  # [W, C]
        steps = _steps(config, conv_weight.shape[-1])
        if steps is kernel_steps:  # both steps' kernels at once, on the first call
            kernel_steps.compile_layer(lay, conv_weight.shape[-1], P.dtype, config.allow_neg_eigval, config.norm_eps)
        q, k, v, g, beta = steps.op_inputs_forward(rows, lay, conv_weight, A_log, dt_bias, positions,
                                                   config.allow_neg_eigval, history=halo)
        z = rows[:, layout_columns(lay, "z", P.device)]
        ctx.config, ctx.cp_context = config, cp_context
        ctx.save_for_backward(P, conv_weight, A_log, dt_bias, positions, halo)
        H, HV = lay.num_heads, lay.num_v_heads
        return (q.view(B, T, H, -1), k.view(B, T, H, -1), v.view(B, T, HV, -1), g.view(B, T, HV),
                beta.view(B, T, HV), z)

    @staticmethod
    def backward(ctx, dq, dk, dv, dg, dbeta, dz):
        P, conv_weight, A_log, dt_bias, positions, halo = ctx.saved_tensors
        config, lay = ctx.config, ctx.config.layout
        B, T, width = P.shape
        NT, H, HV = B * T, lay.num_heads, lay.num_v_heads
        rows = P.view(NT, width)
        grads = []
        for grad, shape, dtype in ((dq, (NT, H, lay.head_k_dim), P.dtype), (dk, (NT, H, lay.head_k_dim), P.dtype),
                                   (dv, (NT, HV, lay.head_v_dim), P.dtype), (dg, (NT, HV), torch.float32),
                                   (dbeta, (NT, HV), torch.float32), (dz, (NT, HV * lay.head_v_dim), P.dtype)):
            grads.append(grad.reshape(shape) if grad is not None else torch.zeros(shape, dtype=dtype, device=P.device))
        dP = torch.empty_like(rows)  # every column written by the step (z's from dz)
        steps = _steps(config, conv_weight.shape[-1])
        dconv, dA_log, ddt_bias, dhalo = steps.op_inputs_backward(
            *grads, rows, lay, conv_weight, A_log, dt_bias, positions, config.allow_neg_eigval, dP, history=halo)
        W = halo.shape[0]
        conv_cols = layout_columns(lay, "conv", P.device)
        tail_grad = return_halo_grad(dhalo[None], ctx.cp_context)[0]  # what the next rank's conv sent back
        dP[NT - W :, conv_cols] += tail_grad.to(dP.dtype)
        return dP.view(B, T, width), dconv, dA_log, ddt_bias, None, None, None


class GatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, z, norm_weight, config: MixerConfig):
        B, T, HV, dv = o.shape
        steps = _steps(config)
        y = steps.gated_norm_forward(o.view(B * T, HV, dv), z, config.layout.z_only(), norm_weight, config.norm_eps)
        ctx.config = config
        ctx.save_for_backward(o, z, norm_weight)
        return y.view(B, T, HV * dv)

    @staticmethod
    def backward(ctx, dy):
        o, z, norm_weight = ctx.saved_tensors
        config = ctx.config
        B, T, HV, dv = o.shape
        steps = _steps(config)
        do, dz, dnorm_weight = steps.gated_norm_backward(dy.reshape(B * T, -1), o.view(B * T, HV, dv), z,
                                                         config.layout.z_only(), norm_weight, config.norm_eps)
        return do.view(o.shape), dz.view(z.shape), dnorm_weight, None
