"""The TileLang forward: which kernels one call runs (`plan_forward`) and their launches.

Per (chunk, v-head) the prepare kernel writes G (the chunk-local cumulative gate) and Ag (the
gated UT matrix); one fused walk per (V block, sequence or partition, v-head) then carries the
state S [K, V] from chunk to chunk in registers and writes o and the final state
(docs/algorithm.md). The walks always take packed sequences: a dense batch [B, T] runs as B
sequences of T (as in the backward). With `intra_cp` long sequences are cut into partitions first
(`kernels/split.py`). What the backward needs is returned as a `ForwardSaved`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..constants import CHUNK, WARMUP_LOG_DECAY
from ..options import DEFAULT_OPTIONS, KernelOptions
from . import runtime, split
from .hopper.common import tl_dtype
from .hopper.fwd_fused import build_fused_fwd_kernel
from .hopper.fwd_fused_ws import build_fused_fwd_ws_kernel
from .hopper.fwd_fused_ws4 import build_fused_fwd_ws4_kernel
from .hopper.prepare import build_prepare_kernel
from .hopper.split_decay_tables import build_decay_tables_kernel
from .hopper.split_summary import build_state_summary_kernel
from .runtime import KernelSpec, grid_fills_gpu, kernel_operand, state_kv_layout
from .tables import chunk_offsets, chunk_table, walk_order


@dataclass(frozen=True)
class ForwardPlan:
    """The kernels of one forward call: prepare, then the fused walk; with a split, the decay
    tables, the partition summaries and the scan in between."""

    prepare: KernelSpec
    fused: KernelSpec
    split: split.SplitSpecs | None = None

    def specs(self) -> list:
        extra = [] if self.split is None else [self.split.decay_tables, self.split.summary, self.split.scan]
        return [self.prepare, *extra, self.fused]

    @property
    def applies_norm(self) -> bool:
        """Whether the fused walk writes the gated norm's output in place of o."""
        return "gated_norm" in self.fused.kwargs


def gated_norm_key(width: int, z_offset: int, z_head_stride: int, eps: float) -> tuple:
    """The fused walk's static gated-norm parameters, as `plan_forward` and the walk's builder
    (`hopper/fwd_fused_ws4.py`) take them: the projection rows' width, z's columns, the norm's eps."""
    return (int(width), int(z_offset), int(z_head_stride), float(eps))


@dataclass(frozen=True)
class OutputNorm:
    """The layer's gated RMSNorm y = o * rsqrt(mean(o^2) + eps) * weight * silu(z), offered to the
    forward so that its fused walk applies it to o before storing it (inference: no chunk states
    kept; `hopper/fwd_fused_ws4.py`) and the layer skips the norm's own pass over o. rows: the
    projection rows P [B, T, width] (z in their columns, `reference.layer_steps.ProjectionLayout`),
    batched as q; weight [dv] fp32."""

    rows: torch.Tensor
    weight: torch.Tensor
    z_offset: int
    z_head_stride: int
    eps: float

    @property
    def key(self) -> tuple | None:
        """The walk's static norm parameters; None where TMA cannot read the rows (a row's bytes
        not a multiple of 16)."""
        width = self.rows.shape[-1]
        if (width * self.rows.element_size()) % 16:
            return None
        return gated_norm_key(width, self.z_offset, self.z_head_stride, self.eps)


