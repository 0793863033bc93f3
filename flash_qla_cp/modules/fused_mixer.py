"""The GatedDeltaNet layer between its projections as one autograd node: projection rows P in,
gated-norm output (the input of out_proj) out.

    P [B, T, width] --op_inputs--> q, k (l2-normalised), v, g, beta --op--> o --gated_norm(z from P)--> y

Three steps, no torch autograd graph around them: the short conv + SiLU, the l2 normalisation and
the gates are one step (`op_inputs_forward`), the gated RMSNorm another; each reads its parts of P
where the projection wrote them (`ProjectionLayout`), so nothing is split, concatenated or copied
between the projection and the kernels; the backward writes every column of one dP, allocated
after the op's backward (the inputs step's backward also copies the gated norm's dz into its z
columns), so that dP is not held through the op's backward.

Memory: the node keeps P, o and the parameters, and with save_states (the default) the op's
inputs q, k, g, beta (v too where the op's backward reads it: not after a TileLang forward that
kept its chunk states) beside the op's kept chunk states; without save_states the backward
re-forms them from P. At Qwen3-Next's 32k tokens q and k are 256 MiB, an inputs step of ~0.29 ms
(H100) when re-formed; the backward's peak holds them either way. The backward takes dq, dk as
the op's backward leaves them (per-v-head parts under GVA), summed by the inputs step's kernel.

Steps: the Hopper kernels (`kernels/layer.py`) on the TileLang backend, their torch forms
(`reference/layer_steps.py`) on the torch backend or where the kernels do not reach (a conv wider
than `kernels.layer.MAX_CONV_SIZE`); both compute in the same order.

Eager calls run an autograd.Function, which hands the TileLang forward's kept chunk states to the
backward; under torch.compile the same forward and backward run as registered custom ops
(`flash_qla_cp::gdn_layer_mixer_fwd` / `_bwd`), the states handed over through a handle
(`kept_states.py`). Where the forward kept none (save_states off, a second backward of a retained
graph) the backward runs the op's forward again for them.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, replace
from functools import partial

import torch

from .. import kept_states
from ..backends import choose_backend
from ..kernels import layer as kernel_steps
from ..kernels import runtime
from ..kernels.forward import OutputNorm
from ..ops import (GDNContext, backward_reads_v, backward_will_run, chunk_gated_delta_rule_bwd,
                   chunk_gated_delta_rule_fwd, output_normed, put_tensors, take_tensors, tilelang_forward_plans)
from ..options import DEFAULT_OPTIONS, KernelOptions
from ..reference import layer_steps as torch_steps
from ..reference.layer_steps import ProjectionLayout, layout_columns, token_positions
from ..validation import check_options
from .offsets_read_back import OffsetsReadBack
from .shared_positions import shared_token_positions
from .short_conv import last_inputs


@dataclass(frozen=True)
class MixerConfig:
    """Everything about a fused call that is not a tensor."""

    layout: ProjectionLayout
    allow_neg_eigval: bool
    norm_eps: float
    scale: float
    backend: str  # 'torch' or 'tilelang' (chosen), or 'auto' (chosen per call, under torch.compile)
    intra_cp: object  # 'auto', 'off' or partitions per sequence (the TileLang split)
    save_states: bool
    kernel_options: KernelOptions | None = None


def _resolved(config: MixerConfig, P) -> MixerConfig:
    if config.backend in ("torch", "tilelang"):
        return config
    lay = config.layout
    return replace(config, backend=choose_backend(config.backend, P[..., : lay.head_k_dim],
                                                  P[..., : lay.head_v_dim]))


def _steps(config: MixerConfig, conv_size: int = 0):
    """The step implementations: the kernels on the TileLang backend where their conv window reaches."""
    kernels_reach = conv_size <= kernel_steps.MAX_CONV_SIZE
    return kernel_steps if config.backend == "tilelang" and kernels_reach else torch_steps


def _kernel_step_plans(config: MixerConfig, conv_size: int, dtype, training: bool, backward_plan,
                       forward_plan=None) -> tuple:
    """The layer steps' kernel plans for the op's backward plan (None where the forward does not
    know it); their forward kernels alone where no backward follows (not training), without the
    gated norm's where the op's forward walk (`forward_plan`) applies it."""
    lay = config.layout
    # the inputs step's backward reads dq, dk as the op's backward leaves them: per-v-head parts
    # where its kernels write them so (GVA, the fused walk: assumed where the plan is not known)
    writes_parts = backward_plan is None or backward_plan.v_head_parts
    parts = lay.num_v_heads // lay.num_heads if writes_parts else 1
    plans = kernel_steps.layer_plans(lay, conv_size, dtype, config.allow_neg_eigval, config.norm_eps, parts)
    if training:
        return plans
    if forward_plan is not None and forward_plan.applies_norm:
        norm_plan = kernel_steps.plan_gated_norm(lay, kernel_steps.tl_dtype(dtype), config.norm_eps)
        plans = tuple(p for p in plans if p != norm_plan)
    return (kernel_steps.ForwardSteps(plans),)


def _compile_first_call(P, conv_weight, initial_state, cu_seqlens, host_offsets, output_final_state,
                        config: MixerConfig, step_plans, training: bool, backward_reruns: bool, norm_key=None):
    """A configuration's first call compiles every kernel of its fwd+bwd, the steps' and the op's,
    in one parallel round before the inputs step runs (else the inputs step's kernel compiles
    alone first, then the rest with the op: two rounds, the first ~8 s on an H100 machine).
    backward_reruns: the op's backward will run its forward again, keeping its chunk states (a
    compiled call): that forward's kernels and its backward's are in the round too. host_offsets():
    the host copy of cu_seqlens or None (read only here, on a first call); norm_key: the
    `OutputNorm.key` an inference call offers the op."""
    lay = config.layout
    if runtime.compiled(kernel_steps.inputs_plan(P, lay, conv_weight, config.allow_neg_eigval).forward):
        return
    cu_seqlens_cpu = host_offsets()
    B, T = P.shape[:2]
    shapes = ((B, T, lay.num_heads, lay.head_k_dim), (B, T, lay.num_v_heads, lay.head_v_dim), P.dtype, P.device,
              config.scale, initial_state is not None)
    num_seqs = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    options = check_options(config.kernel_options)
    # (where the backward runs the forward again, the steps' plans follow that forward's backward plan)
    op_plans = tilelang_forward_plans(*shapes, output_final_state, num_seqs, cu_seqlens_cpu, config.intra_cp,
                                      config.save_states, options, True, () if backward_reruns else step_plans,
                                      backward_follows=training and not backward_reruns, gated_norm=norm_key)
    if op_plans and backward_reruns:
        op_plans += tilelang_forward_plans(*shapes, False, num_seqs, cu_seqlens_cpu, config.intra_cp, True, options,
                                           True, step_plans)
    if op_plans:  # (with the steps' plans; else not known before the op reads cu_seqlens back: two rounds)
        runtime.compile_plan(*op_plans)


def _forward(P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, config: MixerConfig,
             cu_seqlens_cpu=None, output_final_state=False, positions=None, training=True, backward_reruns=False):
    """(y [B, T, HV * dv], o [B, T, HV, dv], the op's context without its inputs, token positions,
    the op's final states [N, HV, dk, dv] or None). cu_seqlens_cpu: the host copy of cu_seqlens, or
    an `OffsetsReadBack` still on its way (waited for once the inputs step is launched, so that the
    GPU has that work while the host waits and plans the op), or None. positions: the rows' token
    positions where the caller has them, else formed from cu_seqlens. training: a backward follows
    (a first call then compiles the backward's kernels too). backward_reruns: see
    `_compile_first_call`. Where no backward follows the op may apply the gated norm itself (its
    fused walk, `kernels.forward.OutputNorm`): o is then y."""
    pending = cu_seqlens_cpu if isinstance(cu_seqlens_cpu, OffsetsReadBack) else None

    def host_offsets():
        return pending.result() if pending is not None else cu_seqlens_cpu

    B, T, width = P.shape
    lay = config.layout
    steps = _steps(config, conv_weight.shape[-1])
    # on the first call the op compiles the steps' kernels with its own
    step_plans = (partial(_kernel_step_plans, config, conv_weight.shape[-1], P.dtype, training)
                  if steps is kernel_steps else ())
    norm = None
    if steps is kernel_steps and not training:
        norm = OutputNorm(P, norm_weight, lay.z_offset, lay.z_head_stride, config.norm_eps)
    if steps is kernel_steps:
        _compile_first_call(P, conv_weight, initial_state, cu_seqlens, host_offsets, output_final_state, config,
                            step_plans, training, backward_reruns, None if norm is None else norm.key)
    rows = P.view(B * T, width)
    if positions is None:  # (offsets not on the host yet: positions formed on the device)
        arrived = pending is None or pending.arrived()
        positions = shared_token_positions(B, T, cu_seqlens, host_offsets() if arrived else None, P.device)
    q, k, v, g, beta = steps.op_inputs_forward(rows, lay, conv_weight, A_log, dt_bias, positions,
                                               config.allow_neg_eigval)
    cu_host = host_offsets()
    o, final, gdn = chunk_gated_delta_rule_fwd(
        q.view(B, T, lay.num_heads, -1), k.view(B, T, lay.num_heads, -1), v.view(B, T, lay.num_v_heads, -1),
        g.view(B, T, -1), beta.view(B, T, -1), scale=config.scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=config.backend, intra_cp=config.intra_cp,
        save_states=config.save_states, kernel_options=config.kernel_options, cu_seqlens_cpu=cu_host,
        compile_with=() if backward_reruns else step_plans, v_head_parts=True,
        backward_follows=training and not backward_reruns, output_norm=norm)
    if output_normed(gdn):
        y = o
    else:
        y = steps.gated_norm_forward(o.view(B * T, lay.num_v_heads, -1), rows, lay, norm_weight, config.norm_eps)
    if training and config.save_states:  # kept for the backward, with the chunk states (v where it reads v)
        gdn = replace(gdn, v=gdn.v if backward_reads_v(gdn) else None, initial_state=None)
    else:  # recomputed from P in the backward (identical values)
        gdn = replace(gdn, q=None, k=None, v=None, g=None, beta=None, initial_state=None)
    return y.view(B, T, -1), o, gdn, positions, final


def _backward(dy, P, conv_weight, A_log, dt_bias, norm_weight, o, initial_state, positions, gdn: GDNContext,
              config: MixerConfig):
    """(dP, d conv_weight, d A_log, d dt_bias, d norm_weight, d initial_state or None)."""
    lay = config.layout
    steps = _steps(config, conv_weight.shape[-1])
    B, T, width = P.shape
    rows = P.view(B * T, width)
    do, dz, dnorm_weight = steps.gated_norm_backward(dy.reshape(B * T, -1), o.view(B * T, lay.num_v_heads, -1), rows,
                                                     lay, norm_weight, config.norm_eps)
    if gdn.q is None:  # not kept by the forward (nor its chunk states): re-formed from P
        q, k, v, g, beta = steps.op_inputs_forward(rows, lay, conv_weight, A_log, dt_bias, positions,
                                                   config.allow_neg_eigval)
        gdn = replace(gdn, q=q.view(B, T, lay.num_heads, -1), k=k.view(B, T, lay.num_heads, -1),
                      v=v.view(B, T, lay.num_v_heads, -1), g=g.view(B, T, -1), beta=beta.view(B, T, -1))
        del q, k, v, g, beta
    gdn = replace(gdn, initial_state=initial_state)
    # dq, dk may come as per-v-head parts (GDNContext.v_head_parts), summed by the inputs step
    dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(do.view(B, T, lay.num_v_heads, -1), None, gdn)
    del gdn, do
    # dP (P's size) is allocated only now, after the op's backward and its buffers: holding it
    # through them would set the layer's peak memory; dz (a third of it) waits instead, and the
    # inputs step writes it into dP's z columns
    dP = torch.empty_like(rows)  # the inputs step writes every column
    dconv, dA_log, ddt_bias, _ = steps.op_inputs_backward(
        dq.reshape(B * T, -1, lay.head_k_dim), dk.reshape(B * T, -1, lay.head_k_dim),
        dv.reshape(B * T, lay.num_v_heads, -1), dg.reshape(B * T, -1), dbeta.reshape(B * T, -1), dz, rows, lay,
        conv_weight, A_log, dt_bias, positions, config.allow_neg_eigval, dP)
    return dP.view(B, T, width), dconv, dA_log, ddt_bias, dnorm_weight, dh0


class FusedMixer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, config: MixerConfig,
                cu_seqlens_cpu):
        config = _resolved(config, P)
        y, o, gdn, positions, _ = _forward(P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens,
                                           config, cu_seqlens_cpu)
        ctx.config = config
        # what the op's context keeps (its inputs, chunk states) saved the autograd way too
        # (activation checkpointing drops them)
        ctx.gdn, kept = take_tensors(gdn)
        ctx.save_for_backward(P, conv_weight, A_log, dt_bias, norm_weight, o, initial_state, positions, *kept)
        return y

    @staticmethod
    def backward(ctx, dy):
        P, conv_weight, A_log, dt_bias, norm_weight, o, initial_state, positions, *kept = ctx.saved_tensors
        gdn = put_tensors(ctx.gdn, kept)
        grads = _backward(dy, P, conv_weight, A_log, dt_bias, norm_weight, o, initial_state, positions, gdn,
                          ctx.config)
        return (*grads, None, None, None)


# ---- the same under torch.compile: custom ops with tensors and plain values only ---------------


def _op_config(layout, allow_neg_eigval, norm_eps, scale, backend, intra_cp, save_states, P) -> MixerConfig:
    intra = intra_cp if intra_cp in ("auto", "off") else int(intra_cp)
    return _resolved(MixerConfig(ProjectionLayout(*layout), allow_neg_eigval, norm_eps, scale, backend, intra,
                                 save_states), P)


@torch.library.custom_op("flash_qla_cp::gdn_layer_mixer_fwd", mutates_args=(),
                         tags=kept_states.HOST_WORK_TAGS)
def mixer_fwd(P: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              norm_weight: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
              layout: list[int], allow_neg_eigval: bool, norm_eps: float, scale: float, backend: str, intra_cp: str,
              training: bool, save_states: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, o, the handle of what the backward takes: the op's context and the token positions);
    o only where training (an empty tensor else: nothing reads it, and the op's walk may have
    written y in its place)."""
    keep = training and save_states
    config = _op_config(layout, allow_neg_eigval, norm_eps, scale, backend, intra_cp, keep, P)
    # (training without kept states: the backward runs the op's forward again, whose kernels compile
    # now too. The offsets are read back once here, as the op would, without waiting for the graph's
    # projection to finish first: `_forward` waits for them after launching the inputs step)
    y, o, gdn, positions, _ = _forward(P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, config,
                                       None if cu_seqlens is None else OffsetsReadBack.of(cu_seqlens), training=training,
                                       backward_reruns=training and not keep)
    # (on the torch backend the op keeps nothing: its backward recomputes from the inputs)
    handle = kept_states.file((gdn, positions)) if keep and gdn.kernel_saved is not None else kept_states.nothing()
    return y, o if training else P.new_empty(0), handle


@mixer_fwd.register_fake
def _(P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, layout, allow_neg_eigval, norm_eps,
      scale, backend, intra_cp, training, save_states):
    lay = ProjectionLayout(*layout)
    B, T, _ = P.shape
    o = P.new_empty(B, T, lay.num_v_heads, lay.head_v_dim) if training else P.new_empty(0)
    return P.new_empty(B, T, lay.num_v_heads * lay.head_v_dim), o, kept_states.fake_handle()


@torch.library.custom_op("flash_qla_cp::gdn_layer_mixer_bwd", mutates_args=(),
                         tags=kept_states.HOST_WORK_TAGS)
def mixer_bwd(dy: torch.Tensor, handle: torch.Tensor, P: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor, norm_weight: torch.Tensor, o: torch.Tensor, initial_state: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None, layout: list[int], allow_neg_eigval: bool, norm_eps: float, scale: float,
              backend: str, intra_cp: str) -> list[torch.Tensor]:
    config = _op_config(layout, allow_neg_eigval, norm_eps, scale, backend, intra_cp, False, P)
    B, T, _ = P.shape
    kept = kept_states.take(handle)
    if kept is not None:
        gdn, positions = kept
    else:  # nothing kept from the forward: the op's backward runs its forward again (with the same split)
        gdn = GDNContext(None, None, None, None, None, None, cu_seqlens, scale, False, False, config.backend,
                         DEFAULT_OPTIONS, v_head_parts=True, intra_cp=config.intra_cp)
        positions = token_positions(B, T, cu_seqlens, P.device)
    grads = _backward(dy.contiguous(), P, conv_weight, A_log, dt_bias, norm_weight, o, initial_state, positions, gdn,
                      config)
    dh0 = grads[-1]
    return [*grads[:-1], dh0 if dh0 is not None else P.new_empty(0)]


@mixer_bwd.register_fake
def _(dy, handle, P, conv_weight, A_log, dt_bias, norm_weight, o, initial_state, cu_seqlens, layout, allow_neg_eigval,
      norm_eps, scale, backend, intra_cp):
    dh0 = initial_state.new_empty(initial_state.shape) if initial_state is not None else P.new_empty(0)
    return [P.new_empty(P.shape), conv_weight.new_empty(conv_weight.shape), A_log.new_empty(A_log.shape),
            dt_bias.new_empty(dt_bias.shape), norm_weight.new_empty(norm_weight.shape), dh0]


def _setup_context(ctx, inputs, output):
    P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, *values, _training, _save_states = inputs
    ctx.save_for_backward(P, conv_weight, A_log, dt_bias, norm_weight, output[1], initial_state, cu_seqlens, output[2])
    ctx.values = values


def _op_backward(ctx, dy, _do, _dhandle):
    P, conv_weight, A_log, dt_bias, norm_weight, o, initial_state, cu_seqlens, handle = ctx.saved_tensors
    dP, dconv, dA_log, ddt_bias, dnorm, dh0 = mixer_bwd(dy, handle, P, conv_weight, A_log, dt_bias, norm_weight, o,
                                                        initial_state, cu_seqlens, *ctx.values)
    return (dP, dconv, dA_log, ddt_bias, dnorm, dh0 if initial_state is not None else None, *([None] * 9))


mixer_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def fused_mixer(P, conv_weight, A_log, dt_bias, norm_weight, config: MixerConfig, initial_state=None,
                cu_seqlens=None, cu_seqlens_cpu=None, positions=None) -> torch.Tensor:
    """P [B, T, width] (B == 1 with cu_seqlens) -> the gated-norm output [B, T, HV * dv].
    cu_seqlens_cpu: a CPU copy of cu_seqlens, so that the op does not read it back from the GPU;
    positions: the rows' token positions where the caller has them (inference; `history_rows.py`)."""
    if torch.compiler.is_compiling():  # (whether a backward follows is known when the call is traced)
        y, _, _ = mixer_fwd(P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens,
                            list(astuple(config.layout)), config.allow_neg_eigval, float(config.norm_eps),
                            float(config.scale), config.backend, str(config.intra_cp),
                            backward_will_run(P, conv_weight, A_log, dt_bias, norm_weight, initial_state),
                            bool(config.save_states))
        return y
    if not backward_will_run(P, conv_weight, A_log, dt_bias, norm_weight, initial_state):
        # inference: the forward alone, keeping nothing for a backward
        config = _resolved(replace(config, save_states=False), P)
        return _forward(P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, config,
                        cu_seqlens_cpu, positions=positions, training=False)[0]
    return FusedMixer.apply(P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, config,
                            cu_seqlens_cpu)


def fused_mixer_with_states(P, conv_weight, A_log, dt_bias, norm_weight, config: MixerConfig, initial_state=None,
                            cu_seqlens=None, cu_seqlens_cpu=None, positions=None, last_rows=None):
    """Inference (no backward) that also returns what a cache carries on, e.g. a prompt's prefill:
    (y [B, T, HV * dv], the op's final states [N, HV, dk, dv], the conv states [N, C, K - 1]: the
    last K - 1 conv inputs of each sequence, 0 before its start, read from P's rows).
    positions, last_rows: where the caller has them (`history_rows.py`), the rows' token positions
    and each sequence's last K - 1 rows [N, K - 1] (every sequence then has that many)."""
    config = _resolved(replace(config, save_states=False), P)
    y, _, _, _, final = _forward(P, conv_weight, A_log, dt_bias, norm_weight, initial_state, cu_seqlens, config,
                                 cu_seqlens_cpu, output_final_state=True, positions=positions, training=False)
    conv_cols = layout_columns(config.layout, "conv", P.device)
    if last_rows is None:
        conv_state = last_inputs(P, cu_seqlens, conv_weight.shape[-1] - 1)[:, conv_cols]
    else:
        conv_state = P.reshape(-1, P.shape[-1])[last_rows][:, :, conv_cols].transpose(1, 2)
    return y, final, conv_state
