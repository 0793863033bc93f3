"""The single-device op: `chunk_gated_delta_rule_fwd` / `chunk_gated_delta_rule_bwd` and the
autograd function that ties them together. Context parallelism sits above this module
(`parallel/`, dispatched by `api.py`) and calls down into it; nothing here imports it.

`_fwd` returns (o, final_state, ctx); `_bwd(do, dht, ctx)` returns the gradients of
(q, k, v, g, beta, initial_state).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from .backends import choose_backend
from .kernels import runtime
from .kernels.backward import plan_backward, tilelang_backward
from .kernels.forward import ForwardSaved, plan_call, split_setting, splits, tilelang_forward
from .options import DEFAULT_OPTIONS, KernelOptions
from .reference.backward import chunk_gated_delta_rule_bwd_reference
from .reference.chunked import chunk_gated_delta_rule_torch
from .reference.shapes import l2norm, l2norm_backward
from .validation import check_inputs, check_intra_cp, check_options, check_scale


@dataclass
class GDNContext:
    """What the backward needs from the forward (`_fwd`'s third result)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    scale: float
    use_qk_l2norm_in_kernel: bool
    state_v_first: bool
    backend: str
    options: KernelOptions = DEFAULT_OPTIONS
    kernel_saved: object = None  # what the TileLang forward keeps for its backward (kernels.forward.ForwardSaved)
    # the backward may return dq, dk as per-v-head parts [B, T, HV, K] (whose sums over each
    # qk-head's v-heads are dq, dk) where the TileLang kernels write them so: for a caller that
    # reads them summed (the fused layer's inputs kernel); never with use_qk_l2norm_in_kernel
    v_head_parts: bool = False
    # the forward's intra-card split setting: where kernel_saved is not at hand (a compiled call
    # that kept nothing), the TileLang backward runs the forward again with it (see `_tilelang_bwd`)
    intra_cp: object = "off"


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_v_first=False, backend="auto",
                               intra_cp="off", cu_seqlens_cpu=None, save_states=False,
                               kernel_options: KernelOptions | None = None, compile_with=(), v_head_parts=False,
                               backward_follows=False, output_norm=None):
    """Forward only (no autograd graph). Returns (o, final_state or None, ctx).

    intra_cp ('off', 'auto' or an int P) cuts long sequences into partitions inside the
    TileLang kernels (`kernels/split.py`); the torch backend ignores it here.
    save_states: the TileLang forward keeps every chunk's entering state in ctx for `_bwd`
    (see `chunk_gated_delta_rule`); leave it False when no backward follows.
    backward_follows: `chunk_gated_delta_rule_bwd` will run on ctx (implied by save_states): the
    TileLang forward's first call compiles that backward's kernels with its own (one round).
    compile_with: kernel plans the TileLang forward compiles with its own on first use (the
    fused layer's steps: one round of compilation instead of two), or a function of the backward
    plan that will follow (None where the forward does not know it) and the forward's
    `kernels.forward.ForwardPlan` returning them.
    v_head_parts: see `GDNContext`.
    output_norm: a `kernels.forward.OutputNorm` the TileLang forward may apply to o (inference:
    no backward follows); `output_normed(ctx)` says whether o is its output.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu)
    check_intra_cp(intra_cp)
    check_scale(scale)
    options = check_options(kernel_options)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    chosen = choose_backend(backend, q, v)
    ctx = GDNContext(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, state_v_first,
                     chosen, options, v_head_parts=bool(v_head_parts) and not use_qk_l2norm_in_kernel,
                     intra_cp=intra_cp)
    qn, kn = (l2norm(q), l2norm(k)) if use_qk_l2norm_in_kernel else (q, k)
    with torch.no_grad():
        if chosen == "tilelang":
            o, final_state, ctx.kernel_saved = tilelang_forward(
                qn, kn, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first=state_v_first,
                intra_cp=intra_cp, cu_seqlens_host=cu_seqlens_cpu, save_states=save_states, options=options,
                backward_plan=_training_backward_plan(q.shape, v.shape, q.dtype, q.device, scale, initial_state is not None,
                                                      options, ctx.v_head_parts, save_states or backward_follows,
                                                      output_final_state), compile_with=compile_with,
                output_norm=output_norm,
            )
        else:
            o, final_state = chunk_gated_delta_rule_torch(
                qn, kn, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first=state_v_first
            )
    return o, final_state, ctx


def output_normed(ctx: GDNContext) -> bool:
    """Whether the forward's o is the gated norm's output (it applied `output_norm`)."""
    return ctx.kernel_saved is not None and ctx.kernel_saved.output_normed


def _training_backward_plan(q_shape, v_shape, dtype, device, scale, use_initial_state: bool, options: KernelOptions,
                            v_head_parts: bool, backward_follows: bool, output_final_state: bool):
    """The plan the TileLang backward will choose after a training forward that returns no final
    state (so no final-state gradient), as a function of what the forward decides (its walks,
    split sequences, whether it keeps its chunk states): `tilelang_forward` compiles it with its
    own on first use. None where no such backward follows (backward_follows: the forward keeps
    its states or a backward is known to follow) or the forward returns a final state."""
    if not options.tilelang_backward or not backward_follows or output_final_state:
        return None
    H, K, HV, V = q_shape[2], q_shape[3], v_shape[2], v_shape[3]

    def plan(walks, split_seqs, states_saved):
        return plan_backward(H, HV, K, V, dtype, float(scale), use_initial_state, False, walks,
                             runtime.sm_count(device), split_seqs, states_saved, options, not v_head_parts)

    return plan


def tilelang_forward_plans(q_shape, v_shape, dtype, device, scale, use_initial_state: bool, output_final_state: bool,
                           num_seqs: int, cu_seqlens_cpu, intra_cp, save_states: bool, options: KernelOptions,
                           v_head_parts: bool, compile_with=(), backward_follows: bool = False,
                           gated_norm: tuple | None = None) -> tuple:
    """The kernel plans `chunk_gated_delta_rule_fwd` compiles on first use on the TileLang
    backend (its forward's, the backward's where one follows, `compile_with`'s) for a
    call of these shapes (state_v_first off; varlen: num_seqs sequences, B == 1), known before the
    call's inputs exist; () where they are not known without reading cu_seqlens back (a varlen
    split without its host copy). gated_norm: the `OutputNorm.key` the call offers."""
    B, Tn, H, K = q_shape
    HV, V = v_shape[2], v_shape[3]
    varlen = num_seqs is not None
    N = num_seqs if varlen else B
    intra_cp = split_setting(intra_cp, K, V)
    if varlen and cu_seqlens_cpu is None and splits(intra_cp, Tn, N):
        return ()
    backward = _training_backward_plan(q_shape, v_shape, dtype, device, scale, use_initial_state, options, v_head_parts,
                                       save_states or backward_follows, output_final_state)
    call = plan_call(B, Tn, H, HV, K, V, dtype, scale, varlen, N, cu_seqlens_cpu if varlen else None, intra_cp,
                     use_initial_state, output_final_state, False, save_states, options, runtime.sm_count(device),
                     backward, compile_with, gated_norm)
    return (call.kernels, *call.companions)


def _through_l2norm(ctx: GDNContext, backward):
    """backward(q, k) -> (dq, dk, ...) on the q, k the forward used: when it l2-normalised them
    (use_qk_l2norm_in_kernel), on the normalised ones, with dq, dk taken back through the
    normalisation."""
    if not ctx.use_qk_l2norm_in_kernel:
        return backward(ctx.q, ctx.k)
    dq, dk, *rest = backward(l2norm(ctx.q), l2norm(ctx.k))
    return (l2norm_backward(ctx.q, dq), l2norm_backward(ctx.k, dk), *rest)


def _torch_bwd(do, dht, ctx: GDNContext):
    """The hand-written chunked backward in torch (`reference/backward.py`: a walk for the chunk
    states, then the reverse walk; no autograd graph). The backward of the torch backend, and of
    the TileLang one with KernelOptions(tilelang_backward=False)."""
    h0, dht_kv = ctx.initial_state, dht
    if ctx.state_v_first:  # the walks take [K, V] states
        h0 = None if h0 is None else h0.transpose(-1, -2)
        dht_kv = None if dht is None else dht.transpose(-1, -2)

    def backward(q, k):
        return chunk_gated_delta_rule_bwd_reference(q, k, ctx.v, ctx.g, ctx.beta, do, scale=ctx.scale,
                                                    initial_state=h0, dht=dht_kv, cu_seqlens=ctx.cu_seqlens)

    dq, dk, dv, dg, dbeta, dh0 = _through_l2norm(ctx, backward)
    if dh0 is not None:
        dh0 = (dh0.transpose(-1, -2) if ctx.state_v_first else dh0).to(ctx.initial_state.dtype)
    return dq, dk, dv, dg, dbeta, dh0


def _tilelang_bwd(do, dht, ctx: GDNContext):
    def backward(q, k):
        q, k = q.detach(), k.detach()
        saved = ctx.kernel_saved
        if saved is None:
            # a compiled call whose forward kept nothing (save_states off, or a second backward of
            # a retained graph: `kept_states.py`): the forward runs again with its split, keeping
            # its chunk states, so that the backward walks the forward's partitions with the eager
            # call's kernels (rebuilt unsplit, one walk per head, the walks filled 32 of 132 SMs at
            # Qwen3-Next 1 x 32k: ~2 ms more per layer on an H100)
            _, _, saved = tilelang_forward(q, k, ctx.v, ctx.g, ctx.beta, ctx.scale, ctx.initial_state, False,
                                           ctx.cu_seqlens, state_v_first=ctx.state_v_first, intra_cp=ctx.intra_cp,
                                           save_states=True, options=ctx.options)
        return tilelang_backward(do, dht, q, k, ctx.v, ctx.g, ctx.beta, ctx.scale, ctx.initial_state, ctx.cu_seqlens,
                                 saved, state_v_first=ctx.state_v_first, options=ctx.options,
                                 v_head_parts=ctx.v_head_parts)

    return _through_l2norm(ctx, backward)


def chunk_gated_delta_rule_bwd(do, dht, ctx: GDNContext):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) given do and the final-state gradient dht (or None);
    dq, dk as per-v-head parts where the forward was asked for them (`GDNContext.v_head_parts`)."""
    if ctx.backend == "tilelang" and ctx.options.tilelang_backward:
        return _tilelang_bwd(do, dht, ctx)
    return _torch_bwd(do, dht, ctx)


