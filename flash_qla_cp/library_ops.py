"""The single-device op registered with torch.library, so that torch.compile traces a model that
calls it without a graph break: a forward and a backward custom op, each with a fake (shape-only)
implementation, tied together with register_autograd.

Used when the call is being compiled (`api.chunk_gated_delta_rule`); eager calls keep the
autograd.Function of `ops.py`. The TileLang forward's kept chunk states reach the backward through
a handle (`kept_states.py`: a custom op returns only tensors of a fixed schema); where none were
kept (save_states off, or a second backward) the backward runs the forward again for them.
"""

from __future__ import annotations

import torch

from . import kept_states
from .backends import choose_backend
from .ops import GDNContext, backward_will_run, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd, \
    tilelang_forward_plans
from .options import KernelOptions
from .reference.chunked import compute_dtype


def _state_shape(q, v, cu_seqlens, state_v_first):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


def _intra(intra_cp: str):
    return intra_cp if intra_cp in ("auto", "off") else int(intra_cp)


@torch.library.custom_op("flash_qla_cp::chunk_gated_delta_rule_fwd", mutates_args=(),
                         tags=kept_states.HOST_WORK_TAGS)
def gdn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float,
            output_final_state: bool, use_qk_l2norm_in_kernel: bool, state_v_first: bool, backend: str,
            intra_cp: str, fused_walk: str, four_warpgroups: bool, tilelang_backward: bool, training: bool,
            save_states: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, final state or an empty tensor, the handle of what the backward takes)."""
    options = KernelOptions(fused_walk, four_warpgroups, tilelang_backward)
    # the offsets read back once here, as the TileLang forward would: its plans are then known
    cu_host = cu_seqlens.cpu() if cu_seqlens is not None else None
    keep = training and save_states
    # a backward that finds no kept states runs this forward again keeping them (`ops._tilelang_bwd`):
    # that forward's kernels and its backward's compile with this one's on first use
    rerun = ()
    if training and not keep and not state_v_first and options.tilelang_backward \
            and choose_backend(backend, q, v) == "tilelang":
        rerun = tilelang_forward_plans(q.shape, v.shape, q.dtype, q.device, scale, initial_state is not None, False,
                                       None if cu_seqlens is None else cu_seqlens.shape[0] - 1, cu_host,
                                       _intra(intra_cp), True, options, False)
    o, final, ctx = chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
        backend=backend, intra_cp=_intra(intra_cp), cu_seqlens_cpu=cu_host, save_states=keep, kernel_options=options,
        compile_with=rerun)
    handle = kept_states.file(ctx.kernel_saved) if keep and ctx.kernel_saved is not None else kept_states.nothing()
    # a custom op returns tensors only: no final state is an empty one
    return o, final if final is not None else q.new_empty(0, dtype=compute_dtype(q)), handle


@gdn_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm_in_kernel,
      state_v_first, backend, intra_cp, fused_walk, four_warpgroups, tilelang_backward, training, save_states):
    o = v.new_empty(v.shape)
    shape = _state_shape(q, v, cu_seqlens, state_v_first) if output_final_state else (0,)
    return o, q.new_empty(shape, dtype=compute_dtype(q)), kept_states.fake_handle()


@torch.library.custom_op("flash_qla_cp::chunk_gated_delta_rule_bwd", mutates_args=(),
                         tags=kept_states.HOST_WORK_TAGS)
def gdn_bwd(do: torch.Tensor, dht: torch.Tensor | None, handle: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
            cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool, state_v_first: bool,
            backend: str, intra_cp: str, fused_walk: str, four_warpgroups: bool, tilelang_backward: bool
            ) -> list[torch.Tensor]:
    options = KernelOptions(fused_walk, four_warpgroups, tilelang_backward)
    # the forward's kept chunk states, if it kept them (else kernel_saved None: the TileLang backward
    # runs the forward again)
    ctx = GDNContext(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, state_v_first,
                     choose_backend(backend, q, v), options, kernel_saved=kept_states.take(handle),
                     intra_cp=_intra(intra_cp))
    dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(do.contiguous(), dht, ctx)
    return [dq, dk, dv, dg, dbeta, dh0 if dh0 is not None else q.new_empty(0, dtype=compute_dtype(q))]


@gdn_bwd.register_fake
def _(do, dht, handle, q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel, state_v_first,
      backend, intra_cp, fused_walk, four_warpgroups, tilelang_backward):
    dh0 = initial_state.new_empty(initial_state.shape) if initial_state is not None else q.new_empty(
        0, dtype=compute_dtype(q))
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), dh0]


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, l2norm, v_first, backend, intra_cp, \
        fused_walk, four_warpgroups, tilelang_backward, _training, _save_states = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, output[2])
    ctx.options = (scale, l2norm, v_first, backend, intra_cp, fused_walk, four_warpgroups, tilelang_backward)
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dfinal, _dhandle):
    q, k, v, g, beta, initial_state, cu_seqlens, handle = ctx.saved_tensors
    dht = dfinal if ctx.output_final_state else None
    dq, dk, dv, dg, dbeta, dh0 = gdn_bwd(do, dht, handle, q, k, v, g, beta, initial_state, cu_seqlens, *ctx.options)
    return (dq, dk, dv, dg, dbeta, dh0 if initial_state is not None else None, *([None] * 12))


gdn_fwd.register_autograd(_backward, setup_context=_setup_context)


def compiled_op(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, backend, intra_cp, options: KernelOptions, save_states: bool = True):
    """The op through the registered custom ops: (o, final state or None). save_states: as in
    `api.chunk_gated_delta_rule` (off: the backward runs the forward again)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, final, _ = gdn_fwd(q, k, v, g, beta, initial_state, cu_seqlens, float(scale), output_final_state,
                          use_qk_l2norm_in_kernel, state_v_first, backend, str(intra_cp), options.fused_walk,
                          options.four_warpgroups, options.tilelang_backward,
                          backward_will_run(q, k, v, g, beta, initial_state), bool(save_states))  # (known when traced)
    return o, (final if output_final_state else None)
