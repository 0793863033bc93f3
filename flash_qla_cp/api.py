"""The public op `chunk_gated_delta_rule`: input checks, then the path that runs the call:
context parallel (`cp_context`), the torch backend's intra-card split (`intra_cp=P`), or the
single-device op (`ops.py`; the TileLang backend splits inside its kernels itself)."""

from __future__ import annotations

import torch

from .backends import choose_backend
from .library_ops import compiled_op
from .ops import single_device_op
from .options import KernelOptions
from .parallel.context import CPContext
from .parallel.dual import cp_chunk_gated_delta_rule
from .validation import check_inputs, check_intra_cp, check_options, check_tensors


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
    kernel_options: KernelOptions | None = None,
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
        cp_context: a `flash_qla_cp.CPContext`; then q, k, v, g, beta are this rank's slice of
            the packed global batch and the call runs context-parallel
            (docs/context_parallel.md). None: the single-device op.
        intra_cp: intra-card CP on one device (ignored when cp_context is given). 'auto'
            (default): on the TileLang backend long sequences are cut into partitions run side
            by side inside the kernels until sequences x v-heads x partitions about fill the
            SMs, forward and backward, with an exact GPU-side state scan (torch backend: no
            split); 'off'; or an int P, partitions per sequence (TileLang: inside the kernels;
            torch: the `parallel.intra` engine).
        save_states: when gradients are needed, the TileLang forward keeps each 64-token
            chunk's entering state and v - exp(G) k S for the backward instead of having the
            backward recompute them (one state walk less; costs (T / 64) x HV x K x V + T x HV x V
            elements of q's dtype per call until the backward, e.g. 0.8 GB at T = 32k, HV = 32,
            K = V = 128 in bf16). False trades that memory for the recompute.
        kernel_options: a `flash_qla_cp.KernelOptions` (kernel variants of the TileLang
            backend); None: the defaults.

    Returns:
        (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32 or None)
    """
    if head_first:
        raise ValueError("chunk_gated_delta_rule: head_first=True is not supported; pass [B, T, H, K] tensors")
    check_tensors(q, k, v, g, beta)
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        cu_seqlens = cu_seqlens_cpu.to(q.device)
    if cp_context is not None:
        return cp_chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens, state_v_first, backend, cp_context=cp_context, save_states=save_states,
            kernel_options=kernel_options,
        )
    check_intra_cp(intra_cp)
    if torch.compiler.is_compiling():  # traced: the torch.library custom ops
        return compiled_op(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                           use_qk_l2norm_in_kernel, state_v_first, backend, intra_cp, check_options(kernel_options),
                           save_states)
    if intra_cp not in ("off", "auto") and choose_backend(backend, q, v) != "tilelang":
        return _torch_intra_split(q, k, v, g, beta, scale, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel, cu_seqlens, state_v_first, backend, intra_cp)
    return single_device_op(
        q, k, v, g, beta, initial_state=initial_state, save_states=save_states, scale=scale,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, state_v_first=state_v_first, backend=backend, intra_cp=intra_cp,
        cu_seqlens_cpu=cu_seqlens_cpu, kernel_options=kernel_options,
    )


def _torch_intra_split(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       cu_seqlens, state_v_first, backend, intra_cp):
    """intra_cp=P on the torch backend: the call as a world-1 CP call whose engine splits every
    sequence around the op (`parallel.intra`)."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    B, T = q.shape[:2]
    if cu_seqlens is None:  # dense batch: the same call as B packed sequences of length T
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int64, device=q.device)
        q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    else:
        cu = cu_seqlens
    cp = CPContext.single(cu.cpu(), intra_cp=intra_cp)
    o, final = cp_chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                         use_qk_l2norm_in_kernel, None, state_v_first, backend, cp_context=cp)
    return o.reshape(B, T, *o.shape[2:]), final
