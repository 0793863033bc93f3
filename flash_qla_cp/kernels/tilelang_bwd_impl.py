"""TileLang Hopper (sm_90a) backward kernels for chunked Gated DeltaNet (implementation).

`flash_qla_cp.ops` calls `tilelang_chunk_gated_delta_rule_bwd` for the TileLang backend unless
FLASH_QLA_CP_TILELANG_BWD=0 (then it uses the autograd backward of the torch chunked path). Importing this module touches no GPU and compiles nothing:
TileLang is imported when a kernel is first built.

SPEC (backward side; the forward's SPEC is at the top of `tilelang_fwd.py`)
=========================================================================
Input from the forward (`saved`, optional): `g_cumsum` [B,T,HV] fp32 (chunk-local cumsum G)
and `Ag` [B,T,HV,64] (Ag = Tm diag(beta), Tm = (I + A)^-1). When `saved` lacks them the
backward runs the forward's prepare kernel (`tilelang_fwd.prepare_fwd`) itself.
Dense inputs [B,T] are handled as packed sequences (cu_seqlens = 0, T, 2T, ...), so every
kernel below takes cu_seqlens and a chunk table; nothing else differs. After a split forward
(`saved["split"]`) the partitions are those sequences: the h walk starts from the scanned
states S_in, the dh walk runs once with zero exit gradients, a reverse partition scan with M^T
turns its dh0 into each partition's exit gradient, and the dh walk runs again with those.

Per chunk (length L <= 64; padding rows carry q = k = v = beta = 0 and repeat G[L-1]),
with S the state entering the chunk, dS' the gradient of the state leaving it,
E = diag(exp G), Gam_ij = exp(G_i - G_j), GL = G[L-1]:
    vres = v - E k S                       (so v_new = Ag vres)
    P    = scale * tril_incl(q k^T o Gam)
    dvn  = P^T dO + diag(exp(GL - G)) k dS'          (gradient of v_new)
    dv   = Ag^T dvn =: t
    dS   = exp(GL) dS' + (scale E q)^T dO - (E k)^T t
    dAg  = tril_incl(dvn vres^T)
    BdA  = -Ag^T dAg Ag^T   (strict lower; = diag(beta) dA for the gated A)
    dq   = scale E dO S^T + (tril_incl(dO v_new^T o Gam) scale) k
    dk   = -E t S^T + diag(exp(GL - G)) v_new dS'^T + Pm^T q + (BdA o Gam) k + (BdA o Gam)^T k
    dG   = row terms (see kernel 3), dg = reverse cumsum of dG inside the chunk
    dbeta_i = (rowsum(BdA o kk^T o Gam)_i + colsum(dAg o Ag)_i) / beta_i
(the division is exact in relative terms because Ag's column j carries the factor beta_j;
a beta of exactly 0 gets dbeta 0).

Kernels (all take packed [1, Ttot, ...] tensors, cu_seqlens [N+1] int32):
(BV = 32 for V = 128, else 64: see `default_block_v`.)
* `build_bwd_h_kernel`   grid (V/BV, N, HV), 128 threads: walks each sequence forward,
  S[K, BV] fp32 in registers; writes h [NC, HV, K, V] (state entering each chunk, input
  dtype) and vres [1, Ttot, HV, V].
* `build_bwd_dh_kernel`  grid (V/BV, N, HV), 128 threads: walks each sequence backward with
  dS[K, BV] fp32 in registers; writes dh [NC, HV, K, V] (gradient of the state leaving each
  chunk), dvn, dv and dh0.
* `build_bwd_grad_group_kernel` grid (NC, H), 256 threads (the default): one chunk and one
  qk-head per block, walking its HV/H v-heads in order; dq, dk accumulate on chip and are
  written once in the input dtype; dg (already reverse-cumsummed) and dbeta in fp32.
The two walks take the sequences in the order of an int32 [N] table (`walk_order`: longest first,
so that a long sequence does not start last) and their chunk offsets [N+1].
The two walks also exist warp-specialised, with the same contracts (`tilelang_bwd_h_ws.py`,
`tilelang_bwd_dh_ws.py`: TMA loader warp, and for dh a second warpgroup for the parts that do
not depend on dS); `DEFAULT_H_KERNEL` / `DEFAULT_DH_KERNEL` choose.
No atomics anywhere: the result is bitwise deterministic.
"""

import functools

import torch

from . import tilelang_common
from .tilelang_common import (CHUNK, chunk_table, compile_kernel, grid_fills_gpu, import_tilelang, kernel_operand,
                              ordered_block, state_kv_layout, switched_globals, tl_dtype, walk_order)
from .tilelang_common import chunk_offsets as chunk_offsets_of
from .chunk_grads_torch import chunk_grads_from_states
from .tilelang_bwd_fused_ws import build_bwd_fused_ws_kernel
from .tilelang_bwd_chunk_terms import chunk_terms
from .tilelang_bwd_grad_wide import build_bwd_grad_wide_kernel
from .tilelang_fwd import prepare_fwd
from .tilelang_split import plan_split, scan_partitions
from .tilelang_v_head_sum import build_v_head_sum_kernel

LOG2E = 1.4426950408889634

__all__ = [
    "build_bwd_h_kernel",
    "build_bwd_dh_kernel",
    "build_bwd_grad_group_kernel",
    "bwd_kernel_specs",
    "tilelang_chunk_gated_delta_rule_bwd",
    "torch_prepare",
]


