"""Public op: `chunk_gated_delta_rule` (FLA / FlashQLA-compatible) and its `_fwd` / `_bwd` halves.

`_fwd` returns (o, final_state, ctx); `_bwd(do, dht, ctx)` returns the gradients of
(q, k, v, g, beta, initial_state). `chunk_gated_delta_rule` ties them into autograd.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .backends import choose_backend
from .kernels.reference_backward import chunk_gated_delta_rule_bwd_reference
from .kernels.reference_chunked import chunk_gated_delta_rule_torch
from .kernels.shapes import l2norm
from .validation import check_inputs, is_intra_option


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
    kernel_saved: object = None  # tensors the TileLang forward keeps for its backward


def chunk_gated_delta_rule_fwd(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    state_v_first=False,
    backend="auto",
    intra_cp="off",
    cu_seqlens_cpu=None,
    save_states=False,
):
    """Forward only (no autograd graph). Returns (o, final_state or None, ctx).

    intra_cp ('off', 'auto' or an int P) cuts long sequences into partitions inside the
    TileLang kernels (`kernels/tilelang_split.py`); the torch backend ignores it here.
    save_states: the TileLang forward keeps every chunk's entering state in ctx for `_bwd`
    (see `chunk_gated_delta_rule`); leave it False when no backward follows.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu)
    if not is_intra_option(intra_cp):
        raise ValueError(f"chunk_gated_delta_rule: intra_cp must be 'auto', 'off' or a positive int, got {intra_cp!r}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    chosen = choose_backend(backend, q, v)
    ctx = GDNContext(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, state_v_first, chosen)
    qn, kn = (l2norm(q), l2norm(k)) if use_qk_l2norm_in_kernel else (q, k)
    with torch.no_grad():
        if chosen == "tilelang":
            from .kernels.tilelang_fwd import tilelang_chunk_gated_delta_rule_fwd

            o, final_state, ctx.kernel_saved = tilelang_chunk_gated_delta_rule_fwd(
                qn, kn, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first=state_v_first,
                partitions=None if intra_cp == "off" else intra_cp, cu_seqlens_host=cu_seqlens_cpu,
                save_states=save_states,
            )
        else:
            o, final_state = chunk_gated_delta_rule_torch(
                qn, kn, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first=state_v_first
            )
    return o, final_state, ctx


def _through_l2norm(ctx: GDNContext, backward):
    """backward(q, k) -> (dq, dk, ...) on the q, k the forward used: when it l2-normalised them
    (use_qk_l2norm_in_kernel), on the normalised ones, with dq, dk taken back through the
    normalisation."""
    if not ctx.use_qk_l2norm_in_kernel:
        return backward(ctx.q, ctx.k)
    with torch.enable_grad():
        q_in, k_in = ctx.q.detach().requires_grad_(True), ctx.k.detach().requires_grad_(True)
        qn, kn = l2norm(q_in), l2norm(k_in)
    dq, dk, *rest = backward(qn.detach(), kn.detach())
    dq, dk = torch.autograd.grad((qn, kn), (q_in, k_in), (dq, dk))
    return (dq, dk, *rest)


def _torch_bwd(do, dht, ctx: GDNContext):
    """The hand-written chunked backward in torch (kernels/reference_backward.py: a walk for the
    chunk states, then the reverse walk; no autograd graph). Against autograd through the chunked
    forward, which it replaced: equal to ~4e-7 in fp32, 4.7x faster on the CPU at K = V = 256,
    T = 2048, and it keeps only the chunk states. The backward of the torch backend, and of
    the TileLang one with FLASH_QLA_CP_TILELANG_BWD=0."""
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
    from .kernels.tilelang_bwd_impl import tilelang_chunk_gated_delta_rule_bwd

    def backward(q, k):
        return tilelang_chunk_gated_delta_rule_bwd(
            do, dht, q.detach(), k.detach(), ctx.v, ctx.g, ctx.beta, ctx.scale,
            ctx.initial_state, ctx.cu_seqlens, ctx.kernel_saved, state_v_first=ctx.state_v_first,
        )

    return _through_l2norm(ctx, backward)


TILELANG_BWD_ENV = "FLASH_QLA_CP_TILELANG_BWD"


def tilelang_backward_enabled() -> bool:
    """The TileLang backward runs by default on the TileLang backend; FLASH_QLA_CP_TILELANG_BWD=0
    falls back to the torch backward (`_torch_bwd`). (It was opt-in while its dg
    exceeded the 1e-2 bf16 limit on one small config with a g = 0 head; the warp-specialised dh
    walk brought every config of tests/gpu/check_bwd.py under it: dg <= 8.3e-3.)"""
    return os.environ.get(TILELANG_BWD_ENV, "1") != "0"


def chunk_gated_delta_rule_bwd(do, dht, ctx: GDNContext):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) given do and the final-state gradient dht (or None)."""
    if ctx.backend == "tilelang" and tilelang_backward_enabled():
        return _tilelang_bwd(do, dht, ctx)
    return _torch_bwd(do, dht, ctx)


def backward_will_run(*inputs) -> bool:
    """Whether autograd records a call on `inputs` (None entries allowed): grad mode on and some
    input needs a gradient. Kept chunk states are worth their memory only then (not under
    no_grad, e.g. the first pass of activation checkpointing)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def keep_chunk_states(save_states: bool, needs_backward: bool) -> bool:
    """Whether the forward keeps its chunk states: asked for (save_states) and a backward will
    run (the TileLang forward then stores them where its kernel can: warp-specialised, K <= 128)."""
    return bool(save_states) and needs_backward


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, initial_state, options):
        o, final_state, ctx = chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=initial_state, **options)
        fctx.gdn = ctx
        fctx.has_initial_state = initial_state is not None
        return o, final_state

    @staticmethod
    def backward(fctx, do, dht):
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(do.contiguous(), dht, fctx.gdn)
        return dq, dk, dv, dg, dbeta, (dh0 if fctx.has_initial_state else None), None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    state_v_first: bool = False,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    backend: str = "auto",
    cp_context=None,
    intra_cp="auto",
    save_states: bool = True,
):
    """Chunked Gated DeltaNet, differentiable. Signature compatible with FLA / FlashQLA.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (GVA).
        g: [B, T, HV] log decay (<= 0); beta: [B, T, HV].
        scale: defaults to K ** -0.5.
        initial_state: [N, HV, K, V] fp32 ([N, HV, V, K] with state_v_first).
        output_final_state: also return the final state of every sequence.
        use_qk_l2norm_in_kernel: l2-normalise q and k over K first.
        cu_seqlens: [N + 1] int offsets of packed sequences (B must be 1).
        cu_seqlens_cpu: a CPU copy of cu_seqlens (FLA's argument): the offsets are then read
            from it, never back from the GPU, so a varlen call makes no host sync and can be
            captured in a CUDA graph.
        backend: 'auto' (TileLang on Hopper, torch elsewhere), 'torch' or 'tilelang'.
        cp_context: a `flash_qla_cp.parallel.CPContext`; then q, k, v, g, beta are this rank's
            slice of the packed global batch and the call runs context-parallel (see
            docs/context_parallel.md). None: the single-device op, unchanged.
        intra_cp: intra-card CP on one device (ignored when cp_context is given). 'auto'
            (default): on the TileLang backend sequences of 4k tokens and more are cut into
            partitions of >= 2k run side by side inside the kernels (until sequences x v-heads x
            partitions about fill the SMs), forward and backward, with an exact GPU-side state scan
            (kernels/tilelang_split.py; torch backend: no split); 'off'; or an int P, partitions
            per sequence (TileLang: inside the kernels; torch: the parallel.intra engine).
        save_states: when gradients are needed, the TileLang forward keeps each 64-token
            chunk's entering state and v - exp(G) k S for the backward instead of having the
            backward recompute them (one state walk less; costs (T / 64) x HV x K x V + T x HV x V
            elements of q's dtype per call until the backward, e.g. 0.8 GB at T = 32k, HV = 32,
            K = V = 128 in bf16). False trades that memory for the recompute.

    Returns:
        (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32 or None)
    """
    if head_first:
        raise ValueError("chunk_gated_delta_rule: head_first=True is not supported; pass [B, T, H, K] tensors")
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        cu_seqlens = cu_seqlens_cpu.to(q.device)
    if cp_context is not None:
        from .parallel.dual import cp_chunk_gated_delta_rule

        return cp_chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens, state_v_first, backend, cp_context=cp_context, save_states=save_states,
        )
    if intra_cp != "off" and choose_backend(backend, q, v) != "tilelang":
        split = _intra_card_call(q, k, v, g, beta, scale, initial_state, output_final_state,
                                 use_qk_l2norm_in_kernel, cu_seqlens, state_v_first, backend, intra_cp)
        if split is not None:
            return split
    needs_backward = backward_will_run(q, k, v, g, beta, initial_state)
    options = dict(
        scale=scale,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
        backend=backend,
        intra_cp=intra_cp,
        cu_seqlens_cpu=cu_seqlens_cpu,
        save_states=keep_chunk_states(save_states, needs_backward),
    )
    if not needs_backward:  # nothing to record: the forward alone, without autograd.Function's host cost
        o, final_state, _ = chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=initial_state, **options)
        return o, final_state
    return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, options)


def _intra_card_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     cu_seqlens, state_v_first, backend, intra_cp):
    """Split on the torch backend through the parallel.intra engine, or return None when the
    plain op should run (the TileLang backend splits inside its kernels instead)."""
    if not is_intra_option(intra_cp):
        raise ValueError(f"chunk_gated_delta_rule: intra_cp must be 'auto', 'off' or a positive int, got {intra_cp!r}")
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    if intra_cp == "auto":
        return None
    from .parallel.context import CPContext
    from .parallel.dual import cp_chunk_gated_delta_rule

    B, T = q.shape[:2]
    if cu_seqlens is None:  # dense batch: the same call as B packed sequences of length T
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int64, device=q.device)
        q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    else:
        cu = cu_seqlens
    cp = CPContext.single(cu.cpu(), intra=intra_cp)
    o, final = cp_chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                         use_qk_l2norm_in_kernel, None, state_v_first, backend, cp_context=cp)
    return o.reshape(B, T, *o.shape[2:]), final
