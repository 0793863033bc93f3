"""Dual CP: the inter-card scheme across ranks, the intra-card split inside each rank.

The inter layer only needs a local engine with a fwd/bwd contract; the intra engine keeps
that contract, so each rank's partitions are seeded by the state the inter scan delivers.
With world size 1 the inter layer makes no collective call: intra-card CP alone.
"""

from __future__ import annotations

import struct

import torch

from ..backends import choose_backend
from ..ops import backward_will_run, keep_chunk_states
from ..reference.shapes import l2norm
from ..validation import check_inputs, check_options, check_scale
from .context import CPContext, CPError, agree
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
    # every rank checks its own inputs, then all ranks exchange their verdicts (and the settings
    # that must agree) before the first collective of the call: a bad input on one rank raises
    # the same CPError on every rank instead of leaving the others waiting in the exchange
    problem = None
    try:
        _check_local_call(cp, q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
        kernel_options = check_options(kernel_options)
        check_scale(scale)
    except ValueError as exc:  # CPError is a ValueError too
        problem = str(exc)
    if cp.world > 1:
        agree(cp.group, cp.world, problem, _call_signature(q, v, scale, initial_state, output_final_state,
                                                           use_qk_l2norm_in_kernel, state_v_first, backend),
              "context-parallel GDN call", "the ranks disagree on the call's heads, dtype, scale or flags "
              "(H, HV, K, V, dtype, scale bits, flags)")
    elif problem is not None:
        raise CPError(problem)
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


def _check_local_call(cp, q, k, v, g, beta, initial_state, cu_seqlens, state_v_first):
    """This rank's inputs against the plan; raises ValueError / CPError."""
    check_inputs(q, k, v, g, beta, None, None, state_v_first)
    if q.shape[0] != 1:
        raise CPError(f"under CP the inputs are packed: B must be 1, got q of shape {tuple(q.shape)}")
    if q.shape[1] != cp.local_len:
        raise CPError(f"rank {cp.rank} holds {cp.local_len} tokens (T_global={cp.seq_len_global} / world="
                      f"{cp.world}), but q has {q.shape[1]}; pass this rank's slice (CPContext.local_slice)")
    if cu_seqlens is not None and cu_seqlens.tolist() != cp.cu_seqlens_global:
        raise CPError("cu_seqlens must be None or the global cu_seqlens the CPContext was built with")
    if initial_state is not None:
        N, HV, K, V = cp.num_seqs_global, v.shape[2], q.shape[3], v.shape[3]
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != want:
            got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state)
            raise CPError(f"initial_state must hold all {N} global sequences, {want}, got {got}")


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _call_signature(q, v, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, state_v_first,
                    backend) -> list:
    """Ints every rank's call must share (shapes of a failed rank may be anything: only compared
    when every rank passed its checks)."""
    shapes = [int(q.shape[2]), int(v.shape[2]), int(q.shape[3]), int(v.shape[3])] if (
        isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4) else [0] * 4
    dtype = _DTYPES.index(q.dtype) if isinstance(q, torch.Tensor) and q.dtype in _DTYPES else -1
    scale_bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0] if isinstance(scale, (int, float)) else 0
    flags = [initial_state is not None, output_final_state, use_qk_l2norm_in_kernel, state_v_first]
    backend_id = ("auto", "torch", "tilelang").index(backend) if backend in ("auto", "torch", "tilelang") else -1
    return [*shapes, dtype, scale_bits, sum(int(bool(f)) << i for i, f in enumerate(flags)), backend_id]