# ----------------------------------------------------------------------------------------
# Kernel 1: recompute the chunk states h and vres = v - exp(G) k S.
# ----------------------------------------------------------------------------------------
def build_bwd_h_kernel(H: int, HV: int, K: int, V: int, dtype: str, use_initial_state: bool,
                       block_v: int = 64, threads: int = 128):
    """Forward walk over the chunks of each sequence (grid V/BV x N x HV)."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    BV = block_v
    assert HV % H == 0 and V % BV == 0 and BV % 16 == 0
    NV = V // BV

    @T.macro
    def load_full(k, v, ag, gc, k_s, v_s, a_s, g_s, t0, bh, bhv, v0):
        T.copy(k[0, t0 : t0 + C, bh, :], k_s)
        T.copy(v[0, t0 : t0 + C, bhv, v0 : v0 + BV], v_s)
        T.copy(ag[0, t0 : t0 + C, bhv, :], a_s)
        for i in T.Parallel(C):
            g_s[i] = gc[0, t0 + i, bhv]

    @T.macro
    def load_partial(k, v, ag, gc, k_s, v_s, a_s, g_s, t0, L, bh, bhv, v0):
        for i, d in T.Parallel(C, K):
            k_s[i, d] = T.if_then_else(i < L, k[0, t0 + T.min(i, L - 1), bh, d], T.cast(0, dtype))
        for i, d in T.Parallel(C, BV):
            v_s[i, d] = T.if_then_else(i < L, v[0, t0 + T.min(i, L - 1), bhv, v0 + d], T.cast(0, dtype))
        for i, d in T.Parallel(C, C):
            a_s[i, d] = T.if_then_else(i < L, ag[0, t0 + T.min(i, L - 1), bhv, d], T.cast(0, dtype))
        for i in T.Parallel(C):
            g_s[i] = gc[0, t0 + T.min(i, L - 1), bhv]

    @T.macro
    def step(h_out, vres_out, k_s, v_s, a_s, g_s, h_s, vr_s, vn_s, s_f, x_f, vn_f, glast, cidx, t0, L, bhv, v0,
             full):
        T.copy(s_f, h_s)
        T.copy(h_s, h_out[cidx, bhv, :, v0 : v0 + BV])
        T.gemm(k_s, h_s, x_f, clear_accum=True)
        # loads, masks and shared stores in loops of their own (the elementwise rule, tilelang_common)
        for i, d in T.Parallel(C, BV):
            x_f[i, d] = v_s[i, d] - T.exp2(g_s[i] * LOG2E) * x_f[i, d]
        T.copy(x_f, vr_s)
        if full:
            T.copy(vr_s, vres_out[0, t0 : t0 + C, bhv, v0 : v0 + BV])
        else:
            for i, d in T.Parallel(C, BV):
                if i < L:
                    vres_out[0, t0 + i, bhv, v0 + d] = vr_s[i, d]
        T.gemm(a_s, vr_s, vn_f, clear_accum=True)
        glast = g_s[C - 1]
        for i, d in T.Parallel(C, BV):
            vn_f[i, d] = vn_f[i, d] * T.exp2((glast - g_s[i]) * LOG2E)
        for i, d in T.Parallel(C, BV):
            vn_f[i, d] = T.if_then_else(i < L, vn_f[i, d], T.float32(0))
        T.copy(vn_f, vn_s)
        for i, d in T.Parallel(K, BV):
            s_f[i, d] = s_f[i, d] * T.exp2(glast * LOG2E)
        T.gemm(k_s, vn_s, s_f, transpose_A=True)

    @T.macro
    def walk(k, v, ag, gc, cu_seqlens, chunk_offsets, h0, h_out, vres_out, bv, n, bhv):
        bh = bhv // grp
        v0 = bv * BV
        s0 = cu_seqlens[n]
        seq_len = cu_seqlens[n + 1] - s0
        c_first = chunk_offsets[n]

        k_s = T.alloc_shared((C, K), dtype)
        v_s = T.alloc_shared((C, BV), dtype)
        a_s = T.alloc_shared((C, C), dtype)
        g_s = T.alloc_shared((C,), acc)
        h_s = T.alloc_shared((K, BV), dtype)
        vr_s = T.alloc_shared((C, BV), dtype)
        vn_s = T.alloc_shared((C, BV), dtype)

        s_f = T.alloc_fragment((K, BV), acc)
        x_f = T.alloc_fragment((C, BV), acc)
        vn_f = T.alloc_fragment((C, BV), acc)
        glast = T.alloc_var(acc)

        if use_initial_state:
            T.copy(h0[n, bhv, :, v0 : v0 + BV], s_f)
        else:
            T.clear(s_f)

        for c in T.serial(T.ceildiv(seq_len, C)):
            t0 = s0 + c * C
            L = T.min(seq_len - c * C, C)
            if L == C:
                load_full(k, v, ag, gc, k_s, v_s, a_s, g_s, t0, bh, bhv, v0)
                step(h_out, vres_out, k_s, v_s, a_s, g_s, h_s, vr_s, vn_s, s_f, x_f, vn_f, glast,
                     c_first + c, t0, C, bhv, v0, True)
            else:
                load_partial(k, v, ag, gc, k_s, v_s, a_s, g_s, t0, L, bh, bhv, v0)
                step(h_out, vres_out, k_s, v_s, a_s, g_s, h_s, vr_s, vn_s, s_f, x_f, vn_f, glast,
                     c_first + c, t0, L, bhv, v0, False)

    return bwd_h_entry(walk, H, HV, K, V, dtype, NV, threads)


def bwd_h_entry(walk, H, HV, K, V, dtype, NV, threads):
    """PrimFunc `gdn_bwd_h` (the h walk's argument list, grid (NV, N, HV)) around `walk`, a
    T.macro (k, v, ag, gc, cu_seqlens, chunk_offsets, h0, h_out, vres_out, bv, n, bhv).
    Shared by the serial and the warp-specialised (`tilelang_bwd_h_ws.py`) kernels. Like the dh
    walk's, its grid starts the sequences of `order` ([N] int32, `walk_order`) in turn."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    Ttot = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N1 = T.dynamic("num_seqs_plus_one")
    NS = T.dynamic("num_seqs")
    N0 = T.dynamic("n_h0")

    @T.prim_func
    def gdn_bwd_h(
        k: T.Tensor((1, Ttot, H, K), dtype),
        v: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        order: T.Tensor((NS,), "int32"),
        h0: T.Tensor((N0, HV, K, V), acc),
        h_out: T.Tensor((NC, HV, K, V), dtype),
        vres_out: T.Tensor((1, Ttot, HV, V), dtype),
    ):
        with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
            n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)  # longest sequences first
            walk(k, v, ag, gc, cu_seqlens, chunk_offsets, h0, h_out, vres_out, bv, n, bhv)

    return gdn_bwd_h


