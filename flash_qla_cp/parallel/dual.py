"""Dual CP: the inter-card scheme across ranks, the intra-card split inside each rank.

The inter layer only needs a local engine with a fwd/bwd contract; the intra engine keeps
that contract, so each rank's partitions are seeded by the state the inter scan delivers.
With world size 1 the inter layer makes no collective call: intra-card CP alone.
"""

from __future__ import annotations

from ..backends import choose_backend
from ..ops import backward_will_run, keep_chunk_states
from ..reference.shapes import l2norm
from ..validation import check_options, check_scale
from .context import CPContext, CPError
from .inter import InterCP, OpEngine
from .intra import IntraEngine


def local_engine(cp: CPContext, backend, q, v, save_states=False, kernel_options=None):
    """The per-rank engine: on the TileLang backend the intra-card split runs inside the kernels
    (exact, GPU-side scan); elsewhere the parallel.intra engine splits around the op.
    save_states: keep the forward's chunk states for the backward (TileLang)."""
    if cp.intra_cp == "off":
        return OpEngine(backend, save_states=save_states, kernel_options=kernel_options)
    if choose_backend(backend, q, v) == "tilelang":
        return OpEngine(backend, intra_cp=cp.intra_cp, save_states=save_states, kernel_options=kernel_options)
    return IntraEngine(OpEngine(backend), intra_cp=cp.intra_cp, exact=cp.intra_exact, threshold=cp.intra_threshold,
                       window=cp.intra_window)


def cp_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, cu_seqlens=None, state_v_first=False,
                              backend="auto", cp_context: CPContext | None = None, save_states=True,
                              kernel_options=None):
    """The public op under CP. q, k, v, g, beta are this rank's [1, T_global / world, ...] slice.

    initial_state: [N_global, HV, K, V] (same on every rank) or None. Returns (o local,
    final_state [N_global, ...] identical on every rank, or None). See docs/context_parallel.md
    for how gradients of the replicated initial/final states are split over ranks.
    save_states, kernel_options: as in `chunk_gated_delta_rule`.
    """
    cp = cp_context
    if not isinstance(cp, CPContext):
        raise CPError(f"cp_context must be a CPContext (CPContext.build), got {type(cp).__name__}")
    if q.dim() != 4 or q.shape[0] != 1:
        raise CPError(f"under CP the inputs are packed: B must be 1, got q of shape {tuple(q.shape)}")
    if q.shape[1] != cp.local_len:
        raise CPError(f"rank {cp.rank} holds {cp.local_len} tokens (T_global={cp.seq_len_global} / world="
                      f"{cp.world}), but q has {q.shape[1]}; pass this rank's slice (CPContext.local_slice)")
    if cu_seqlens is not None and cu_seqlens.tolist() != cp.cu_seqlens_global:
        raise CPError("cu_seqlens must be None or the global cu_seqlens the CPContext was built with")
    N = cp.num_seqs_global
    if initial_state is not None and initial_state.shape[0] != N:
        raise CPError(f"initial_state must hold all {N} global sequences, got {tuple(initial_state.shape)}")
    kernel_options = check_options(kernel_options)
    check_scale(scale)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    h0 = initial_state.transpose(-1, -2) if (state_v_first and initial_state is not None) else initial_state
    # as the plain op: the forward keeps its chunk states when a backward will need them
    keep = keep_chunk_states(save_states, backward_will_run(q, k, v, g, beta, h0))
    engine = local_engine(cp, backend, q, v, save_states=keep, kernel_options=kernel_options)
    o, final = InterCP.apply(q, k, v, g, beta, h0, cp, engine, scale, output_final_state)
    if final is not None and state_v_first:
        final = final.transpose(-1, -2)
    return o, final