def fused_walk_kernel(walks: int, HV: int, K: int, V: int, sms: int, options: KernelOptions):
    """(factory, block_v) of the fused forward for `walks` (sequences or partitions) x HV walks.

    Each block walks a whole sequence for one v-head and one V block, so with few walks narrower
    V blocks buy parallelism and a shorter per-chunk critical path. K <= 128: the four-warpgroup
    kernel with a whole 128-wide state where its grid fills the GPU, else the three-warpgroup one
    with the widest block_v whose grid does (H200: 1.1-1.5x faster than the single-warpgroup
    kernel at each shape's best tile). K > 128: the single-warpgroup kernel, whose tiles alone
    fit in shared memory (block_v <= 32).
    """
    pairs = walks * HV
    if K > 128:
        return build_fused_fwd_kernel, (32 if pairs * (V // 32) >= sms // 2 else 16)
    if options.four_warpgroups and V % 128 == 0 and grid_fills_gpu(pairs * (V // 128), sms):
        return build_fused_fwd_ws4_kernel, 128
    for block_v in (64, 32):
        if V % block_v == 0 and grid_fills_gpu(pairs * (V // block_v), sms):
            return build_fused_fwd_ws_kernel, block_v
    return build_fused_fwd_ws_kernel, 16


# Register cap and v-heads per block of the prepare kernel (`tools/tune_prepare.py`, H100,
# 2026-12-07, every variant's outputs equal to the uncapped one-v-head kernel's bit for bit): two
# v-heads of a qk-head per block (sharing the chunk's k k^T) at four blocks per SM (102 registers,
# no spills) took 0.179 ms at TP1 1 x 32k and 0.184 at 8 varlen in 32k, against 0.198 / 0.204 for
# one v-head at five blocks (the setting before); two v-heads at five blocks spill (0.197 / 0.188),
# at six lose more. One v-head per block (the form where HV / H is odd), same shapes: four blocks
# 0.194 / 0.201, uncapped 0.197 / 0.200.
PREPARE_BLOCKS_PER_SM = 4
# v-heads of one qk-head per prepare block under GVA (they share the chunk's k k^T)
PREPARE_HEADS_PER_BLOCK = 2


def prepare_heads_per_block(H: int, HV: int, wanted: int = PREPARE_HEADS_PER_BLOCK) -> int:
    """v-heads per prepare block: `wanted` where it divides the GVA group HV / H, else 1."""
    return wanted if (HV // H) % wanted == 0 else 1


def prepare_spec(H: int, HV: int, K: int, dtype: str, varlen: bool) -> KernelSpec:
    """The prepare kernel both plans launch (and `tools/tune_prepare.py` times variants of)."""
    return KernelSpec.of(build_prepare_kernel, H=H, HV=HV, K=K, dtype=dtype, is_varlen=bool(varlen),
                         blocks_per_sm=PREPARE_BLOCKS_PER_SM, heads_per_block=prepare_heads_per_block(H, HV))


@functools.lru_cache(maxsize=1024)
def plan_forward(H: int, HV: int, K: int, V: int, dtype: str, scale: float, varlen: bool, use_initial_state: bool,
                 output_final_state: bool, state_v_first: bool, walks: int, sms: int, split_seqs: int = 0,
                 save_states: bool = False, options: KernelOptions = DEFAULT_OPTIONS,
                 gated_norm: tuple | None = None) -> ForwardPlan:
    """The kernels of a forward call (cached: every call of a training loop asks the same).

    varlen: the inputs are packed (the prepare kernel's form; the walk takes packed sequences either
    way). walks: sequences, or partitions when split; split_seqs: the number of sequences when
    the call is split (0: not split). save_states: the fused walk also stores each chunk's entering state
    and v - exp(G) k S for the backward (the warp-specialised kernels, K <= 128; ignored else).
    gated_norm: `OutputNorm.key` of a norm the walk may apply to o (only the four-warpgroup
    walk with whole rows of o and no stored states does: `ForwardPlan.applies_norm`).
    """
    dtype = tl_dtype(dtype)
    prepare = prepare_spec(H, HV, K, dtype, varlen)
    factory, block_v = fused_walk_kernel(walks, HV, K, V, sms, options)
    split_specs = None
    if split_seqs:
        split_specs = split.SplitSpecs(
            decay_tables=KernelSpec.of(build_decay_tables_kernel, HV=HV, threshold=WARMUP_LOG_DECAY),
            summary=KernelSpec.of(build_state_summary_kernel, H=H, HV=HV, K=K, V=V, dtype=dtype),
            scan=split.scan_spec(HV, K, V, False, split_seqs, sms, use_s0=bool(use_initial_state)),
        )
        # the walk runs over the partitions, each entered with its scanned state
        use_initial_state, state_v_first = True, False
    extra = {"store_states": True} if save_states and factory is not build_fused_fwd_kernel else {}
    if gated_norm is not None and factory is build_fused_fwd_ws4_kernel and block_v == V and not extra:
        extra = {"gated_norm": tuple(gated_norm)}
    fused = KernelSpec.of(factory, H=H, HV=HV, K=K, V=V, dtype=dtype, scale=float(scale),
                          use_initial_state=bool(use_initial_state), store_final_state=bool(output_final_state),
                          state_v_first=bool(state_v_first), block_v=block_v, **extra)
    return ForwardPlan(prepare, fused, split_specs)


@dataclass
class SplitSaved:
    """What the split forward leaves for the backward: the partitions' tables (device copies of
    the plan), the state entering each partition (S_in [NP, HV, K, V] fp32), each partition's
    transition M [NP, HV, K, K] and the backward's warm-up walk lengths [NP, HV]."""

    part_cu: torch.Tensor
    part_chunk_table: torch.Tensor
    part_chunk_offsets: torch.Tensor
    part_order: torch.Tensor
    seq_parts: torch.Tensor
    first_parts: torch.Tensor
    S_in: torch.Tensor
    M: torch.Tensor
    dh_walk_chunks: torch.Tensor


class Spent:
    """Whether a backward has used what the forward kept: it may have written dk over vres and
    freed the other tensors' memory (`kernels/backward.py`). One object shared by every copy of a
    `ForwardSaved` (`dataclasses.replace` keeps it), so that a later backward over the same
    forward (`retain_graph`), through any copy, recomputes them instead."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = False


@dataclass
class ForwardSaved:
    """What the TileLang forward keeps for its backward (tensors contiguous, token-major).

    g_cumsum [B, T, HV] fp32 (G) and Ag [B, T, HV, 64] (row t: row t mod 64 of its chunk's Ag,
    columns past the chunk's length zero). Varlen: chunk_table [NC, 2] int32 (sequence, chunk in
    sequence), chunk_offsets [N + 1] (each sequence's first chunk; None where nothing needed it)
    and walk_order [N] (the walks' sequence order, unsplit only). With save_states: h_states
    [NC, HV, K, V] (the state entering each chunk, of the partitions when split) and vres
    [1, B * T, HV, V] (v - exp(G) k S, packed), both in the input dtype; without them the backward
    recomputes both (its h walk). They serve one backward: it marks them `spent` (and frees or
    overwrites them, G and Ag too); a second backward recomputes those four.
    """

    g_cumsum: torch.Tensor
    Ag: torch.Tensor
    chunk_table: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    walk_order: torch.Tensor | None = None
    split: SplitSaved | None = None
    h_states: torch.Tensor | None = None
    vres: torch.Tensor | None = None
    spent: Spent = field(default_factory=Spent)
    output_normed: bool = False  # o is the gated norm's output (`OutputNorm`)

    def states_kept(self) -> bool:
        """Whether the chunk states and v residuals are here for a backward to read."""
        return self.h_states is not None and self.vres is not None and not self.spent.value


def run_prepare(spec: KernelSpec, k, g, beta, cu_seqlens=None, chunk_tab=None, out=None):
    """The prepare kernel: (G fp32 [B, T, HV], Ag [B, T, HV, 64], the chunk table when varlen).
    out: (G, Ag) tensors to write instead of new ones (a check that poisons them first)."""
    B, Tn = k.shape[:2]
    HV = g.shape[2]
    g32 = kernel_operand(runtime.as_dtype(g, torch.float32))
    b32 = kernel_operand(runtime.as_dtype(beta, torch.float32))
    if out is None:
        out = (torch.empty(B, Tn, HV, dtype=torch.float32, device=k.device),
               torch.empty(B, Tn, HV, CHUNK, dtype=k.dtype, device=k.device))
    g_out, a_out = out
    kern = runtime.compile_kernel(spec)
    if cu_seqlens is not None:
        if chunk_tab is None:
            chunk_tab = chunk_table(cu_seqlens)
        if chunk_tab.shape[0] > 0:
            kern(k, g32, b32, cu_seqlens, chunk_tab, g_out, a_out)
    elif Tn > 0:
        kern(k, g32, b32, g_out, a_out)
    return g_out, a_out, chunk_tab


@dataclass(frozen=True)
class CallPlan:
    """What a forward call runs, decided on the host before anything launches: the sequences'
    host plan where their chunk tables come from the host (`tables`), the split (None: not
    split), the forward's kernels, and the plans compiled with them on first use (`companions`:
    the backward that will follow, the caller's `compile_with`)."""

    tables: split.SplitPlan | None
    split: split.SplitPlan | None
    kernels: ForwardPlan
    companions: tuple


def split_setting(intra_cp, K: int, V: int):
    """intra_cp as the TileLang forward runs it: heads past `split.SPLIT_MAX_HEAD_DIM` stay whole
    under 'auto' (the split's scan would not fit in shared memory); asked for explicitly, an error."""
    if intra_cp not in ("off", 1) and max(K, V) > split.SPLIT_MAX_HEAD_DIM:
        if intra_cp != "auto":
            raise ValueError(f"intra-card split (intra_cp={intra_cp!r}) needs head dims <= {split.SPLIT_MAX_HEAD_DIM} "
                             f"on the TileLang backend, got K={K}, V={V}; use intra_cp='auto' or 'off'")
        return "off"
    return intra_cp


def splits(intra_cp, Tn: int, N: int) -> bool:
    """Whether the forward plans a split (it may still find none worth making)."""
    return intra_cp not in ("off", 1) and Tn > 0 and N > 0


def packed_offsets(B: int, Tn: int) -> list:
    """The offsets of a dense batch [B, Tn] as B packed sequences (its walks' tables)."""
    return [b * Tn for b in range(B + 1)]


def plan_call(B, Tn, H, HV, K, V, dtype, scale, varlen: bool, N: int, cu_host, intra_cp, use_initial_state: bool,
              output_final_state: bool, state_v_first: bool, save_states: bool, options: KernelOptions, sms: int,
              backward_plan=None, compile_with=(), gated_norm: tuple | None = None) -> CallPlan:
    """The plans of a forward call from its shapes: `tilelang_forward` runs them, and a caller
    (the fused layer's first call) can compile them before it has the call's inputs.

    cu_host: the sequences' offsets on the host (list or CPU tensor), or None (varlen neither split
    nor given a host copy; a dense batch's are `packed_offsets`); intra_cp as `split_setting`
    leaves it; gated_norm as `plan_forward` takes it."""
    if torch.is_tensor(cu_host):
        cu_host = cu_host.tolist()
    if not varlen:
        cu_host = packed_offsets(B, Tn)
    tables = plan = None
    if cu_host is not None:
        plan = tables = split.plan_split(cu_host, HV, V, intra_cp if splits(intra_cp, Tn, N) else 1, sms)
    if plan is not None and plan.is_trivial:
        plan = None
    kernels = plan_forward(H, HV, K, V, dtype, float(scale), varlen, use_initial_state, output_final_state,
                           state_v_first, plan.num_parts if plan else N, sms, N if plan else 0, save_states, options,
                           gated_norm)
    store_states = kernels.fused.kwargs.get("store_states", False)
    following = backward_plan(plan.num_parts if plan else N, N if plan else 0, store_states) if backward_plan else None
    companions = tuple(compile_with(following, kernels) if callable(compile_with) else compile_with)
    if following is not None:
        companions += (following,)
    return CallPlan(tables, plan, kernels, companions)


def tilelang_forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                     state_v_first=False, intra_cp="off", cu_seqlens_host=None, save_states=False,
                     options: KernelOptions = DEFAULT_OPTIONS, backward_plan=None, compile_with=(),
                     output_norm: OutputNorm | None = None):
    """Chunked GDN forward on Hopper. q, k [B, T, H, K] bf16 / fp16; v [B, T, HV, V] of the same
    dtype; g, beta [B, T, HV]; states fp32 [N, HV, K, V] ([N, HV, V, K] with state_v_first);
    cu_seqlens [N + 1] int32 with B == 1 for packed input. intra_cp: 'off', 'auto' or an int P
    (`kernels/split.py`); cu_seqlens_host (list or CPU tensor) spares reading cu_seqlens back
    from the GPU when splitting. backward_plan(walks, split_seqs, states_saved), when given,
    names the backward plan that will follow: on first use its kernels compile together with the
    forward's, and so do those of the plans in `compile_with` (e.g. the fused layer's steps; or a
    function of that backward plan, None when not named, and the forward's `ForwardPlan`
    returning them). output_norm: a gated norm the fused walk may apply (see `OutputNorm`;
    `ForwardSaved.output_normed` tells).
    Returns (o [B, T, HV, V], final state fp32 or None, ForwardSaved)."""
    B, Tn, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v = kernel_operand(q), kernel_operand(k), kernel_operand(v)
    varlen = cu_seqlens is not None
    cu = cu_seqlens.to(torch.int32).contiguous() if varlen else None
    N = (cu.shape[0] - 1) if varlen else B

    intra_cp = split_setting(intra_cp, K, V)
    sms = runtime.sm_count(q.device)
    cu_host = None
    if varlen and (splits(intra_cp, Tn, N) or cu_seqlens_host is not None):
        # the one read-back of cu_seqlens (none when the caller passes a CPU copy: then the chunk
        # tables come from the host too, which keeps the call free of syncs, capturable in a CUDA graph)
        cu_host = cu_seqlens_host if cu_seqlens_host is not None else cu_seqlens.cpu()
    call = plan_call(B, Tn, H, HV, K, V, q.dtype, scale, varlen, N, cu_host, intra_cp, initial_state is not None,
                     output_final_state, state_v_first, save_states, options, sms, backward_plan, compile_with,
                     None if output_norm is None else output_norm.key)
    runtime.compile_plan(call.kernels, *call.companions)  # first use: every kernel of the call at once, in parallel
    kernels, plan = call.kernels, call.split
    store_states = kernels.fused.kwargs.get("store_states", False)
    seq_tab = seq_offsets = seq_order = seq_rows = None
    tabs = None
    if call.tables is not None:
        tabs = call.tables.device_tensors(q.device)  # built from the host offsets, cached with the plan
        seq_tab, seq_offsets, seq_order = tabs["seq_chunk_table"], tabs["seq_chunk_offsets"], tabs["seq_order"]
        seq_rows = tabs["seq_rows"]
    use_h0 = initial_state is not None
    # the prepare kernel takes the inputs as they are (a dense batch's own kernel: no chunk table)
    g_cum, ag, chunk_tab = run_prepare(kernels.prepare, k, g, beta, cu_seqlens=cu,
                                       chunk_tab=seq_tab if varlen else None)
    saved = ForwardSaved(g_cum, ag, chunk_tab, seq_offsets if varlen else None, output_normed=kernels.applies_norm)
    norm_args = ()
    if kernels.applies_norm:
        norm_args = (kernel_operand(output_norm.rows), kernel_operand(output_norm.weight.float()))
    if plan is not None:
        o, final = _split_forward(q, k, v, ag, g_cum, initial_state, output_final_state, state_v_first, plan,
                                  kernels, saved, store_states, norm_args)
        return o, final, saved

    sdims = (V, K) if state_v_first else (K, V)
    dev = q.device
    # without an initial state the kernel is built not to read one: a placeholder, not filled (no launch)
    h0 = kernel_operand(initial_state.float()) if use_h0 else torch.empty(1, HV, *sdims, dtype=torch.float32, device=dev)
    ht = torch.empty(N if output_final_state else 1, HV, *sdims, dtype=torch.float32, device=dev)
    o = torch.empty(1, B * Tn, HV, V, dtype=q.dtype, device=dev)
    if Tn > 0 and N > 0:
        # the walk over packed sequences: a dense batch's B rows of Tn as B sequences, with the
        # tables of its offsets (the walks' block order is then the varlen one, all v-heads of a
        # sequence together: `ordered_block`)
        qf, kf, vf, agf, gf = (packed(x) for x in (q, k, v, ag, g_cum))
        if norm_args:
            norm_args = (packed(norm_args[0]), norm_args[1])
        if not varlen:
            cu, chunk_tab = tabs["seq_cu"], seq_tab
        states = ()
        if store_states:
            if seq_offsets is None:
                seq_offsets = saved.chunk_offsets = chunk_offsets(cu)
            states = (*_state_outputs(saved, chunk_tab.shape[0], vf, K), seq_offsets)
        order = seq_order if seq_order is not None else walk_order(cu)
        if varlen:
            saved.walk_order = order
        # the rows of ht the walks write (sequence n: row n); not read without final states
        rows = order
        if output_final_state:
            rows = seq_rows if seq_rows is not None else torch.arange(N, dtype=torch.int32, device=dev)
        runtime.compile_kernel(kernels.fused)(qf, kf, vf, agf, gf, cu, order, rows, h0, o, ht, *states, *norm_args)
    elif output_final_state:
        ht.copy_(h0 if use_h0 else torch.zeros_like(ht))
    return o.reshape(B, Tn, HV, V) if B > 1 else o, (ht if output_final_state else None), saved


def packed(x):
    """x [B, T, ...] as one packed row [1, B * T, ...] (a view; B == 1 as it is: each reshape is host
    time)."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:]) if x.shape[0] > 1 else x


def _state_outputs(saved: ForwardSaved, n_chunks, v, K):
    """Allocate the chunk states and v residuals the fused kernel writes with store_states, keep
    them in `saved` for the backward and return them as kernel arguments."""
    B, Tn, HV, V = v.shape
    saved.h_states = torch.empty(n_chunks, HV, K, V, dtype=v.dtype, device=v.device)
    saved.vres = torch.empty(B, Tn, HV, V, dtype=v.dtype, device=v.device)
    return saved.h_states, saved.vres


def _split_forward(q, k, v, ag, g_cum, initial_state, output_final_state, state_v_first, plan, kernels: ForwardPlan,
                   saved: ForwardSaved, store_states: bool, norm_args=()):
    """The forward with sequences cut into partitions, after the prepare kernel: (h, M) per
    partition, the scan for each partition's entering state, then the fused walk over the
    partitions. Returns (o, final state or None) and fills saved.split. norm_args: the walk's
    gated-norm arguments (rows, weight), batched as q."""
    B, Tn, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    qf, kf, vf, agf, gf = (packed(x) for x in (q, k, v, ag, g_cum))

    idx = plan.device_tensors(dev)
    starts, dh_walk = split.decay_tables(kernels.split.decay_tables, gf, plan)
    h_part, m_part = split.state_summaries(kernels.split.summary, kf, vf, agf, gf, plan, starts)
    h0 = state_kv_layout(initial_state, state_v_first) if initial_state is not None else None
    s_in = split.scan_partitions(kernels.split.scan, m_part, h_part, idx["seq_parts"], h0)

    o = torch.empty(1, B * Tn, HV, V, dtype=q.dtype, device=dev)
    # only a sequence's last partition writes its state, into that sequence's row (`final_rows`)
    ht = torch.empty(plan.num_seqs if output_final_state else 1, HV, K, V, dtype=torch.float32, device=dev)
    states = ()
    if store_states:
        states = (*_state_outputs(saved, int(idx["part_chunk_table"].shape[0]), vf, K), idx["part_chunk_offsets"])
    if norm_args:
        norm_args = (packed(norm_args[0]), norm_args[1])
    runtime.compile_kernel(kernels.fused)(qf, kf, vf, agf, gf, idx["part_cu"], idx["part_order"], idx["final_rows"],
                                          s_in, o, ht, *states, *norm_args)
    final = state_kv_layout(ht, state_v_first) if output_final_state else None
    saved.split = SplitSaved(idx["part_cu"], idx["part_chunk_table"], idx["part_chunk_offsets"], idx["part_order"],
                             idx["seq_parts"], idx["first_parts"], s_in, m_part, dh_walk)
    return (o.reshape(B, Tn, HV, V) if B > 1 else o), final