# ----------------------------------------------------------------------------------------
# Kernel 2: the reverse recurrence of the state gradient; writes dh, dvn, dv and dh0.
# ----------------------------------------------------------------------------------------
def build_bwd_dh_kernel(H: int, HV: int, K: int, V: int, dtype: str, scale: float, use_dht: bool,
                        store_dh0: bool, block_v: int = 64, threads: int = 128, limit_chunks: bool = False):
    """Backward walk over the chunks of each sequence (grid V/BV x N x HV). limit_chunks: the
    kernel takes walk_chunks [N, HV] int32 and walks only the first walk_chunks[n, h] chunks of
    sequence n (the split backward's warm-up pass, see `bwd_dh_entry`)."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    BV = block_v
    assert HV % H == 0 and V % BV == 0 and BV % 16 == 0
    NV = V // BV
    scale = float(scale)

    @T.macro
    def load_full(q, k, do, ag, gc, q_s, k_s, do_s, a_s, g_s, t0, bh, bhv, v0):
        T.copy(q[0, t0 : t0 + C, bh, :], q_s)
        T.copy(k[0, t0 : t0 + C, bh, :], k_s)
        T.copy(do[0, t0 : t0 + C, bhv, v0 : v0 + BV], do_s)
        T.copy(ag[0, t0 : t0 + C, bhv, :], a_s)
        for i in T.Parallel(C):
            g_s[i] = gc[0, t0 + i, bhv]

    @T.macro
    def load_partial(q, k, do, ag, gc, q_s, k_s, do_s, a_s, g_s, t0, L, bh, bhv, v0):
        for i, d in T.Parallel(C, K):
            q_s[i, d] = T.if_then_else(i < L, q[0, t0 + T.min(i, L - 1), bh, d], T.cast(0, dtype))
            k_s[i, d] = T.if_then_else(i < L, k[0, t0 + T.min(i, L - 1), bh, d], T.cast(0, dtype))
        for i, d in T.Parallel(C, BV):
            do_s[i, d] = T.if_then_else(i < L, do[0, t0 + T.min(i, L - 1), bhv, v0 + d], T.cast(0, dtype))
        for i, d in T.Parallel(C, C):
            a_s[i, d] = T.if_then_else(i < L, ag[0, t0 + T.min(i, L - 1), bhv, d], T.cast(0, dtype))
        for i in T.Parallel(C):
            g_s[i] = gc[0, t0 + T.min(i, L - 1), bhv]

    @T.macro
    def step(dh_out, dvn_out, dv_out, q_s, k_s, do_s, a_s, g_s, qe_s, ke_s, kd_s, p_s, dh_s, dvn_s, tn_s,
             ds_f, p_f, dvn_f, t_f, glast, cidx, t0, L, bhv, v0, full):
        # dh of this chunk = gradient of the state leaving it (the limited walk only wants dh0)
        T.copy(ds_f, dh_s)
        if not limit_chunks:
            T.copy(dh_s, dh_out[cidx, bhv, :, v0 : v0 + BV])

        glast = g_s[C - 1]
        T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(C, C):
            p_s[i, j] = T.if_then_else(
                i >= j, p_f[i, j] * T.exp2((g_s[i] - g_s[j]) * LOG2E) * scale, T.float32(0)
            )
        for i, d in T.Parallel(C, K):
            qe_s[i, d] = q_s[i, d] * (T.exp2(g_s[i] * LOG2E) * scale)
            ke_s[i, d] = k_s[i, d] * T.exp2(g_s[i] * LOG2E)
            kd_s[i, d] = k_s[i, d] * T.exp2((glast - g_s[i]) * LOG2E)

        # dvn = P^T dO + kd dS'
        T.gemm(p_s, do_s, dvn_f, transpose_A=True, clear_accum=True)
        T.gemm(kd_s, dh_s, dvn_f)
        T.copy(dvn_f, dvn_s)
        # dv = Ag^T dvn
        T.gemm(a_s, dvn_s, t_f, transpose_A=True, clear_accum=True)
        for i, d in T.Parallel(C, BV):
            tn_s[i, d] = -t_f[i, d]
        if not limit_chunks:
            if full:
                T.copy(dvn_s, dvn_out[0, t0 : t0 + C, bhv, v0 : v0 + BV])
                T.copy(t_f, dv_out[0, t0 : t0 + C, bhv, v0 : v0 + BV])
            else:
                for i, d in T.Parallel(C, BV):
                    if i < L:
                        dvn_out[0, t0 + i, bhv, v0 + d] = dvn_s[i, d]
                        dv_out[0, t0 + i, bhv, v0 + d] = -tn_s[i, d]
        # dS = exp(GL) dS' + (scale E q)^T dO - (E k)^T t
        for i, d in T.Parallel(K, BV):
            ds_f[i, d] = ds_f[i, d] * T.exp2(glast * LOG2E)
        T.gemm(qe_s, do_s, ds_f, transpose_A=True)
        T.gemm(ke_s, tn_s, ds_f, transpose_A=True)

    @T.macro
    def walk(q, k, do, ag, gc, cu_seqlens, chunk_offsets, dht, dh_out, dvn_out, dv_out, dh0, walk_chunks, bv, n,
             bhv):
        bh = bhv // grp
        v0 = bv * BV
        s0 = cu_seqlens[n]
        seq_len = cu_seqlens[n + 1] - s0
        c_first = chunk_offsets[n]
        n_chunks = walked_chunks(T, T.ceildiv(seq_len, C), walk_chunks, n, bhv, limit_chunks)

        q_s = T.alloc_shared((C, K), dtype)
        k_s = T.alloc_shared((C, K), dtype)
        do_s = T.alloc_shared((C, BV), dtype)
        a_s = T.alloc_shared((C, C), dtype)
        g_s = T.alloc_shared((C,), acc)
        qe_s = T.alloc_shared((C, K), dtype)
        ke_s = T.alloc_shared((C, K), dtype)
        kd_s = T.alloc_shared((C, K), dtype)
        p_s = T.alloc_shared((C, C), dtype)
        dh_s = T.alloc_shared((K, BV), dtype)
        dvn_s = T.alloc_shared((C, BV), dtype)
        tn_s = T.alloc_shared((C, BV), dtype)

        ds_f = T.alloc_fragment((K, BV), acc)
        p_f = T.alloc_fragment((C, C), acc)
        dvn_f = T.alloc_fragment((C, BV), acc)
        t_f = T.alloc_fragment((C, BV), acc)
        glast = T.alloc_var(acc)

        if use_dht:
            T.copy(dht[n, bhv, :, v0 : v0 + BV], ds_f)
        else:
            T.clear(ds_f)

        for cc in T.serial(n_chunks):
            c = n_chunks - 1 - cc
            t0 = s0 + c * C
            L = T.min(seq_len - c * C, C)
            if L == C:
                load_full(q, k, do, ag, gc, q_s, k_s, do_s, a_s, g_s, t0, bh, bhv, v0)
                step(dh_out, dvn_out, dv_out, q_s, k_s, do_s, a_s, g_s, qe_s, ke_s, kd_s, p_s, dh_s,
                     dvn_s, tn_s, ds_f, p_f, dvn_f, t_f, glast, c_first + c, t0, C, bhv, v0, True)
            else:
                load_partial(q, k, do, ag, gc, q_s, k_s, do_s, a_s, g_s, t0, L, bh, bhv, v0)
                step(dh_out, dvn_out, dv_out, q_s, k_s, do_s, a_s, g_s, qe_s, ke_s, kd_s, p_s, dh_s,
                     dvn_s, tn_s, ds_f, p_f, dvn_f, t_f, glast, c_first + c, t0, L, bhv, v0, False)

        if store_dh0:
            T.copy(ds_f, dh0[n, bhv, :, v0 : v0 + BV])

    return bwd_dh_entry(walk, H, HV, K, V, dtype, NV, threads, limit_chunks)


def walked_chunks(T, n_chunks, walk_chunks, n, bhv, limit_chunks: bool):
    """The dh walk's chunk count: all `n_chunks`, or at most walk_chunks[n, bhv]."""
    return T.min(n_chunks, walk_chunks[n, bhv]) if limit_chunks else n_chunks


