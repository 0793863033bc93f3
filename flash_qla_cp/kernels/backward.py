"""The TileLang backward: which kernels one call runs (`plan_backward`) and their launches.

The backward walks each sequence twice (docs/algorithm.md has the per-chunk formulas):
* the h walk (forward order) writes the state entering each chunk and vres = v - exp(G) k S,
  unless the forward kept them (save_states);
* the dh walk (reverse order) carries the state gradient and writes dh, dvn, dv and dh0;
* the grad kernel forms every chunk's dq, dk, dg, dbeta from those states.
Where the walks about fill the GPU, one fused reverse walk replaces the dh walk and the grad
kernel (`hopper/bwd_fused.py`); head dims past 128 take a grad kernel that walks V in slices.
Dense inputs [B, T] run as B packed sequences. After a split forward the partitions are the
sequences: the h walk starts from the scanned states, a chunk-limited dh walk gives each
partition's own dh0, a reverse partition scan with M^T turns them into each partition's exit
gradient, and the dh walk (or the fused walk) runs with those. No atomics: bitwise deterministic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..constants import CHUNK
from ..options import DEFAULT_OPTIONS, KernelOptions
from . import runtime, split
from .forward import ForwardSaved, packed, packed_offsets, prepare_spec, run_prepare
from .hopper.bwd_dh import build_bwd_dh_kernel
from .hopper.bwd_dh_ws import build_bwd_dh_ws_kernel
from .hopper.bwd_fused import MAX_CHAIN_GROUP, build_bwd_fused_ws_kernel
from .hopper.bwd_grad import build_bwd_grad_group_kernel
from .hopper.bwd_grad_wide import build_bwd_grad_wide_kernel
from .hopper.bwd_h import build_bwd_h_kernel
from .hopper.bwd_h_ws import build_bwd_h_ws_kernel
from .hopper.common import tl_dtype
from .hopper.v_head_sum import build_v_head_sum_kernel
from .runtime import KernelSpec, as_dtype, grid_fills_gpu, kernel_operand, state_kv_layout
from .tables import chunk_offsets as chunk_offsets_of
from .tables import chunk_table, walk_order


@dataclass(frozen=True)
class BackwardPlan:
    """The kernels of one backward call, in launch order; None where the call runs none."""

    prepare: KernelSpec  # only launched when the forward's G and Ag are not at hand
    h_walk: KernelSpec | None  # None when the forward kept the chunk states
    dh_warmup: KernelSpec | None  # split: the chunk-limited dh walk (each partition's own dh0)
    exit_scan: KernelSpec | None  # split: the reverse partition scan
    dh_walk: KernelSpec | None  # None with the fused walk
    fused_walk: KernelSpec | None
    grad: KernelSpec | None  # the grad kernel (K, V <= 128) or the V-sliced one; None with the fused walk
    v_head_parts: bool  # GVA: the kernels write dq / dk once per v-head (the fused walk, the V-sliced grad)
    v_head_sum: KernelSpec | None  # sums those parts; None where the caller takes them as parts

    def specs(self) -> list:
        return [s for s in (self.h_walk, self.dh_warmup, self.exit_scan, self.dh_walk, self.fused_walk, self.grad,
                            self.v_head_sum) if s is not None]


def walk_block_v(V: int, wide: bool, split_walks: int, HV: int, sms: int) -> int:
    """V tile of the two walks. 32 for V = 128 (4 tiles: 4x more blocks than heads; the whole
    backward at 1 x 32k, H16 / HV32 on an H200: 8.03 ms against 9.27 with 64), 64 otherwise;
    32 for head dims past 128 (the dh walk fits there only at 32: 209 KB); a split backward takes
    64 while partitions x heads still fill the GPU."""
    if wide:
        return 32
    if split_walks and V % 64 == 0 and grid_fills_gpu(split_walks * HV * (V // 64), sms):
        return 64
    if V == 128:
        return 32
    return 64 if V % 64 == 0 else V


def fused_walk_wanted(walks: int, K: int, V: int, sms: int, mode: str) -> bool:
    """Whether `walks` x HV walks (`walks` sequences or partitions) take the fused walk: it runs one
    block per walk over the whole state, so it pays only once those blocks about fill the GPU
    (H200, fwd+bwd: TP1 1x32k 3.89 vs 4.37 ms three-kernel, but TP8 1x32k 2.47 vs 1.21); K or
    V past 128 never (its state would not fit in registers)."""
    if K > 128 or V > 128 or mode == "off":
        return False
    return mode == "on" or grid_fills_gpu(walks, sms)


@functools.lru_cache(maxsize=1024)
def plan_backward(H: int, HV: int, K: int, V: int, dtype: str, scale: float, use_initial_state: bool,
                  use_dht: bool, walks: int, sms: int, split_seqs: int = 0, states_saved: bool = False,
                  options: KernelOptions = DEFAULT_OPTIONS, sum_v_heads: bool = True) -> BackwardPlan:
    """The kernels of a backward call (cached). walks: sequences, or partitions when split;
    split_seqs: the number of sequences when the forward was split (0: not split);
    states_saved: the forward kept the chunk states (no h walk); sum_v_heads: False where the
    caller takes dq / dk as per-v-head parts when the kernels write them so."""
    dtype = tl_dtype(dtype)
    scale = float(scale)
    is_split = split_seqs > 0
    wide = max(K, V) > 128
    assert not (wide and is_split), "the forward does not split heads wider than 128"
    block_v = walk_block_v(V, wide, walks if is_split else 0, HV, sms)
    use_h0 = use_initial_state or is_split  # partitions enter with their scanned states
    exits = use_dht or is_split
    # the warp-specialised walks keep a two-stage ring of 64 x K tiles: K <= 128 only; the split
    # backward keeps the serial h walk (over many short partitions the ws one measured slower:
    # TP8 1x32k fwd+bwd 1.65 -> 1.90 ms)
    h_factory = build_bwd_h_ws_kernel if K <= 128 and not is_split else build_bwd_h_kernel
    dh_factory = build_bwd_dh_ws_kernel if K <= 128 else build_bwd_dh_kernel
    shape = dict(H=H, HV=HV, K=K, V=V, dtype=dtype)
    h_walk = None if states_saved else KernelSpec.of(h_factory, **shape, use_initial_state=bool(use_h0),
                                                     block_v=block_v)
    dh = KernelSpec.of(dh_factory, **shape, scale=scale, use_dht=bool(exits), store_dh0=bool(use_h0), block_v=block_v)
    dh_warmup = exit_scan = None
    if is_split:
        dh_warmup = dh.replace(use_dht=False, limit_chunks=True)
        exit_scan = split.scan_spec(HV, K, V, True, split_seqs, sms, use_s0=bool(use_dht))
    fused = fused_walk_wanted(walks * HV, K, V, sms, options.fused_walk)
    # the fused walk sums dq / dk over a qk-head's v-heads itself (its v-head chain) where the
    # caller wants them summed
    chain = bool(fused and sum_v_heads and 1 < HV // H <= MAX_CHAIN_GROUP)
    dh_walk = fused_walk = grad = None
    if fused:
        fused_walk = KernelSpec.of(build_bwd_fused_ws_kernel, **shape, scale=scale, use_dht=bool(exits),
                                   store_dh0=bool(use_h0), chain_v_heads=chain)
    else:
        dh_walk = dh
        grad_factory = build_bwd_grad_wide_kernel if wide else build_bwd_grad_group_kernel
        grad = KernelSpec.of(grad_factory, **shape, scale=scale)
    # the fused walk (without its chain) and the wide grad kernel write dq / dk per v-head
    v_head_parts = bool((fused and not chain or wide) and HV > H)
    v_head_sum = None
    if v_head_parts and sum_v_heads:
        v_head_sum = KernelSpec.of(build_v_head_sum_kernel, H=H, group=HV // H, K=K, dtype=dtype)
    prepare = prepare_spec(H, HV, K, dtype, True)
    return BackwardPlan(prepare, h_walk, dh_warmup, exit_scan, dh_walk, fused_walk, grad, v_head_parts, v_head_sum)


def empty(*shape, dtype, device):
    """Every buffer the backward allocates (one place, so that a GPU test can fill them with NaN
    and see an element no kernel writes)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _saved_tensor(t, shape):
    """A tensor the forward kept, as the packed `shape` (None when absent or of another size)."""
    if t is None or t.shape == shape:  # (no reshape: each torch call is host time)
        return t
    return t.reshape(shape) if t.numel() == torch.Size(shape).numel() else None