def backward_reads_v(ctx: GDNContext) -> bool:
    """Whether `chunk_gated_delta_rule_bwd` reads ctx.v: not the TileLang backward after a forward
    that kept its chunk states (its walks read the kept v residuals instead), so a caller that
    recomputes the op's inputs for the backward may leave v out."""
    states_kept = isinstance(ctx.kernel_saved, ForwardSaved) and ctx.kernel_saved.states_kept()
    return not (ctx.backend == "tilelang" and ctx.options.tilelang_backward and states_kept)


def backward_will_run(*inputs) -> bool:
    """Whether autograd records a call on `inputs` (None entries allowed): grad mode on and some
    input needs a gradient. Kept chunk states are worth their memory only then (not under
    no_grad, e.g. the first pass of activation checkpointing)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def keep_chunk_states(save_states: bool, needs_backward: bool) -> bool:
    """Whether the forward keeps its chunk states: asked for (save_states) and a backward will
    run (the TileLang forward then stores them where its kernel can: warp-specialised, K <= 128)."""
    return bool(save_states) and needs_backward


class _TakenTensor:
    """The place of a tensor `take_tensors` took out (its index in the list)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def take_tensors(obj):
    """(skeleton, tensors) of a dataclass (`GDNContext`, `ForwardSaved`; nested dataclasses
    included; anything else passes with no tensors): its tensors, to be saved the autograd way, and a copy holding their
    places. What an autograd node holds as an attribute stays alive from the forward to the
    backward, through activation checkpointing too; saved through save_for_backward, the kept
    chunk states are what checkpointing drops after the forward and recomputes for the backward."""
    if not is_dataclass(obj):  # (another engine's context, e.g. the torch split's: held as it is)
        return obj, []
    tensors = []
    return _strip(obj, tensors), tensors