def bwd_dh_entry(walk, H, HV, K, V, dtype, NV, threads, limit_chunks=False):
    """PrimFunc `gdn_bwd_dh` (the dh walk's argument list, grid (NV, N, HV)) around `walk`, a
    T.macro (q, k, do, ag, gc, cu_seqlens, chunk_offsets, dht, dh_out, dvn_out, dv_out, dh0,
    walk_chunks, bv, n, bhv). Shared by the serial and the warp-specialised
    (`tilelang_bwd_dh_ws.py`) kernels. With limit_chunks the PrimFunc takes one more argument,
    walk_chunks [N, HV] int32 (the walk covers only the first walk_chunks[n, h] chunks of
    sequence n, from a zero or given exit gradient there) and writes only dh0: it has no dh_out /
    dvn_out / dv_out arguments (`walk` gets None for them and must not store them); else `walk`
    gets dh0 in walk_chunks' place and must not read it."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    Ttot = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N1 = T.dynamic("num_seqs_plus_one")
    NS = T.dynamic("num_seqs")
    NT = T.dynamic("n_dht")
    N0 = T.dynamic("n_dh0")

    if not limit_chunks:
        @T.prim_func
        def gdn_bwd_dh(
            q: T.Tensor((1, Ttot, H, K), dtype),
            k: T.Tensor((1, Ttot, H, K), dtype),
            do: T.Tensor((1, Ttot, HV, V), dtype),
            ag: T.Tensor((1, Ttot, HV, C), dtype),
            gc: T.Tensor((1, Ttot, HV), acc),
            cu_seqlens: T.Tensor((N1,), "int32"),
            chunk_offsets: T.Tensor((N1,), "int32"),
            order: T.Tensor((NS,), "int32"),
            dht: T.Tensor((NT, HV, K, V), acc),
            dh_out: T.Tensor((NC, HV, K, V), dtype),
            dvn_out: T.Tensor((1, Ttot, HV, V), dtype),
            dv_out: T.Tensor((1, Ttot, HV, V), dtype),
            dh0: T.Tensor((N0, HV, K, V), acc),
        ):
            with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
                n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)  # longest sequences first
                walk(q, k, do, ag, gc, cu_seqlens, chunk_offsets, dht, dh_out, dvn_out, dv_out, dh0, dh0, bv, n,
                     bhv)

        return gdn_bwd_dh

    NW = T.dynamic("n_walk")

    @T.prim_func
    def gdn_bwd_dh_limited(
        q: T.Tensor((1, Ttot, H, K), dtype),
        k: T.Tensor((1, Ttot, H, K), dtype),
        do: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        order: T.Tensor((NS,), "int32"),
        dht: T.Tensor((NT, HV, K, V), acc),
        dh0: T.Tensor((N0, HV, K, V), acc),
        walk_chunks: T.Tensor((NW, HV), "int32"),
    ):
        with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
            n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)  # longest sequences first
            walk(q, k, do, ag, gc, cu_seqlens, chunk_offsets, dht, None, None, None, dh0, walk_chunks, bv, n, bhv)

    return gdn_bwd_dh_limited


# ----------------------------------------------------------------------------------------
# Kernel 3: all per-chunk gradients (dq, dk, dg, dbeta). One block walks the HV/H v-heads of
# one qk-head in order and accumulates dq, dk on chip (q, k read once; dq, dk written once, in
# the input dtype).
# ----------------------------------------------------------------------------------------
def build_bwd_grad_group_kernel(H: int, HV: int, K: int, V: int, dtype: str, scale: float, threads: int = 256):
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    assert HV % H == 0 and K % 16 == 0 and V % 16 == 0
    scale = float(scale)
    RS = 32  # rows per slice of the <S, dS'> reduction
    assert K % RS == 0
    dag_terms, dkk_terms, pm_terms, store_dg_dbeta = chunk_terms(T, scale)

    Ttot = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N1 = T.dynamic("num_seqs_plus_one")

    @T.prim_func
    def gdn_bwd_grad_group(
        q: T.Tensor((1, Ttot, H, K), dtype),
        k: T.Tensor((1, Ttot, H, K), dtype),
        do: T.Tensor((1, Ttot, HV, V), dtype),
        vres: T.Tensor((1, Ttot, HV, V), dtype),
        dvn: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        beta: T.Tensor((1, Ttot, HV), acc),
        h: T.Tensor((NC, HV, K, V), dtype),
        dh: T.Tensor((NC, HV, K, V), dtype),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_tab: T.Tensor((NC, 2), "int32"),
        dq_out: T.Tensor((1, Ttot, H, K), dtype),
        dk_out: T.Tensor((1, Ttot, H, K), dtype),
        dg_out: T.Tensor((1, Ttot, HV), acc),
        db_out: T.Tensor((1, Ttot, HV), acc),
    ):
        with T.Kernel(NC, H, threads=threads) as (bc, bh):
            n = chunk_tab[bc, 0]
            t0 = cu_seqlens[n] + chunk_tab[bc, 1] * C
            L = T.min(cu_seqlens[n + 1] - t0, C)

            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            do_s = T.alloc_shared((C, V), dtype)
            vr_s = T.alloc_shared((C, V), dtype)
            dvn_s = T.alloc_shared((C, V), dtype)
            a_s = T.alloc_shared((C, C), dtype)
            h_s = T.alloc_shared((K, V), dtype)
            dh_s = T.alloc_shared((K, V), dtype)
            vn_s = T.alloc_shared((C, V), dtype)
            tn_s = T.alloc_shared((C, V), dtype)
            m1_s = T.alloc_shared((C, C), dtype)  # dAg, later Pm
            m2_s = T.alloc_shared((C, C), dtype)  # dAg Ag^T, later dKK
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            r_q = T.alloc_shared((C,), acc)
            r_kw = T.alloc_shared((C,), acc)
            r_kd = T.alloc_shared((C,), acc)
            r_1r = T.alloc_shared((C,), acc)
            r_1c = T.alloc_shared((C,), acc)
            r_2r = T.alloc_shared((C,), acc)
            r_2c = T.alloc_shared((C,), acc)
            r_ab = T.alloc_shared((C,), acc)
            dg_s = T.alloc_shared((C,), acc)
            sc_s = T.alloc_shared((2,), acc)

            cv_f = T.alloc_fragment((C, V), acc)
            cc_f = T.alloc_fragment((C, C), acc)
            kk_f = T.alloc_fragment((C, C), acc)  # k k^T and q k^T: per qk-head, shared by its v-heads
            qk_f = T.alloc_fragment((C, C), acc)
            cc2_f = T.alloc_fragment((C, C), acc)
            x_f = T.alloc_fragment((C, C), acc)
            dq_f = T.alloc_fragment((C, K), acc)
            dk_f = T.alloc_fragment((C, K), acc)
            tmp_f = T.alloc_fragment((C, K), acc)
            hd_f = T.alloc_fragment((RS, V), acc)
            row_f = T.alloc_fragment((C,), acc)
            col_f = T.alloc_fragment((C,), acc)
            hrow_f = T.alloc_fragment((RS,), acc)
            one_f = T.alloc_fragment((1,), acc)
            glast = T.alloc_var(acc)
            # whole chunks: one warp issues all of a step's TMA loads at once, the block waits
            # once (a copy-and-wait per tile left each latency exposed: one block fills the SM)
            qk_ready = T.alloc_barrier(arrive_count=32)
            tiles_ready = T.alloc_barrier(arrive_count=32)
            tx = T.get_thread_binding()

            if L == C:
                if tx < 32:
                    T.tma_copy(q[0, t0 : t0 + C, bh, :], q_s, barrier=qk_ready)
                    T.tma_copy(k[0, t0 : t0 + C, bh, :], k_s, barrier=qk_ready)
                    T.barrier_arrive(qk_ready)
                T.barrier_wait(qk_ready, 0)
            else:
                for i, d in T.Parallel(C, K):
                    q_s[i, d] = T.if_then_else(i < L, q[0, t0 + T.min(i, L - 1), bh, d], T.cast(0, dtype))
                    k_s[i, d] = T.if_then_else(i < L, k[0, t0 + T.min(i, L - 1), bh, d], T.cast(0, dtype))
            T.clear(dq_f)
            T.clear(dk_f)
            T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
            T.gemm(q_s, k_s, qk_f, transpose_B=True, clear_accum=True)

            for j in T.serial(grp):
                bhv = bh * grp + j
                if L == C:
                    T.sync_threads()  # every thread is done with the previous v-head's tiles
                    if tx < 32:
                        T.tma_copy(h[bc, bhv, :, :], h_s, barrier=tiles_ready)
                        T.tma_copy(dh[bc, bhv, :, :], dh_s, barrier=tiles_ready)
                        T.tma_copy(do[0, t0 : t0 + C, bhv, :], do_s, barrier=tiles_ready)
                        T.tma_copy(vres[0, t0 : t0 + C, bhv, :], vr_s, barrier=tiles_ready)
                        T.tma_copy(dvn[0, t0 : t0 + C, bhv, :], dvn_s, barrier=tiles_ready)
                        T.tma_copy(ag[0, t0 : t0 + C, bhv, :], a_s, barrier=tiles_ready)
                        T.barrier_arrive(tiles_ready)
                else:
                    T.copy(h[bc, bhv, :, :], h_s)
                    T.copy(dh[bc, bhv, :, :], dh_s)
                    for i, d in T.Parallel(C, V):
                        do_s[i, d] = T.if_then_else(i < L, do[0, t0 + T.min(i, L - 1), bhv, d], T.cast(0, dtype))
                        vr_s[i, d] = T.if_then_else(i < L, vres[0, t0 + T.min(i, L - 1), bhv, d], T.cast(0, dtype))
                        dvn_s[i, d] = T.if_then_else(i < L, dvn[0, t0 + T.min(i, L - 1), bhv, d], T.cast(0, dtype))
                    for i, d in T.Parallel(C, C):
                        a_s[i, d] = T.if_then_else(i < L, ag[0, t0 + T.min(i, L - 1), bhv, d], T.cast(0, dtype))
                for i in T.Parallel(C):
                    g_s[i] = gc[0, t0 + T.min(i, L - 1), bhv]
                    b_s[i] = T.if_then_else(i < L, beta[0, t0 + T.min(i, L - 1), bhv], T.float32(0))
                if L == C:
                    T.barrier_wait(tiles_ready, j % 2)
                glast = g_s[C - 1]

                # exp(GL) <S, dS'>
                T.clear(hd_f)
                for sl in T.serial(K // RS):
                    for i, d in T.Parallel(RS, V):
                        hd_f[i, d] += T.cast(h_s[sl * RS + i, d], acc) * T.cast(dh_s[sl * RS + i, d], acc)
                T.reduce_sum(hd_f, hrow_f, dim=1)
                T.reduce_sum(hrow_f, one_f, dim=0)
                sc_s[0] = one_f[0] * T.exp2(glast * LOG2E)

                # v_new = Ag vres
                T.gemm(a_s, vr_s, cv_f, clear_accum=True)
                T.copy(cv_f, vn_s)
                # dAg = tril_incl(dvn vres^T); colsum(dAg o Ag) feeds dbeta
                T.gemm(dvn_s, vr_s, cc_f, transpose_B=True, clear_accum=True)
                dag_terms(cc_f, x_f, a_s, m1_s, col_f, r_ab)
                # t = Ag^T dvn (= dv); keep -t
                T.gemm(a_s, dvn_s, cv_f, transpose_A=True, clear_accum=True)
                for i, d in T.Parallel(C, V):
                    cv_f[i, d] = -cv_f[i, d]
                T.copy(cv_f, tn_s)
                # dKK = -(Ag^T (dAg Ag^T)) gated, strictly lower
                dkk_terms(cc_f, cc2_f, x_f, kk_f, a_s, m1_s, m2_s, g_s, row_f, col_f, r_2r, r_2c)
                # Pm = scale tril_incl(dO v_new^T o Gam)
                T.gemm(do_s, vn_s, cc2_f, transpose_B=True, clear_accum=True)
                pm_terms(cc2_f, x_f, qk_f, g_s, m1_s, row_f, col_f, r_1r, r_1c)

                # dq += scale E dO S^T + Pm k
                T.gemm(do_s, h_s, tmp_f, transpose_B=True, clear_accum=True)
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = tmp_f[i, d] * (T.exp2(g_s[i] * LOG2E) * scale)
                    dq_f[i, d] = dq_f[i, d] + tmp_f[i, d]
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = tmp_f[i, d] * q_s[i, d]
                T.reduce_sum(tmp_f, row_f, dim=1)
                T.copy(row_f, r_q)
                T.gemm(m1_s, k_s, dq_f)

                # dk += -E t S^T + exp(GL - G) v_new dS'^T + Pm^T q + dKK k + dKK^T k
                T.gemm(tn_s, h_s, tmp_f, transpose_B=True, clear_accum=True)
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = tmp_f[i, d] * T.exp2(g_s[i] * LOG2E)
                    dk_f[i, d] = dk_f[i, d] + tmp_f[i, d]
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = tmp_f[i, d] * k_s[i, d]
                T.reduce_sum(tmp_f, row_f, dim=1)
                T.copy(row_f, r_kw)
                T.gemm(vn_s, dh_s, tmp_f, transpose_B=True, clear_accum=True)
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = tmp_f[i, d] * T.exp2((glast - g_s[i]) * LOG2E)
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = T.if_then_else(i < L, tmp_f[i, d], T.float32(0))
                    dk_f[i, d] = dk_f[i, d] + tmp_f[i, d]
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = tmp_f[i, d] * k_s[i, d]
                T.reduce_sum(tmp_f, row_f, dim=1)
                T.copy(row_f, r_kd)
                T.reduce_sum(row_f, one_f, dim=0)
                sc_s[1] = one_f[0]
                T.gemm(m1_s, q_s, dk_f, transpose_A=True)
                T.gemm(m2_s, k_s, dk_f)
                T.gemm(m2_s, k_s, dk_f, transpose_A=True)

                store_dg_dbeta(r_q, r_kw, r_kd, r_1r, r_1c, r_2r, r_2c, r_ab, sc_s, dg_s, b_s, dg_out, db_out, t0, bhv,
                               L)

            if L == C:
                T.copy(dq_f, dq_out[0, t0 : t0 + C, bh, :])
                T.copy(dk_f, dk_out[0, t0 : t0 + C, bh, :])
            else:
                for i, d in T.Parallel(C, K):
                    if i < L:
                        dq_out[0, t0 + i, bh, d] = dq_f[i, d]
                        dk_out[0, t0 + i, bh, d] = dk_f[i, d]

    return gdn_bwd_grad_group


# ----------------------------------------------------------------------------------------
# Python side
# ----------------------------------------------------------------------------------------


def default_block_v(V: int) -> int:
    """V tile of the two recurrent kernels: 32 for V = 128 (4 tiles -> 4x more blocks than heads;
    8.03 ms vs 9.27 ms with 64 for the whole backward at 1 x 32k, H16/HV32 on an H200), else 64."""
    if V == 128:
        return 32
    return 64 if V % 64 == 0 else V


# Which h and dh walks the backward runs: "ws" (tilelang_bwd_h_ws.py / tilelang_bwd_dh_ws.py:
# warp-specialised, TMA-fed) or "serial" (build_bwd_h_kernel / build_bwd_dh_kernel above, one
# warpgroup). Each pair has one contract. Both ws walks pass every case of
# tests/gpu/check_bwd.py (tests/gpu/results/check_bwd_ws_h_h200.json). H200: the ws h walk
# takes 1.19 ms instead of 1.58 at TP1 1 x 32k (whole sequences), but over the split
# backward's many short partitions (TP8 1 x 32k, 32 x 16 chunks) fwd+bwd went 1.65 -> 1.90 ms
# with it, so the split backward keeps the serial h walk (SPLIT_H_KERNEL).
WALK_KERNELS = ("serial", "ws")
DEFAULT_H_KERNEL = "ws"
SPLIT_H_KERNEL = "serial"
DEFAULT_DH_KERNEL = "ws"


def _walk_choice(name, value):
    if value not in WALK_KERNELS:
        raise ValueError(f"{name} must be one of {WALK_KERNELS}, got {value!r}")
    return value


def bwd_kernel_specs(H, HV, K, V, dtype, scale, use_initial_state, use_dht, block_v=None, dh_kernel=None,
                     h_kernel=None):
    """[(factory, params)] of the three backward kernels for one configuration."""
    if block_v is None:
        block_v = default_block_v(V)
    dh_kernel = _walk_choice("dh_kernel", dh_kernel or DEFAULT_DH_KERNEL)
    h_kernel = _walk_choice("h_kernel", h_kernel or DEFAULT_H_KERNEL)
    specs = _bwd_kernel_specs(H, HV, K, V, dtype, scale, use_initial_state, use_dht, block_v, dh_kernel, h_kernel)
    return [(factory, dict(params)) for factory, params in specs]


@functools.lru_cache(maxsize=1024)
def _bwd_kernel_specs(H, HV, K, V, dtype, scale, use_initial_state, use_dht, block_v, dh_kernel, h_kernel):
    # cached: every backward call asks for the same specs (the switches are resolved by the caller)
    # the warp-specialised walks keep a two-stage ring of 64 x K tiles: K <= 128 only
    h_factory, dh_factory = build_bwd_h_kernel, build_bwd_dh_kernel
    if h_kernel == "ws" and K <= 128:
        from .tilelang_bwd_h_ws import build_bwd_h_ws_kernel

        h_factory = build_bwd_h_ws_kernel
    if dh_kernel == "ws" and K <= 128:
        from .tilelang_bwd_dh_ws import build_bwd_dh_ws_kernel

        dh_factory = build_bwd_dh_ws_kernel
    dtype = tl_dtype(dtype)
    grad = (build_bwd_grad_group_kernel, dict(H=H, HV=HV, K=K, V=V, dtype=dtype, scale=float(scale)))
    return [
        (h_factory, dict(H=H, HV=HV, K=K, V=V, dtype=dtype, use_initial_state=bool(use_initial_state),
                         block_v=int(block_v))),
        (dh_factory, dict(H=H, HV=HV, K=K, V=V, dtype=dtype, scale=float(scale), use_dht=bool(use_dht),
                          store_dh0=bool(use_initial_state), block_v=int(block_v))),
        grad,
    ]


def torch_prepare(k, g, beta, cu_seqlens):
    """G and Ag of the SPEC in torch (packed [1, T] inputs); a reference for debugging."""
    Tn, H, K = k.shape[1], k.shape[2], k.shape[3]
    HV = g.shape[2]
    grp = HV // H
    C = CHUNK
    G = torch.zeros(1, Tn, HV, dtype=torch.float32, device=k.device)
    Ag = torch.zeros(1, Tn, HV, C, dtype=k.dtype, device=k.device)
    edges = cu_seqlens.tolist()
    for n in range(len(edges) - 1):
        for t0 in range(edges[n], edges[n + 1], C):
            L = min(edges[n + 1] - t0, C)
            kc = k[0, t0 : t0 + L].double().repeat_interleave(grp, dim=1).transpose(0, 1)  # [HV, L, K]
            gc = g[0, t0 : t0 + L].double().cumsum(0).transpose(0, 1)  # [HV, L]
            bc = beta[0, t0 : t0 + L].double().transpose(0, 1)
            lm = torch.tril(bc[..., None] * (kc @ kc.transpose(-1, -2)), -1)
            eye = torch.eye(L, dtype=torch.float64, device=k.device)
            m = torch.linalg.solve_triangular(eye + lm, eye.expand_as(lm), upper=False, unitriangular=True)
            ag = torch.tril(m * torch.exp(gc[..., :, None] - gc[..., None, :])) * bc[..., None, :]
            G[0, t0 : t0 + L] = gc.transpose(0, 1).float()
            Ag[0, t0 : t0 + L, :, :L] = ag.transpose(0, 1).to(k.dtype)
    return G, Ag


# Test hook: when True every buffer the backward allocates starts as NaN, so that an element
# a kernel forgets to write shows up in the GPU check.
POISON_BUFFERS = False


def _empty(*shape, dtype, device):
    if POISON_BUFFERS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


def _saved_tensor(saved, name, shape):
    if not isinstance(saved, dict):
        return None
    t = saved.get(name)
    if t is None or t.shape == shape:  # (no reshape: each torch call is host time)
        return t
    return t.reshape(shape) if t.numel() == torch.Size(shape).numel() else None


def _as(x: torch.Tensor, dtype) -> torch.Tensor:
    """x in `dtype`, without a torch call when it already is (host time on every launch path)."""
    return x if x.dtype == dtype else x.to(dtype)


def tilelang_chunk_gated_delta_rule_bwd(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, saved,
                                         state_v_first=False, block_v=None, dh_kernel=None, h_kernel=None):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of the chunked GDN forward on Hopper.

    do [B,T,HV,V]; dht fp32 final-state gradient or None; q,k [B,T,H,K] bf16/fp16 (already
    l2-normalised if the forward normalised them); v [B,T,HV,V]; g, beta [B,T,HV];
    initial_state fp32 or None; cu_seqlens [N+1] (B == 1) or None; `saved` is the forward's
    third output (may be None: G and Ag are then recomputed). States are [N,HV,K,V]
    ([N,HV,V,K] with state_v_first). Output gradients have the dtypes of their inputs
    (dh0 fp32; None without initial_state).
    """
    B, Tn, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
    assert HV % H == 0
    dev = q.device
    dt = q.dtype
    if scale is None:
        scale = K**-0.5
    grp = HV // H
    Ttot = B * Tn
    split = saved.get("split") if isinstance(saved, dict) else None
    dense_tabs = None
    if cu_seqlens is not None:
        assert B == 1, "varlen inputs must be packed with B == 1"
        cu = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
    elif split is not None:  # the partitions' tables replace the sequences' (below)
        cu = split["part_cu"]
    else:  # a dense batch is B packed sequences of T; their tables come from the host (below)
        dense_tabs = plan_split([b * Tn for b in range(B + 1)], HV, V, 1).device_tensors(dev)
        cu = dense_tabs["part_cu"]
    N = cu.shape[0] - 1

    def flat(x, *tail):  # packed [1, B*T, ...] (B == 1 inputs already are)
        return kernel_operand(x.reshape(1, Ttot, *tail) if B > 1 else x)

    qf, kf = flat(q, H, K), flat(k, H, K)
    vf = flat(v, HV, V)
    dof = flat(_as(do, dt), HV, V)
    b32 = flat(_as(beta, torch.float32), HV)

    gcum = _saved_tensor(saved, "g_cumsum", (1, Ttot, HV))
    ag = _saved_tensor(saved, "Ag", (1, Ttot, HV, CHUNK))
    # the varlen forward's chunk bookkeeping, reused when it is there
    varlen_saved = saved if isinstance(saved, dict) and cu_seqlens is not None else {}
    ctab = varlen_saved.get("chunk_table")
    if gcum is None or ag is None or ag.dtype != dt:
        gcum, ag, ctab = prepare_fwd(kf, flat(g.float(), HV), b32, cu_seqlens=cu,
                                     chunk_tab=None if dense_tabs is None else dense_tabs["seq_chunk_table"])
    gcum = kernel_operand(_as(gcum, torch.float32))
    ag = kernel_operand(ag)

    sdims = (HV, K, V)
    user_h0 = initial_state is not None
    use_dht = dht is not None

    # without an initial state / exit gradient the kernels are built not to read them (use_initial_state /
    # use_dht off): a one-row placeholder stands in, allocated, not filled (no launch); the h walk's
    # h0 likewise, below, where that walk runs
    dhtf = state_kv_layout(dht, state_v_first) if use_dht else _empty(1, *sdims, dtype=torch.float32, device=dev)

    # Intra-card split (saved by the split forward): the partitions are the sequences of every
    # kernel below, entered with the forward's scanned states; their exit-state gradients come
    # from a reverse scan over dS_local (the dh walk run once with zero exit gradients).
    # Chunk bookkeeping: from the plan's device copies where the segments are known on the host
    # (split partitions, dense batches), so the backward launches nothing and does not wait for
    # the GPU here (H200, TP1 1x8k: fwd+bwd took 2.83 ms for 2.42 ms of kernel time with a sync)
    if split is not None:
        cu, ctab, chunk_offsets = split["part_cu"], split["part_chunk_table"], split["part_chunk_offsets"]
        order = split["part_order"]
        N = cu.shape[0] - 1
    elif dense_tabs is not None:
        ctab, chunk_offsets = dense_tabs["seq_chunk_table"], dense_tabs["seq_chunk_offsets"]
        order = dense_tabs["seq_order"]
    else:
        ctab = ctab if ctab is not None else chunk_table(cu)
        chunk_offsets = varlen_saved.get("chunk_offsets")
        chunk_offsets = chunk_offsets if chunk_offsets is not None else chunk_offsets_of(cu)
        order = varlen_saved.get("walk_order")
        order = order if order is not None else walk_order(cu)  # every walk takes it
    NC = int(ctab.shape[0])

    use_h0 = user_h0 or split is not None
    if h_kernel is None and split is not None:
        h_kernel = SPLIT_H_KERNEL
    sms = tilelang_common.sm_count(dev)
    # Head dims past 128: the grad kernel does not fit in shared memory (529 KB at K = V = 256), so
    # every chunk's dq / dk / dg / dbeta come from the V-sliced grad kernel (WIDE_GRADS) after the
    # two walks; the dh walk fits at block_v 32 (209 KB; 238 KB at 64). The forward never splits
    # such heads.
    wide = max(K, V) > 128
    assert not (wide and split is not None), "the forward does not split heads wider than 128"
    if block_v is None and wide:
        block_v = 32
    if block_v is None and split is not None and V % 64 == 0:
        # (measurement pending) partitions multiply the grid: 64-wide tiles while it still
        # fills the GPU, as in the forward's default_fused_config
        if grid_fills_gpu(N * HV * (V // 64), sms):
            block_v = 64
    specs = bwd_kernel_specs(H, HV, K, V, dt, scale, use_h0, use_dht or split is not None, block_v, dh_kernel,
                             h_kernel)
    fused_walk = fused_walk_wanted(N * HV, K, V, sms)
    # the chunk states and v residuals: from the forward when it kept them (save_states),
    # else recomputed by the h walk
    h_st = _saved_tensor(saved, "h_states", (NC, *sdims))
    vres = _saved_tensor(saved, "vres", (1, Ttot, HV, V))
    states_saved = h_st is not None and vres is not None and h_st.dtype == dt and vres.dtype == dt
    if not states_saved:
        h_st = _empty(NC, *sdims, dtype=dt, device=dev)
        vres = _empty(1, Ttot, HV, V, dtype=dt, device=dev)
    k_h = None if states_saved else compile_kernel(specs[0][0], **specs[0][1])
    k_dh = k_grad = None  # the fused walk replaces the full dh walk and the grad kernel
    if not fused_walk:
        k_dh = compile_kernel(specs[1][0], **specs[1][1])
        k_grad = None if wide else compile_kernel(specs[2][0], **specs[2][1])

    # dh and dvn reach memory only from the full dh walk (the fused walk keeps them on chip)
    dh_st = dvn = None
    if not fused_walk:
        dh_st = _empty(NC, *sdims, dtype=dt, device=dev)
        dvn = _empty(1, Ttot, HV, V, dtype=dt, device=dev)
    dv = _empty(1, Ttot, HV, V, dtype=dt, device=dev)
    dh0 = _empty(N if use_h0 else 1, *sdims, dtype=torch.float32, device=dev)
    dq = _empty(1, Ttot, H, K, dtype=dt, device=dev)
    dk = _empty(1, Ttot, H, K, dtype=dt, device=dev)
    dg = _empty(1, Ttot, HV, dtype=torch.float32, device=dev)
    db = _empty(1, Ttot, HV, dtype=torch.float32, device=dev)

    if NC > 0:
        if split is not None:
            if not states_saved:
                k_h(kf, vf, ag, gcum, cu, chunk_offsets, order, split["S_in"], h_st, vres)
            # the gradient reaching each partition's start from its own outputs: only its first
            # chunks matter until the gates have decayed by e^-16 (`dh_warmup_chunks`); this
            # pass starts from a zero exit gradient (use_dht off) and writes dh0 only
            dh_factory, dh_params = specs[1]
            k_dh_warm = compile_kernel(dh_factory, **dict(dh_params, use_dht=False), limit_chunks=True)
            k_dh_warm(qf, kf, dof, ag, gcum, cu, chunk_offsets, order, dhtf, dh0, split["dh_walk_chunks"])
            exit_grad = scan_partitions(split["M"].transpose(-1, -2), dh0, split["seq_parts"],
                                        dhtf if use_dht else None, reverse=True,
                                        num_seqs=len(split["first_parts"]))
            if fused_walk:
                _fused_walk(qf, kf, dof, vres, ag, gcum, b32, h_st, cu, chunk_offsets, order, exit_grad, True, True,
                            scale, dq, dk, dv, dg, db, dh0)
            else:
                k_dh(qf, kf, dof, ag, gcum, cu, chunk_offsets, order, exit_grad, dh_st, dvn, dv, dh0)
            dh0 = dh0.index_select(0, split["first_parts"]) if user_h0 else dh0
        else:
            if not states_saved:  # (without an initial state the h walk is built not to read h0)
                h0 = state_kv_layout(initial_state, state_v_first) if user_h0 else _empty(
                    1, *sdims, dtype=torch.float32, device=dev)
                k_h(kf, vf, ag, gcum, cu, chunk_offsets, order, h0, h_st, vres)
            if fused_walk:
                _fused_walk(qf, kf, dof, vres, ag, gcum, b32, h_st, cu, chunk_offsets, order, dhtf, use_dht, use_h0,
                            scale, dq, dk, dv, dg, db, dh0)
            else:
                k_dh(qf, kf, dof, ag, gcum, cu, chunk_offsets, order, dhtf, dh_st, dvn, dv, dh0)
        if wide:
            if WIDE_GRADS == "kernel":
                _wide_grads(qf, kf, dof, vres, dvn, ag, gcum, b32, h_st, dh_st, cu, ctab, scale, dq, dk, dg, db)
            else:
                dq, dk, dg, db = chunk_grads_from_states(qf, kf, dof, vres, dvn, gcum, b32, h_st, dh_st, cu, ctab,
                                                         scale)
        elif not fused_walk:
            k_grad(qf, kf, dof, vres, dvn, ag, gcum, b32, h_st, dh_st, cu, ctab, dq, dk, dg, db)
    else:
        for t in (dq, dk, dv, dg, db):
            t.zero_()
        if use_h0:
            dh0.copy_(dhtf if use_dht else torch.zeros_like(dh0))

    dg, db = _as(dg, g.dtype), _as(db, beta.dtype)
    if B > 1:
        dq, dk, dv = dq.reshape(B, Tn, H, K), dk.reshape(B, Tn, H, K), dv.reshape(B, Tn, HV, V)
        dg, db = dg.reshape(B, Tn, HV), db.reshape(B, Tn, HV)
    dh0 = state_kv_layout(dh0, state_v_first) if user_h0 else None
    return dq, dk, dv, dg, db, dh0


# The dh walk and the grad kernel replaced by one fused reverse walk per (sequence or partition,
# v-head) over the whole state (`tilelang_bwd_fused_ws.py`: a state warpgroup, a grad warpgroup
# and a loader warp). H200, bf16, K = V = 128, fwd+bwd (seventh / eighth sessions, NOTES_bwd.md):
# TP1 1x32k 3.89 vs 4.37 ms, TP1 4x8k 4.19 vs 4.94, varlen 8 docs 32k 5.33 vs 5.57, but TP8
# 1x32k 2.47 vs 1.21 and TP8 1x128k 3.04 vs 2.47: one block per walk leaves SMs idle unless the
# walks about fill the GPU. "auto" uses it when they do, "on" / "off" always / never.
FUSED_WALK = "auto"


def fused_walk_wanted(n_walks: int, K: int, V: int, sm_count: int, mode: str = None) -> bool:
    """Whether the backward runs the fused walk for `n_walks` = (sequences or partitions) x HV
    walks on a GPU of `sm_count` SMs (mode: FUSED_WALK unless given)."""
    mode = FUSED_WALK if mode is None else mode
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"FUSED_WALK must be 'auto', 'on' or 'off', not {mode!r}")
    if K > 128 or V > 128 or mode == "off":  # the walk keeps the whole state in registers
        return False
    return mode == "on" or grid_fills_gpu(n_walks, sm_count)


def switches(**values):
    """Set this module's kernel switches (FUSED_WALK, SPLIT_H_KERNEL, ...) for the duration of a
    `with` block, then restore them: checks and benchmarks compare variants in one process."""
    return switched_globals(globals(), **values)


def _fused_walk(qf, kf, dof, vres, ag, gcum, b32, h_st, cu, chunk_offsets, order, exit_grad, use_dht, store_dh0, scale,
                dq, dk, dv, dg, db, dh0):
    """Run the fused walk; dq / dk (per qk-head) are the sums of its per-v-head parts, rounded to
    the input dtype like the peer's (with HV == H the walk writes dq and dk themselves)."""
    H, K = qf.shape[2], qf.shape[3]
    HV = dof.shape[2]
    kern = compile_kernel(build_bwd_fused_ws_kernel, H=H, HV=HV, K=K, V=dof.shape[3], dtype=tl_dtype(qf.dtype),
                          scale=float(scale), use_dht=bool(use_dht), store_dh0=bool(store_dh0))
    dq_part, dk_part = _v_head_parts(dq, dk, HV)
    kern(qf, kf, dof, vres, ag, gcum, b32, h_st, cu, chunk_offsets, order, exit_grad, dq_part, dk_part, dv, dg, db,
         dh0)
    _sum_v_heads(dq_part, dk_part, dq, dk)


def _v_head_parts(dq, dk, HV):
    """Where a kernel that writes dq / dk per v-head puts them: dq and dk themselves when every
    qk-head has one v-head, else [1, T, HV, K] buffers for `_sum_v_heads`."""
    _, Ttot, H, K = dq.shape
    if HV == H:
        return dq, dk
    return (torch.empty(1, Ttot, HV, K, dtype=dq.dtype, device=dq.device) for _ in range(2))


def _sum_v_heads(dq_part, dk_part, dq, dk):
    """dq / dk [1, T, H, K] = the sums of per-v-head parts [1, T, HV, K] over each qk-head's
    v-heads (`tilelang_v_head_sum`); nothing to do when the parts are dq and dk themselves."""
    _, Ttot, HV, K = dq_part.shape
    H = dq.shape[2]
    if HV == H:
        return
    group = HV // H
    summed = compile_kernel(build_v_head_sum_kernel, H=H, group=group, K=K, dtype=tl_dtype(dq.dtype))
    summed(dq_part.view(Ttot, H, group, K), dk_part.view(Ttot, H, group, K), dq.view(Ttot, H, K),
           dk.view(Ttot, H, K))


# Per-chunk gradients for head dims past 128 (the grad kernel does not fit there): "kernel"
# (`tilelang_bwd_grad_wide`: V in slices, one block per (chunk, v-head)) or "torch"
# (`chunk_grads_torch`). Both pass tests/gpu/check_bwd.py's wide cases; H200, 2 x 16k tokens,
# heads 2 / 4 of 256, fwd+bwd: 5.8 ms with the kernel, 16.8 with torch (peak 2.2 vs 5.3 GiB).
WIDE_GRADS = "kernel"


def wide_grad_kernel_specs(H, HV, K, V, dtype, scale):
    """[(factory, params)] of the wide-head grad kernel and, with HV > H, its v-head sum."""
    dtype = tl_dtype(dtype)
    specs = [(build_bwd_grad_wide_kernel, dict(H=H, HV=HV, K=K, V=V, dtype=dtype, scale=float(scale)))]
    if HV > H:
        specs.append((build_v_head_sum_kernel, dict(H=H, group=HV // H, K=K, dtype=dtype)))
    return specs


def _wide_grads(qf, kf, dof, vres, dvn, ag, gcum, b32, h_st, dh_st, cu, ctab, scale, dq, dk, dg, db):
    """dq / dk / dg / dbeta of every chunk by `build_bwd_grad_wide_kernel`, summed over v-heads."""
    H, K = qf.shape[2], qf.shape[3]
    HV, V = dof.shape[2], dof.shape[3]
    factory, params = wide_grad_kernel_specs(H, HV, K, V, qf.dtype, scale)[0]
    kern = compile_kernel(factory, **params)
    dq_part, dk_part = _v_head_parts(dq, dk, HV)
    kern(qf, kf, dof, vres, dvn, ag, gcum, b32, h_st, dh_st, cu, ctab, dq_part, dk_part, dg, db)
    _sum_v_heads(dq_part, dk_part, dq, dk)


def sum_v_head_parts(parts, out):
    """out[..., h, :] = sum over j of parts[..., h, j, :], rounded once to out's dtype: the torch
    form of `tilelang_v_head_sum` (its reference; the GPU backward runs the kernel).

    The bf16 / fp16 parts are added in fp32 in v-head order and rounded once, exactly as torch.sum
    does, so the result is bitwise the same. (On the H200 at TP1 1 x 32k torch.sum over the
    size-2 dimension took 0.27 ms per tensor and an add of the two strided halves 0.18 ms; the
    kernel reads each token's parts contiguously.)
    """
    acc = parts[..., 0, :].float()
    for j in range(1, parts.shape[-2]):
        acc.add_(parts[..., j, :])
    out.copy_(acc)


_ENTRY = {"build_bwd_h_kernel": "gdn_bwd_h", "build_bwd_dh_kernel": "gdn_bwd_dh", "build_bwd_dh_ws_kernel": "gdn_bwd_dh",
          "build_bwd_h_ws_kernel": "gdn_bwd_h",
          "build_bwd_grad_group_kernel": "gdn_bwd_grad_group"}


def lowering_cases():
    """(name, factory, params, entry) for every backward kernel variant the CI lowers."""
    cases = []
    for dtype in ("bfloat16", "float16"):
        for dim in (128, 64):
            tag = f"{dtype}_k{dim}"
            for f, p in bwd_kernel_specs(2, 4, dim, dim, dtype, dim**-0.5, True, True):
                entry = _ENTRY[f.__name__]
                cases.append((f"{entry}_{tag}", f, p, entry))
    # GVA-free (dq/dk written in the input dtype) and no-state variants
    for f, p in bwd_kernel_specs(4, 4, 128, 128, "bfloat16", 128**-0.5, False, False):
        entry = _ENTRY[f.__name__]
        cases.append((f"{entry}_bfloat16_k128_nostate_mha", f, p, entry))
    # the split backward's first dh walk, limited to each partition's first chunks
    for kind in WALK_KERNELS:
        f, p = bwd_kernel_specs(2, 4, 128, 128, "bfloat16", 128**-0.5, True, True, 32, dh_kernel=kind)[1]
        cases.append((f"gdn_bwd_dh_limited_{kind}_bfloat16_k128", f, dict(p, use_dht=False, limit_chunks=True),
                      "gdn_bwd_dh_limited"))
    # the warp-specialised h and dh walks (with and without initial state / exit gradients)
    for dim, bv, states in ((128, 32, True), (128, 64, False), (64, 64, True)):
        specs = bwd_kernel_specs(2, 4, dim, dim, "bfloat16", dim**-0.5, states, states, bv, dh_kernel="ws",
                                 h_kernel="ws")
        for (f, p), entry in zip(specs[:2], ("gdn_bwd_h", "gdn_bwd_dh")):
            cases.append((f"{entry}_ws_k{dim}_bv{bv}{'' if states else '_nostate'}", f, p, entry))
    # the GVA sum of the fused walk's dq / dk parts
    for H, group, dim, dtype in ((16, 2, 128, "bfloat16"), (2, 4, 64, "float16")):
        cases.append((f"gdn_v_head_sum_g{group}_{dtype}_k{dim}", build_v_head_sum_kernel,
                      dict(H=H, group=group, K=dim, dtype=dtype), "gdn_v_head_sum"))
    # the fused walk (FUSED_WALK; with and without exit gradients / dh0, both head sizes)
    for dim, states in ((128, True), (64, False)):
        cases.append((f"gdn_bwd_fused_ws_k{dim}{'' if states else '_nostate'}", build_bwd_fused_ws_kernel,
                      dict(H=2, HV=4, K=dim, V=dim, dtype="bfloat16", scale=dim**-0.5, use_dht=states,
                           store_dh0=states), "gdn_bwd_fused_ws"))
    # the grad kernel of head dims past 128 (WIDE_GRADS = "kernel")
    cases.append(("gdn_bwd_grad_wide_k256", build_bwd_grad_wide_kernel,
                  dict(H=2, HV=4, K=256, V=256, dtype="bfloat16", scale=256**-0.5), "gdn_bwd_grad_wide"))
    return cases