def tilelang_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, saved: ForwardSaved | None,
                      state_v_first=False, options: KernelOptions = DEFAULT_OPTIONS, v_head_parts=False):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of the TileLang forward.

    do [B, T, HV, V]; dht fp32 final-state gradient or None; q, k [B, T, H, K] bf16 / fp16 (the
    normalised ones if the forward normalised them); v [B, T, HV, V] (None where `saved` holds the
    chunk states: then no kernel reads it); g, beta [B, T, HV];
    initial_state fp32 or None; cu_seqlens [N + 1] (B == 1) or None; saved: the forward's
    (None: G and Ag are recomputed). States [N, HV, K, V] ([N, HV, V, K] with state_v_first).
    Gradients have their inputs' dtypes (dh0 fp32; None without an initial state).
    v_head_parts: where the kernels write dq and dk once per v-head (GVA), return those parts
    [B, T, HV, K] unsummed (the fused layer's kernel sums them as it reads them; dq and dk are
    then never allocated); else, and always where no parts are written, dq, dk [B, T, H, K].
    """
    B, Tn, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    dev, dt = q.device, q.dtype
    Ttot = B * Tn
    sms = runtime.sm_count(dev)
    split_saved = saved.split if saved is not None else None
    dense_tabs = None
    if split_saved is not None:  # the partitions are the sequences of every kernel below
        cu = split_saved.part_cu
    elif cu_seqlens is not None:
        cu = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
    else:  # a dense batch is B packed sequences of T; their tables come from the host (below),
        # the cached plan a forward of the batch with intra_cp off builds (same arguments, this GPU's SMs)
        dense_tabs = split.plan_split(packed_offsets(B, Tn), HV, V, 1, sms).device_tensors(dev)
        cu = dense_tabs["part_cu"]
    N = cu.shape[0] - 1

    def flat(x):  # packed [1, B*T, ...], as the kernels take it
        return kernel_operand(packed(x))

    qf, kf = flat(q), flat(k)
    dof = flat(as_dtype(do, dt))
    g32 = flat(as_dtype(g, torch.float32))
    b32 = flat(as_dtype(beta, torch.float32))

    user_h0 = initial_state is not None
    use_dht = dht is not None
    # Chunk bookkeeping: from the plan's device copies where the segments are known on the host
    # (split partitions, dense batches), so the backward launches nothing and does not wait for
    # the GPU here (H200, TP1 1x8k: fwd+bwd took 2.83 ms for 2.42 ms of kernel time with a sync)
    varlen_saved = saved if saved is not None and cu_seqlens is not None else None
    ctab = varlen_saved.chunk_table if varlen_saved is not None else None
    if split_saved is not None:
        ctab, chunk_offsets, order = split_saved.part_chunk_table, split_saved.part_chunk_offsets, split_saved.part_order
    elif dense_tabs is not None:
        ctab, chunk_offsets, order = (dense_tabs["seq_chunk_table"], dense_tabs["seq_chunk_offsets"],
                                      dense_tabs["seq_order"])
    else:
        ctab = ctab if ctab is not None else chunk_table(cu)
        chunk_offsets = varlen_saved.chunk_offsets if varlen_saved is not None else None
        chunk_offsets = chunk_offsets if chunk_offsets is not None else chunk_offsets_of(cu)
        order = varlen_saved.walk_order if varlen_saved is not None else None
        order = order if order is not None else walk_order(cu)  # every walk takes it
    NC = int(ctab.shape[0])

    sdims = (HV, K, V)
    # the chunk states and v residuals: from the forward when it kept them (save_states) and no
    # backward has used them yet, else recomputed by the h walk
    fresh = saved is not None and not saved.spent.value
    kept = fresh and saved.states_kept()
    h_st = _saved_tensor(saved.h_states, (NC, *sdims)) if kept else None
    vres = _saved_tensor(saved.vres, (1, Ttot, HV, V)) if kept else None
    states_saved = h_st is not None and vres is not None and h_st.dtype == dt and vres.dtype == dt
    if v is None and not states_saved:
        raise ValueError("tilelang_backward: v is needed where the forward kept no chunk states")
    plan = plan_backward(H, HV, K, V, dt, float(scale), user_h0, use_dht, N, sms,
                         len(split_saved.first_parts) if split_saved is not None else 0, states_saved, options,
                         not v_head_parts)
    runtime.compile_plan(plan)  # first use: every kernel of the call at once, in parallel

    gcum = _saved_tensor(saved.g_cumsum, (1, Ttot, HV)) if fresh else None
    ag = _saved_tensor(saved.Ag, (1, Ttot, HV, CHUNK)) if fresh else None
    if gcum is None or ag is None or ag.dtype != dt:
        gcum, ag, ctab = run_prepare(plan.prepare, kf, g32, b32, cu_seqlens=cu,
                                     chunk_tab=ctab)
    gcum = kernel_operand(as_dtype(gcum, torch.float32))
    ag = kernel_operand(ag)

    # without an initial state / exit gradient the kernels are built not to read them: a one-row
    # placeholder stands in, allocated, not filled (no launch); the h walk's h0 likewise, below
    dhtf = state_kv_layout(dht, state_v_first) if use_dht else empty(1, *sdims, dtype=torch.float32, device=dev)
    if not states_saved:
        h_st = empty(NC, *sdims, dtype=dt, device=dev)
        vres = empty(1, Ttot, HV, V, dtype=dt, device=dev)
    # dh and dvn reach memory only from the dh walk (the fused walk keeps them on chip)
    dh_st = dvn = None
    if plan.dh_walk is not None:
        dh_st = empty(NC, *sdims, dtype=dt, device=dev)
        dvn = empty(1, Ttot, HV, V, dtype=dt, device=dev)
    use_h0 = user_h0 or split_saved is not None
    dv = empty(1, Ttot, HV, V, dtype=dt, device=dev)
    dh0 = empty(N if use_h0 else 1, *sdims, dtype=torch.float32, device=dev)
    dg = empty(1, Ttot, HV, dtype=torch.float32, device=dev)
    db = empty(1, Ttot, HV, dtype=torch.float32, device=dev)

    if NC > 0:
        walk_args = (cu, chunk_offsets, order)
        if plan.h_walk is not None:  # (without an initial state the h walk is built not to read h0)
            if split_saved is not None:
                h0 = split_saved.S_in
            else:
                h0 = state_kv_layout(initial_state, state_v_first) if user_h0 else empty(
                    1, *sdims, dtype=torch.float32, device=dev)
            runtime.compile_kernel(plan.h_walk)(kf, flat(v), ag, gcum, *walk_args, h0, h_st, vres)
        exit_grad = dhtf
        if split_saved is not None:
            # the gradient reaching each partition's start from its own outputs: only its first
            # chunks matter until the gates have decayed past the fp32 resolution; this pass starts
            # from a zero exit gradient and writes dh0 only
            runtime.compile_kernel(plan.dh_warmup)(qf, kf, dof, ag, gcum, *walk_args, dhtf, dh0,
                                                   split_saved.dh_walk_chunks)
            exit_grad = split.scan_partitions(plan.exit_scan, split_saved.M.transpose(-1, -2), dh0,
                                              split_saved.seq_parts, dhtf if use_dht else None)
        parts = HV if plan.v_head_parts else H
        dq_part = empty(1, Ttot, parts, K, dtype=dt, device=dev)
        if plan.fused_walk is not None and vres.shape == dq_part.shape:
            # dk takes the v residuals' memory (at 1 x 32k, 32 v-heads: 256 MiB less at the
            # backward's peak): a block of the fused walk lands a chunk's residuals in shared
            # memory before it forms anything of that chunk, writes that chunk's dk rows after,
            # and touches no other block's (sequence, v-head) rows
            dk_part = vres
        else:
            dk_part = empty(1, Ttot, parts, K, dtype=dt, device=dev)
        if plan.fused_walk is not None:
            runtime.compile_kernel(plan.fused_walk)(qf, kf, dof, vres, ag, gcum, g32, b32, h_st, *walk_args, exit_grad,
                                                    dq_part, dk_part, dv, dg, db, dh0)
        else:
            runtime.compile_kernel(plan.dh_walk)(qf, kf, dof, ag, gcum, *walk_args, exit_grad, dh_st, dvn, dv, dh0)
            runtime.compile_kernel(plan.grad)(qf, kf, dof, vres, dvn, ag, gcum, g32, b32, h_st, dh_st, cu, ctab,
                                              dq_part, dk_part, dg, db)
        if fresh:
            _release(saved, keep=dk_part)
        del h_st, vres, ag, gcum, dh_st, dvn
        dq, dk = dq_part, dk_part
        if plan.v_head_sum is not None:
            # one at a time, contiguous (what autograd keeps as a gradient without a copy), dq's
            # parts freed before dk's sum is allocated
            del dq_part, dk_part
            dq = _sum_v_heads(plan.v_head_sum, dq, H)
            dk = _sum_v_heads(plan.v_head_sum, dk, H)
        if split_saved is not None and user_h0:
            dh0 = dh0.index_select(0, split_saved.first_parts)
    else:
        dq, dk = (torch.zeros(1, Ttot, H, K, dtype=dt, device=dev) for _ in range(2))
        for t in (dv, dg, db):
            t.zero_()
        if use_h0:
            dh0.copy_(dhtf if use_dht else torch.zeros_like(dh0))

    dg, db = as_dtype(dg, g.dtype), as_dtype(db, beta.dtype)
    if B > 1:
        dq, dk, dv = dq.reshape(B, Tn, -1, K), dk.reshape(B, Tn, -1, K), dv.reshape(B, Tn, HV, V)
        dg, db = dg.reshape(B, Tn, HV), db.reshape(B, Tn, HV)
    dh0 = state_kv_layout(dh0, state_v_first) if user_h0 else None
    return dq, dk, dv, dg, db, dh0


def _release(saved: ForwardSaved, keep: torch.Tensor):
    """Mark what the forward kept as spent and free its tensors' memory now, before the v-head sums
    and whatever the caller allocates next (the chunk states alone are 512 MiB at 1 x 32k, 32
    v-heads), except the storage `keep` (dk) lives in. Autograd still holds the tensors, emptied,
    until the backward returns; a later backward sees them spent and recomputes them."""
    saved.spent.value = True
    for t in (saved.h_states, saved.vres, saved.Ag, saved.g_cumsum):
        # (a storage torch cannot resize, e.g. one a saved-tensor hook made from foreign memory, is
        # left to autograd)
        if t is not None and t.untyped_storage().resizable() and \
                t.untyped_storage().data_ptr() != keep.untyped_storage().data_ptr():
            t.untyped_storage().resize_(0)


def _sum_v_heads(spec, parts, H):
    """[1, T, H, K]: the sums of per-v-head parts [1, T, HV, K] over each qk-head's v-heads
    (`hopper/v_head_sum.py`), contiguous."""
    _, Ttot, HV, K = parts.shape
    out = empty(1, Ttot, H, K, dtype=parts.dtype, device=parts.device)
    runtime.compile_kernel(spec)(parts.view(Ttot, H, HV // H, K), out.view(Ttot, H, K))
    return out