def _strip(node, tensors):
    """node with each tensor replaced by its index in `tensors` (appended to). A module function,
    not a closure: a nested function that calls itself is a reference cycle, and a cycle holding
    `tensors` would keep every kept chunk state alive until Python's cyclic GC happened to run."""
    if node is None:
        return None
    changes = {}
    for f in fields(node):
        value = getattr(node, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = _TakenTensor(len(tensors))
            tensors.append(value)
        elif is_dataclass(value):
            changes[f.name] = _strip(value, tensors)
    return replace(node, **changes)


def put_tensors(skeleton, tensors):
    """The inverse of `take_tensors`."""
    if skeleton is None or not is_dataclass(skeleton):
        return skeleton
    changes = {}
    for f in fields(skeleton):
        value = getattr(skeleton, f.name)
        if isinstance(value, _TakenTensor):
            changes[f.name] = tensors[value.index]
        elif is_dataclass(value):
            changes[f.name] = put_tensors(value, tensors)
    return replace(skeleton, **changes)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, initial_state, options):
        o, final_state, ctx = chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=initial_state, **options)
        # saved the autograd way: an input modified in place before the backward then raises, and
        # activation checkpointing drops and recomputes what the forward kept
        skeleton, kept = take_tensors(ctx.kernel_saved)
        fctx.save_for_backward(q, k, v, g, beta, initial_state, *kept)
        fctx.gdn = replace(ctx, q=None, k=None, v=None, g=None, beta=None, initial_state=None, kernel_saved=skeleton)
        return o, final_state

    @staticmethod
    def backward(fctx, do, dht):
        q, k, v, g, beta, initial_state, *kept = fctx.saved_tensors
        ctx = replace(fctx.gdn, kernel_saved=put_tensors(fctx.gdn.kernel_saved, kept))
        ctx.q, ctx.k, ctx.v, ctx.g, ctx.beta, ctx.initial_state = q, k, v, g, beta, initial_state
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(do.contiguous(), dht, ctx)
        return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None


def single_device_op(q, k, v, g, beta, initial_state=None, save_states=True, **options):
    """The op on one device, differentiable: `chunk_gated_delta_rule_fwd`'s arguments (`options`)
    with the chunk states kept only where a backward will read them; a call that needs no
    backward runs the forward alone, without autograd.Function's host cost."""
    needs_backward = backward_will_run(q, k, v, g, beta, initial_state)
    options["save_states"] = keep_chunk_states(save_states, needs_backward)
    options["backward_follows"] = needs_backward
    if not needs_backward:
        o, final_state, _ = chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=initial_state, **options)
        return o, final_state
    return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, options)
