"""TileLang Hopper (sm_90a) forward kernels for chunked Gated DeltaNet.

SPEC (shared with the backward kernels, `tilelang_bwd_impl.py`)
==========================================================
Notation per v-head, chunk of C = 64 tokens (the last chunk of a sequence may be partial,
length L <= 64; rows/cols >= L are padding):

    G      = chunk-local inclusive cumsum of g                        (fp32)
    Lm_ij  = beta_i (k_i . k_j)            for i > j, else 0          (no gating)
    M      = (I + Lm)^-1                                              (unit lower triangular)
    Ag_ij  = M_ij exp(G_i - G_j) beta_j    for j <= i < L, else 0
           = Tm diag(beta), Tm = (I + A)^-1 with the gated A of the chunked form
    then   u = Ag v,  w = Ag diag(exp(G)) k,
           v_new = Ag (v - exp(G) * (k S))          (= u - w S)
           o     = scale * (exp(G) * (q S) + tril_incl(q k^T * exp(G_i - G_j)) v_new)
           S'    = exp(G_L) S + (k * exp(G_L - G))^T v_new

`tilelang_chunk_gated_delta_rule_fwd(...)` returns (o, final_state, saved) where `saved` is a
dict (all tensors contiguous, token-major like the inputs):

    saved["g_cumsum"] : [B, T, HV]      fp32   G (chunk-local cumsum, per sequence)
    saved["Ag"]       : [B, T, HV, 64]  q.dtype row t holds row (t mod chunk) of Ag for the chunk
                                        containing token t; columns >= L are zero
    saved["chunk_table"]: [NC, 2] int32  (sequence, chunk-in-sequence) per chunk, varlen only
    saved["chunk_offsets"]: [N + 1] int32 each sequence's first chunk in that table, varlen only
                        (None when nothing needed it)
    saved["walk_order"]: [N] int32 the sequences longest first, the order of the walks' blocks
                        (`tilelang_common.walk_order`), varlen unsplit only
    saved["cu_seqlens"] : int32 cu_seqlens or None
    saved["scale"], saved["state_v_first"] : python values
    saved["partitions"]: int, how many partitions the fused kernel walked (N when unsplit)
    saved["split"]    : only when split (`tilelang_split`): part_cu, part_chunk_table,
                        part_chunk_offsets, part_order, seq_parts, first_parts, S_in (state entering each
                        partition, fp32 [NP, HV, K, V]), M (transition of each partition) and
                        dh_walk_chunks (`decay_tables`)

    saved["h_states"]: [NC, HV, K, V] q.dtype, the state entering each chunk (chunks of the
                       partitions when split), and saved["vres"]: [B, T, HV, V] q.dtype,
                       v - exp(G) k S; only with save_states=True (warp-specialised kernel).
                       Without them the backward recomputes both (its h walk).
States (initial / final) are fp32, [N, HV, K, V], or [N, HV, V, K] when state_v_first.

Kernels
-------
* `build_prepare_kernel`  : per (chunk, v-head): cumsum of g, K K^T, triangular inverse
  (16x16 diagonal blocks by column-wise substitution, then the nilpotent block series
  M = D - E (D - E (D - E D)), E = D N, with tf32 tensor-core MMAs), gating and beta folded
  in -> writes G and Ag.
* `build_fused_fwd_kernel`: per (v-block, sequence, v-head): walks the chunks of its sequence
  with the state block S[K, BV] in fp32 registers; six wgmma GEMMs per chunk; writes o and the
  final state. `tilelang_fwd_ws.build_fused_fwd_ws_kernel` has the same contract with the
  work split over three warpgroups (state / output / TMA loader); `default_fused_config`
  picks it for K <= 128.

Every factory returns a TileLang PrimFunc; `compile_kernel` compiles lazily and caches by
parameters. Nothing is compiled or queried at import time.
"""



import functools
import math

import torch

from . import tilelang_common
from .tilelang_common import (CHUNK, chunk_offsets, chunk_table, compile_kernel, grid_fills_gpu, import_tilelang,
                              kernel_operand, ordered_block, state_kv_layout, switched_globals, tl_dtype, walk_order)
from .tilelang_split import SPLIT_MAX_HEAD_DIM, decay_tables, plan_split, scan_partitions, state_summaries

LOG2E = 1.4426950408889634

__all__ = [
    "build_prepare_kernel",
    "build_fused_fwd_kernel",
    "tilelang_chunk_gated_delta_rule_fwd",
    "prepare_fwd",
    "fwd_kernel_specs",
    "default_fused_config",
]


# ----------------------------------------------------------------------------------------
# Kernel 1: chunk-local cumsum + K K^T + triangular inverse, gating folded in.
# ----------------------------------------------------------------------------------------
def build_prepare_kernel(H: int, HV: int, K: int, dtype: str, is_varlen: bool, threads: int = 128,
                         inv_dtype: str = "float16"):
    """PrimFunc computing G (cumsum of g) and Ag for every chunk and v-head.

    Non-varlen arguments: k [B,T,H,K] dtype, g [B,T,HV] fp32, beta [B,T,HV] fp32,
    g_out [B,T,HV] fp32, a_out [B,T,HV,64] dtype.
    Varlen adds cu_seqlens [N+1] int32 and chunk_table [NC,2] int32 (B == 1).
    """
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    G = HV // H
    assert HV % H == 0

    @T.macro
    def body(k, g, beta, g_out, a_out, bb, bhv, t0, L):
        bh = bhv // G
        k_s = T.alloc_shared((C, K), dtype)
        g_s = T.alloc_shared((C,), acc)
        b_s = T.alloc_shared((C,), acc)
        kk_f = T.alloc_fragment((C, C), acc)
        # inversion operands: fp16 (wgmma, same 10-bit mantissa as tf32) or fp32 (tf32 mma)
        n_s = T.alloc_shared((C, C), inv_dtype)  # beta k k^T strictly lower -> then N -> then E
        d_s = T.alloc_shared((C, C), inv_dtype)  # inverse of the block-diagonal part
        z_s = T.alloc_shared((C, C), inv_dtype)
        z_f = T.alloc_fragment((C, C), acc)
        out_s = T.alloc_shared((C, C), dtype)
        col = T.alloc_local((16,), acc)
        run = T.alloc_local((1,), acc)

        tx = T.get_thread_binding()

        if L == C:
            T.copy(k[bb, t0 : t0 + C, bh, :], k_s)
        else:
            # Rows >= L are zero: clamped-row loads (L >= 1), then the zeros in a store-only loop
            # (the elementwise rule, tilelang_common: no load under a condition).
            for i, d in T.Parallel(C, K):
                k_s[i, d] = k[bb, t0 + T.min(i, L - 1), bh, d]
            for i, d in T.Parallel(C, K):
                if i >= L:
                    k_s[i, d] = T.cast(0, dtype)
        for i in T.Parallel(C):
            if i < L:
                g_s[i] = g[bb, t0 + i, bhv]
                b_s[i] = beta[bb, t0 + i, bhv]
            else:
                g_s[i] = T.float32(0)
                b_s[i] = T.float32(0)
        T.cumsum(g_s, dim=0)
        for i in T.Parallel(C):
            if i < L:
                g_out[bb, t0 + i, bhv] = g_s[i]

        T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
        # compute in registers, mask, then store: loops of their own (the elementwise rule,
        # tilelang_common)
        for i, j in T.Parallel(C, C):
            kk_f[i, j] = kk_f[i, j] * b_s[i]
        for i, j in T.Parallel(C, C):
            kk_f[i, j] = T.if_then_else(i > j, kk_f[i, j], T.float32(0))
        T.copy(kk_f, n_s)
        for i, j in T.Parallel(C, C):
            kk_f[i, j] = T.if_then_else(i == j, T.float32(1), T.float32(0))
        T.copy(kk_f, d_s)
        T.sync_threads()

        # Column-wise forward substitution inside each 16x16 diagonal block: thread (blk, c)
        # owns column c of block blk in registers, so it needs no other thread's results.
        if tx < 64:
            blk = tx // 16
            c = tx % 16
            for r in T.unroll(16):
                col[r] = T.if_then_else(r == c, T.float32(1), T.float32(0))
            for r in T.unroll(1, 16):
                run[0] = T.float32(0)
                for m in T.unroll(r):
                    run[0] += T.cast(n_s[blk * 16 + r, blk * 16 + m], acc) * col[m]
                if r > c:
                    col[r] = -run[0]
            for r in T.unroll(16):
                d_s[blk * 16 + r, blk * 16 + c] = T.cast(col[r], inv_dtype)
        T.sync_threads()
        # keep only the strictly block-lower part N
        for i, j in T.Parallel(C, C):
            if i // 16 == j // 16:
                n_s[i, j] = T.cast(0, inv_dtype)

        # (I + Lm)^-1 = (I + E)^-1 D with E = D N nilpotent of order 4:
        # M = D - E (D - E (D - E D)).
        T.gemm(d_s, n_s, z_f, clear_accum=True)
        T.copy(z_f, n_s)  # n_s now holds E
        T.gemm(n_s, d_s, z_f, clear_accum=True)
        # z = D - E (...) in registers, then stored by itself (rounded to inv_dtype by the copy)
        for i, j in T.Parallel(C, C):
            z_f[i, j] = T.cast(d_s[i, j], acc) - z_f[i, j]
        T.copy(z_f, z_s)
        T.gemm(n_s, z_s, z_f, clear_accum=True)
        for i, j in T.Parallel(C, C):
            z_f[i, j] = T.cast(d_s[i, j], acc) - z_f[i, j]
        T.copy(z_f, z_s)
        T.gemm(n_s, z_s, z_f, clear_accum=True)
        # Gated for every entry, then masked in a loop without loads. No clamp of the exponent:
        # entries above the diagonal may overflow to inf / NaN, but the select discards them
        # (a clamp could change valid entries wherever the cumsum is not exactly monotone).
        for i, j in T.Parallel(C, C):
            z_f[i, j] = (T.cast(d_s[i, j], acc) - z_f[i, j]) * T.exp2((g_s[i] - g_s[j]) * LOG2E) * b_s[j]
        for i, j in T.Parallel(C, C):
            z_f[i, j] = T.if_then_else((i >= j) and (i < L) and (j < L), z_f[i, j], T.float32(0))
        T.copy(z_f, out_s)
        if L == C:
            T.copy(out_s, a_out[bb, t0 : t0 + C, bhv, :])
        else:
            for i, j in T.Parallel(C, C):
                if i < L:
                    a_out[bb, t0 + i, bhv, j] = out_s[i, j]

    if is_varlen:
        Ttot = T.dynamic("num_tokens")
        NC = T.dynamic("num_chunks")
        N1 = T.dynamic("num_seqs_plus_one")

        @T.prim_func
        def gdn_fwd_prepare_varlen(
            k: T.Tensor((1, Ttot, H, K), dtype),
            g: T.Tensor((1, Ttot, HV), acc),
            beta: T.Tensor((1, Ttot, HV), acc),
            cu_seqlens: T.Tensor((N1,), "int32"),
            chunk_tab: T.Tensor((NC, 2), "int32"),
            g_out: T.Tensor((1, Ttot, HV), acc),
            a_out: T.Tensor((1, Ttot, HV, C), dtype),
        ):
            with T.Kernel(NC, HV, threads=threads) as (bc, bhv):
                n = chunk_tab[bc, 0]
                ci = chunk_tab[bc, 1]
                s0 = cu_seqlens[n]
                t0 = s0 + ci * C
                L = T.min(cu_seqlens[n + 1] - t0, C)
                body(k, g, beta, g_out, a_out, 0, bhv, t0, L)

        return gdn_fwd_prepare_varlen

    B = T.dynamic("batch")
    Tlen = T.dynamic("seq_len")

    @T.prim_func
    def gdn_fwd_prepare(
        k: T.Tensor((B, Tlen, H, K), dtype),
        g: T.Tensor((B, Tlen, HV), acc),
        beta: T.Tensor((B, Tlen, HV), acc),
        g_out: T.Tensor((B, Tlen, HV), acc),
        a_out: T.Tensor((B, Tlen, HV, C), dtype),
    ):
        with T.Kernel(T.ceildiv(Tlen, C), B * HV, threads=threads) as (bc, bbh):
            bb = bbh // HV
            bhv = bbh % HV
            t0 = bc * C
            L = T.min(Tlen - t0, C)
            body(k, g, beta, g_out, a_out, bb, bhv, t0, L)

    return gdn_fwd_prepare


# ----------------------------------------------------------------------------------------
# Kernel 2: the chunk recurrence fused with the output.
# ----------------------------------------------------------------------------------------
def state_io(T, K, BV, use_initial_state, store_final_state, state_v_first):
    """TileLang macros (load_initial_state, store_final) moving a block's S[K, BV] fp32 slice
    between registers and h0 / ht (layout [.., V, K] when state_v_first); shared by every fused
    forward kernel."""

    @T.macro
    def load_initial_state(s_f, h0, n, bhv, v0):
        if use_initial_state:
            if state_v_first:
                for i, j in T.Parallel(K, BV):
                    s_f[i, j] = h0[n, bhv, v0 + j, i]
            else:
                T.copy(h0[n, bhv, :, v0 : v0 + BV], s_f)
        else:
            T.clear(s_f)

    @T.macro
    def store_final(s_f, ht, n, bhv, v0):
        if store_final_state:
            if state_v_first:
                for i, j in T.Parallel(K, BV):
                    ht[n, bhv, v0 + j, i] = s_f[i, j]
            else:
                T.copy(s_f, ht[n, bhv, :, v0 : v0 + BV])

    return load_initial_state, store_final


def build_fused_fwd_kernel(
    H: int,
    HV: int,
    K: int,
    V: int,
    dtype: str,
    scale: float,
    is_varlen: bool,
    use_initial_state: bool,
    store_final_state: bool,
    state_v_first: bool = False,
    block_v: int = 64,
    threads: int = 128,
    num_stages: int = 2,
    async_mma: bool = True,
    o_store_smem: bool = False,
):
    """PrimFunc walking every sequence chunk by chunk with S[K, block_v] held in fp32.

    Arguments (non-varlen): q,k [B,T,H,K], v [B,T,HV,V], ag [B,T,HV,64] dtype, gc [B,T,HV] fp32,
    h0 [N0,HV,K,V] fp32, o [B,T,HV,V] dtype, ht [N1,HV,K,V] fp32 (state dims swapped when
    state_v_first; h0/ht may be 1-row dummies when unused). Varlen inserts cu_seqlens [N+1]
    int32 after gc.
    """
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    G = HV // H
    BV = block_v
    assert V % BV == 0 and BV % 16 == 0
    NV = V // BV
    scale = float(scale)
    load_initial_state, store_final = state_io(T, K, BV, use_initial_state, store_final_state, state_v_first)

    @T.macro
    def body(q, k, v, ag, gc, h0, o, ht, bb, n, bhv, bv, t_start, seq_len):
        bh = bhv // G
        v0 = bv * BV
        q_s = T.alloc_shared((C, K), dtype)
        k_s = T.alloc_shared((C, K), dtype)
        v_s = T.alloc_shared((C, BV), dtype)
        a_s = T.alloc_shared((C, C), dtype)
        g_s = T.alloc_shared((C,), acc)
        gl_s = T.alloc_shared((C,), acc)
        h_s = T.alloc_shared((K, BV), dtype)
        w_s = T.alloc_shared((C, BV), dtype)
        vn_s = T.alloc_shared((C, BV), dtype)
        vd_s = T.alloc_shared((C, BV), dtype)
        p_s = T.alloc_shared((C, C), dtype)
        o_s = T.alloc_shared((C, BV), dtype)

        s_f = T.alloc_fragment((K, BV), acc)
        x_f = T.alloc_fragment((C, BV), acc)
        vn_f = T.alloc_fragment((C, BV), acc)
        p_f = T.alloc_fragment((C, C), acc)
        o_f = T.alloc_fragment((C, BV), acc)
        glast = T.alloc_var(acc)

        load_initial_state(s_f, h0, n, bhv, v0)

        n_chunks = T.ceildiv(seq_len, C)
        for c in T.Pipelined(n_chunks, num_stages=num_stages):
            t0 = t_start + c * C
            L = T.min(seq_len - c * C, C)
            # Whole 64-row tiles are loaded even for a partial last chunk: rows >= L hold the
            # next sequence's tokens (or zeros past the end of the tensor). They are harmless:
            # Ag has zero columns >= L, the causal mask keeps them out of valid outputs, and
            # the state update selects them away below.
            T.copy(q[bb, t0 : t0 + C, bh, :], q_s)
            T.copy(k[bb, t0 : t0 + C, bh, :], k_s)
            T.copy(v[bb, t0 : t0 + C, bhv, v0 : v0 + BV], v_s)
            T.copy(ag[bb, t0 : t0 + C, bhv, :], a_s)
            for i in T.Parallel(C):
                # padding rows repeat the last valid G: every exponent below stays <= 0
                g_s[i] = gc[bb, t0 + T.min(i, L - 1), bhv]

            # Private copy of G: the pipeliner may hand g_s's stage back to the producer as
            # soon as the q_s group is released, so later reads go to gl_s.
            for i in T.Parallel(C):
                gl_s[i] = g_s[i]
            T.copy(s_f, h_s)
            if async_mma:
                # three independent products, one wait; the last one is synchronous so that
                # q_s / k_s are no longer read when their stage is released to the producer
                T.wgmma_gemm(k_s, h_s, x_f, clear_accum=True)
                T.wgmma_gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                T.gemm(q_s, h_s, o_f, clear_accum=True)
            else:
                T.gemm(k_s, h_s, x_f, clear_accum=True)
                T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                T.gemm(q_s, h_s, o_f, clear_accum=True)
            for i, j in T.Parallel(C, BV):
                w_s[i, j] = v_s[i, j] - T.exp2(gl_s[i] * LOG2E) * x_f[i, j]
            for i, j in T.Parallel(C, C):
                p_s[i, j] = T.if_then_else(
                    i >= j, p_f[i, j] * T.exp2((gl_s[i] - gl_s[j]) * LOG2E) * scale, T.float32(0)
                )
            for i, j in T.Parallel(C, BV):
                o_f[i, j] = o_f[i, j] * (T.exp2(gl_s[i] * LOG2E) * scale)
            # v_new = Ag (v - exp(G) k S)
            T.gemm(a_s, w_s, vn_f, clear_accum=True)
            glast = gl_s[C - 1]
            for i, j in T.Parallel(C, BV):
                vn_s[i, j] = vn_f[i, j]
                vd_s[i, j] = T.if_then_else(i < L, vn_f[i, j] * T.exp2((glast - gl_s[i]) * LOG2E), T.float32(0))
            for i, j in T.Parallel(K, BV):
                s_f[i, j] = s_f[i, j] * T.exp2(glast * LOG2E)
            # o += P v_new ; S = exp(G_L) S + (k exp(G_L - G))^T v_new
            if async_mma:
                T.wgmma_gemm(p_s, vn_s, o_f)
                T.gemm(k_s, vd_s, s_f, transpose_A=True)  # synchronous: waits for both
            else:
                T.gemm(p_s, vn_s, o_f)
                T.gemm(k_s, vd_s, s_f, transpose_A=True)
            if o_store_smem:
                # through shared memory (TMA store for whole chunks)
                if L == C:
                    T.copy(o_f, o_s)
                    T.copy(o_s, o[bb, t0 : t0 + C, bhv, v0 : v0 + BV])
                else:
                    T.copy(o_f, o_s)
                    for i, j in T.Parallel(C, BV):
                        if i < L:
                            o[bb, t0 + i, bhv, v0 + j] = o_s[i, j]
            else:
                # straight from registers: no wait on a bulk store in the chunk loop
                for i, j in T.Parallel(C, BV):
                    if i < L:
                        o[bb, t0 + i, bhv, v0 + j] = o_f[i, j]

        store_final(s_f, ht, n, bhv, v0)

    return fused_fwd_entry(body, H, HV, K, V, dtype, is_varlen, state_v_first, NV, threads)


def fused_fwd_entry(body, H, HV, K, V, dtype, is_varlen, state_v_first, NV, threads, store_states=False):
    """The fused forward's PrimFunc around `body` (the per-CTA walk of one sequence, v-head and
    V block): the argument list of the SPEC and the grid (NV, sequences, HV). Shared by the
    single-warpgroup kernel and the warp-specialised one (`tilelang_fwd_ws.py`).

    store_states (warp-specialised body only) appends the outputs the backward would otherwise
    recompute: h_st [NC, HV, K, V] dtype, the state entering each chunk, and vres [B, T, HV, V]
    dtype, v - exp(G) (k S) (`tilelang_bwd_impl.build_bwd_h_kernel` writes the same two); chunk
    c of sequence n is row chunk_offsets[n] + c (varlen: an int32 [N + 1] argument after them;
    dense: b * ceil(T / 64) + c). Varlen grids take an int32 [N] `order` after cu_seqlens: the
    sequences in the order their blocks start (`tilelang_common.walk_order`, longest first)."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    h_dims = (V, K) if state_v_first else (K, V)
    N0 = T.dynamic("n_h0")
    NT = T.dynamic("n_ht")
    NC = T.dynamic("num_chunks")

    if is_varlen:
        Ttot = T.dynamic("num_tokens")
        N1 = T.dynamic("num_seqs_plus_one")
        NS = T.dynamic("num_seqs")  # order: the walk order of the sequences (`walk_order`)

        if store_states:

            @T.prim_func
            def gdn_fwd_fused_varlen_states(
                q: T.Tensor((1, Ttot, H, K), dtype),
                k: T.Tensor((1, Ttot, H, K), dtype),
                v: T.Tensor((1, Ttot, HV, V), dtype),
                ag: T.Tensor((1, Ttot, HV, C), dtype),
                gc: T.Tensor((1, Ttot, HV), acc),
                cu_seqlens: T.Tensor((N1,), "int32"),
                order: T.Tensor((NS,), "int32"),
                h0: T.Tensor((N0, HV, *h_dims), acc),
                o: T.Tensor((1, Ttot, HV, V), dtype),
                ht: T.Tensor((NT, HV, *h_dims), acc),
                h_st: T.Tensor((NC, HV, K, V), dtype),
                vres: T.Tensor((1, Ttot, HV, V), dtype),
                chunk_offsets: T.Tensor((N1,), "int32"),
            ):
                with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
                    n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)
                    s0 = cu_seqlens[n]
                    body(q, k, v, ag, gc, h0, o, ht, 0, n, bhv, bv, s0, cu_seqlens[n + 1] - s0,
                         h_st, vres, chunk_offsets[n])

            return gdn_fwd_fused_varlen_states

        @T.prim_func
        def gdn_fwd_fused_varlen(
            q: T.Tensor((1, Ttot, H, K), dtype),
            k: T.Tensor((1, Ttot, H, K), dtype),
            v: T.Tensor((1, Ttot, HV, V), dtype),
            ag: T.Tensor((1, Ttot, HV, C), dtype),
            gc: T.Tensor((1, Ttot, HV), acc),
            cu_seqlens: T.Tensor((N1,), "int32"),
            order: T.Tensor((NS,), "int32"),
            h0: T.Tensor((N0, HV, *h_dims), acc),
            o: T.Tensor((1, Ttot, HV, V), dtype),
            ht: T.Tensor((NT, HV, *h_dims), acc),
        ):
            with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
                n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)
                s0 = cu_seqlens[n]
                body(q, k, v, ag, gc, h0, o, ht, 0, n, bhv, bv, s0, cu_seqlens[n + 1] - s0)

        return gdn_fwd_fused_varlen

    B = T.dynamic("batch")
    Tlen = T.dynamic("seq_len")

    if store_states:

        @T.prim_func
        def gdn_fwd_fused_states(
            q: T.Tensor((B, Tlen, H, K), dtype),
            k: T.Tensor((B, Tlen, H, K), dtype),
            v: T.Tensor((B, Tlen, HV, V), dtype),
            ag: T.Tensor((B, Tlen, HV, C), dtype),
            gc: T.Tensor((B, Tlen, HV), acc),
            h0: T.Tensor((N0, HV, *h_dims), acc),
            o: T.Tensor((B, Tlen, HV, V), dtype),
            ht: T.Tensor((NT, HV, *h_dims), acc),
            h_st: T.Tensor((NC, HV, K, V), dtype),
            vres: T.Tensor((B, Tlen, HV, V), dtype),
        ):
            with T.Kernel(NV, B, HV, threads=threads) as (bv, bb, bhv):
                body(q, k, v, ag, gc, h0, o, ht, bb, bb, bhv, bv, 0, Tlen, h_st, vres, bb * T.ceildiv(Tlen, C))

        return gdn_fwd_fused_states

    @T.prim_func
    def gdn_fwd_fused(
        q: T.Tensor((B, Tlen, H, K), dtype),
        k: T.Tensor((B, Tlen, H, K), dtype),
        v: T.Tensor((B, Tlen, HV, V), dtype),
        ag: T.Tensor((B, Tlen, HV, C), dtype),
        gc: T.Tensor((B, Tlen, HV), acc),
        h0: T.Tensor((N0, HV, *h_dims), acc),
        o: T.Tensor((B, Tlen, HV, V), dtype),
        ht: T.Tensor((NT, HV, *h_dims), acc),
    ):
        with T.Kernel(NV, B, HV, threads=threads) as (bv, bb, bhv):
            body(q, k, v, ag, gc, h0, o, ht, bb, bb, bhv, bv, 0, Tlen)

    return gdn_fwd_fused


# ----------------------------------------------------------------------------------------
# Python entry points
# ----------------------------------------------------------------------------------------
def _check_inputs(q, k, v, g, beta, cu_seqlens):
    assert q.dtype in (torch.bfloat16, torch.float16), "q/k/v must be bf16 or fp16"
    assert q.dtype == k.dtype == v.dtype
    B, Tn, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert k.shape == q.shape and v.shape[:2] == (B, Tn)
    assert HV % H == 0, "HV must be a multiple of H"
    assert g.shape == (B, Tn, HV) and beta.shape == (B, Tn, HV)
    if cu_seqlens is not None:
        assert B == 1, "varlen inputs must be packed with B == 1"
    return B, Tn, H, K, HV, V


# The four-warpgroup forward (`tilelang_fwd_ws4.py`: a whole 128-wide state per block) instead of
# the three-warpgroup one where its grid fills the GPU. H200, bf16, TP1 forward, same run
# (results/bench_kernels_h200_2026-12-04_ws4.md): 1x32k 0.786 vs 0.875 ms, 4x8k 0.722 vs 0.805;
# 8 uneven documents in 32k 0.987 vs 0.962 before the walks took the longest documents first.
FOUR_WARPGROUPS = True
# The four-warpgroup forward's o leaves through a shared tile and a TMA store (`o_tma`) instead
# of each thread's fragment stores (half-sector writes that queued behind the state hand-over's
# shared-memory traffic). H200, bf16 forward, same run (results/bench_kernels_h200_2026-12-04_otma.md):
# TP1 1x32k 0.742 -> 0.640 ms, 4x8k 0.662 -> 0.571, 8 documents 0.688 -> 0.603, TP8 1x128k
# 0.463 -> 0.421; outputs bitwise equal (check_fwd ws4otma cases).
O_TMA = True


def switches(**values):
    """Set this module's kernel switches (FOUR_WARPGROUPS, O_TMA) inside a `with` block."""
    return switched_globals(globals(), **values)


def default_fused_config(n_seqs, HV, V, sm_count=132, K=128):
    """Tile choice for the fused kernel. Each CTA walks a whole sequence for one v-head and one
    V block, so with few (sequence, v-head) pairs narrower V blocks buy parallelism and a
    shorter per-chunk critical path.

    K <= 128: the warp-specialised kernel (`tilelang_fwd_ws.py`), with the widest block_v whose
    grid still covers ~90% of the SMs (H200, benchmarks/results/tune_fwd_h200_2026-12-03_ws.json:
    32 pairs -> 32, 128+ pairs -> 64, 4 pairs -> 16; 1.2-1.5x faster than the single-warpgroup
    kernel at each shape's best tile). K > 128: the single-warpgroup kernel, whose tiles fit the
    shared memory (q/k tiles of 64 x K double-buffered leave room for block_v <= 32 only).
    """
    pairs = n_seqs * HV
    if K > 128:
        return {"block_v": 32 if pairs * (V // 32) >= sm_count // 2 else 16, "threads": 128}
    if FOUR_WARPGROUPS and V % 128 == 0 and grid_fills_gpu(pairs * (V // 128), sm_count):
        cfg = {"warp_specialized": True, "four_warpgroups": True, "block_v": 128}
        return {**cfg, "o_tma": True} if O_TMA else cfg
    for bv in (64, 32):
        if V % bv == 0 and grid_fills_gpu(pairs * (V // bv), sm_count):
            return {"warp_specialized": True, "block_v": bv}
    return {"warp_specialized": True, "block_v": 16 if V % 16 == 0 else V}


def fwd_kernel_specs(H, HV, K, V, dtype, scale, is_varlen, use_initial_state, store_final_state,
                     state_v_first=False, block_v=None, **fused_opts):
    """[(factory, params)] of the kernels one forward call uses (for `precompile`).

    `fused_opts` go to `build_fused_fwd_kernel` (threads, num_stages, async_mma, o_store_smem);
    `warp_specialized=True` picks `tilelang_fwd_ws.build_fused_fwd_ws_kernel` instead (same
    arguments; only block_v and num_stages apply to it), with `four_warpgroups=True` too
    `tilelang_fwd_ws4.build_fused_fwd_ws4_kernel` (the state chain over two warpgroups, for
    block_v 128, and its `o_tma`); `store_states` applies to both.
    """
    specs = _fwd_kernel_specs(H, HV, K, V, dtype, scale, is_varlen, use_initial_state, store_final_state,
                              state_v_first, block_v, tuple(sorted(fused_opts.items())))
    return [(factory, dict(params)) for factory, params in specs]


@functools.lru_cache(maxsize=1024)
def _fwd_kernel_specs(H, HV, K, V, dtype, scale, is_varlen, use_initial_state, store_final_state,
                      state_v_first, block_v, fused_opts: tuple):
    # cached: every forward call asks for the same few specs (~10 us of host time each time)
    fused_opts = dict(fused_opts)
    if block_v is None:
        block_v = 64 if V % 64 == 0 else V
    dtype = tl_dtype(dtype)
    fused = dict(
        H=H, HV=HV, K=K, V=V, dtype=dtype, scale=float(scale), is_varlen=bool(is_varlen),
        use_initial_state=bool(use_initial_state), store_final_state=bool(store_final_state),
        state_v_first=bool(state_v_first), block_v=int(block_v),
    )
    opts = {k: v for k, v in fused_opts.items() if v is not None}
    store_states = bool(opts.pop("store_states", False))
    factory = build_fused_fwd_kernel
    four_warpgroups = bool(opts.pop("four_warpgroups", False))
    o_tma = bool(opts.pop("o_tma", False))
    if o_tma and not four_warpgroups:
        raise ValueError("o_tma is an option of the four-warpgroup forward")
    if opts.pop("warp_specialized", False):
        from .tilelang_fwd_ws import build_fused_fwd_ws_kernel
        from .tilelang_fwd_ws4 import build_fused_fwd_ws4_kernel

        # of the single-warpgroup options only the ring depth applies (default 2)
        factory = build_fused_fwd_ws4_kernel if four_warpgroups else build_fused_fwd_ws_kernel
        opts = {"num_stages": opts["num_stages"]} if opts.get("num_stages", 2) != 2 else {}
        if store_states:
            opts["store_states"] = True
        if o_tma:
            opts["o_tma"] = True
    elif store_states:
        raise ValueError("store_states needs the warp-specialised forward (K <= 128)")
    fused.update(opts)
    return [
        (build_prepare_kernel, dict(H=H, HV=HV, K=K, dtype=dtype, is_varlen=bool(is_varlen))),
        (factory, fused),
    ]


def prepare_fwd(k, g, beta, cu_seqlens=None, chunk_tab=None):
    """Run the prepare kernel: returns (g_cumsum fp32 [B,T,HV], Ag [B,T,HV,64], chunk_tab)."""
    B, Tn, H, K = k.shape
    HV = g.shape[2]
    g32 = kernel_operand(g.float())
    b32 = kernel_operand(beta.float())
    g_out = torch.empty(B, Tn, HV, dtype=torch.float32, device=k.device)
    a_out = torch.empty(B, Tn, HV, CHUNK, dtype=k.dtype, device=k.device)
    varlen = cu_seqlens is not None
    kern = compile_kernel(build_prepare_kernel, H=H, HV=HV, K=K, dtype=tl_dtype(k.dtype), is_varlen=bool(varlen))
    if varlen:
        cu = cu_seqlens.to(torch.int32).contiguous()
        if chunk_tab is None:
            chunk_tab = chunk_table(cu)
        if chunk_tab.shape[0] > 0:
            kern(k, g32, b32, cu, chunk_tab, g_out, a_out)
    elif Tn > 0:
        kern(k, g32, b32, g_out, a_out)
    return g_out, a_out, chunk_tab


def tilelang_chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale=None,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens=None,
    state_v_first: bool = False,
    block_v=None,
    fused_config=None,
    partitions=None,
    cu_seqlens_host=None,
    save_states=False,
):
    """Chunked GDN forward on Hopper through TileLang.

    q, k [B,T,H,K] bf16/fp16; v [B,T,HV,V]; g (log decay), beta [B,T,HV]; states fp32
    [N,HV,K,V] ([N,HV,V,K] when state_v_first); cu_seqlens [N+1] with B == 1 for packed input.
    Returns (o [B,T,HV,V] in q.dtype, final_state fp32 or None, saved) — see the module SPEC
    for the contents of `saved`. `block_v` / `fused_config` (dict of build_fused_fwd_kernel
    options: block_v, threads, num_stages, async_mma, o_store_smem) override the default tiles.
    `partitions` ('auto', an int P, or None / 'off'): cut long sequences into partitions run
    side by side (`tilelang_split`); `cu_seqlens_host` (list or CPU tensor) spares reading
    cu_seqlens back from the GPU when splitting. `save_states`: keep each chunk's entering state
    and v - exp(G) k S in `saved` ("h_states", "vres") so that the backward does not recompute
    them (warp-specialised kernel, K <= 128; ignored otherwise).
    """
    B, Tn, H, K, HV, V = _check_inputs(q, k, v, g, beta, cu_seqlens)
    if scale is None:
        scale = K**-0.5
    q, k, v = kernel_operand(q), kernel_operand(k), kernel_operand(v)
    varlen = cu_seqlens is not None
    cu = cu_seqlens.to(torch.int32).contiguous() if varlen else None
    N = (cu.shape[0] - 1) if varlen else B

    seq_tab, seq_offsets, seq_order, plan = None, None, None, None
    if partitions not in (None, "off", 1) and max(K, V) > SPLIT_MAX_HEAD_DIM:
        if partitions != "auto":
            raise ValueError(f"intra-card split (intra_cp={partitions!r}) needs head dims <= {SPLIT_MAX_HEAD_DIM} "
                             f"on the TileLang backend, got K={K}, V={V}; use intra_cp='auto' or 'off'")
        partitions = None  # 'auto': such heads stay whole (the split's scan would not fit in shared memory)
    if partitions not in (None, "off", 1) and Tn > 0 and N > 0:
        if varlen:  # the one read-back of cu_seqlens (none when the caller passes a CPU copy)
            cu_host = cu_seqlens_host if cu_seqlens_host is not None else cu_seqlens.cpu()
            cu_host = cu_host.tolist() if torch.is_tensor(cu_host) else cu_host
        else:
            cu_host = [b * Tn for b in range(B + 1)]
        plan = plan_split(cu_host, HV, V, partitions, tilelang_common.sm_count(q.device))
        if varlen:
            tabs = plan.device_tensors(q.device)  # built from the host offsets, cached with the plan
            seq_tab, seq_offsets, seq_order = tabs["seq_chunk_table"], tabs["seq_chunk_offsets"], tabs["seq_order"]
        if plan.is_trivial:
            plan = None

    g_cum, ag, chunk_tab = prepare_fwd(k, g, beta, cu_seqlens=cu, chunk_tab=seq_tab)
    saved = {
        "g_cumsum": g_cum,
        "Ag": ag,
        "chunk_table": chunk_tab,
        "chunk_offsets": seq_offsets,
        "cu_seqlens": cu,
        "scale": float(scale),
        "state_v_first": bool(state_v_first),
    }

    cfg = dict(fused_config or {})
    if block_v is not None:
        cfg["block_v"] = int(block_v)
    if "block_v" not in cfg:  # the fused kernel's grid runs over partitions when split
        cfg.update(default_fused_config(plan.num_parts if plan else N, HV, V, tilelang_common.sm_count(q.device), K=K))
    saved["partitions"] = plan.num_parts if plan is not None else N
    if save_states and cfg.get("warp_specialized", False):
        cfg["store_states"] = True
    if plan is not None:
        o, final, split = _split_forward(q, k, v, ag, g_cum, float(scale), initial_state, output_final_state,
                                         state_v_first, plan, cfg, saved)
        saved["split"] = split  # the backward runs over the same partitions
        return o, final, saved

    sdims = (V, K) if state_v_first else (K, V)
    dev = q.device
    use_h0 = initial_state is not None
    # without an initial state the kernel is built not to read one: a placeholder, not filled (no launch)
    h0 = kernel_operand(initial_state.float()) if use_h0 else torch.empty(1, HV, *sdims, dtype=torch.float32, device=dev)
    if use_h0:
        assert tuple(h0.shape) == (N, HV, *sdims), f"initial_state must be {(N, HV, *sdims)}"
    ht = torch.empty(N, HV, *sdims, dtype=torch.float32, device=dev) if output_final_state else torch.empty(
        1, HV, *sdims, dtype=torch.float32, device=dev
    )
    o = torch.empty(B, Tn, HV, V, dtype=q.dtype, device=dev)
    factory, params = fwd_kernel_specs(
        H, HV, K, V, q.dtype, scale, varlen, use_h0, output_final_state, state_v_first, **cfg
    )[1]
    kern = compile_kernel(factory, **params)
    if Tn > 0 and N > 0:
        states = ()
        if cfg.get("store_states"):
            n_chunks = chunk_tab.shape[0] if varlen else B * (-(-Tn // CHUNK))
            states = _state_outputs(saved, n_chunks, v, K)
            if varlen:
                if saved["chunk_offsets"] is None:
                    saved["chunk_offsets"] = chunk_offsets(cu)
                states += (saved["chunk_offsets"],)
        if varlen:
            saved["walk_order"] = seq_order if seq_order is not None else walk_order(cu)
            kern(q, k, v, ag, g_cum, cu, saved["walk_order"], h0, o, ht, *states)
        else:
            kern(q, k, v, ag, g_cum, h0, o, ht, *states)
    elif output_final_state:
        ht.copy_(h0 if use_h0 else torch.zeros_like(ht))
    return o, (ht if output_final_state else None), saved


def _state_outputs(saved, n_chunks, v, K):
    """Allocate the chunk states and v residuals the fused kernel writes with store_states, keep
    them in `saved` for the backward and return them as kernel arguments."""
    B, Tn, HV, V = v.shape
    saved["h_states"] = torch.empty(n_chunks, HV, K, V, dtype=v.dtype, device=v.device)
    saved["vres"] = torch.empty(B, Tn, HV, V, dtype=v.dtype, device=v.device)
    return saved["h_states"], saved["vres"]


def _split_forward(q, k, v, ag, g_cum, scale, initial_state, output_final_state, state_v_first, plan, cfg, saved):
    """The forward with sequences cut into partitions (see `tilelang_split`), after the prepare
    kernel: (h, M) per partition, GPU scan for each partition's incoming state, then the fused
    kernel (tiles `cfg`) over the partitions. Returns (o, final state or None, saved["split"]);
    with cfg["store_states"] the chunk states go to `saved` (`_state_outputs`)."""
    B, Tn, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    N = len(plan.seq_parts) - 1
    # packed [1, B*T, ...] (B == 1 inputs already are: no reshape, each costs host time)
    qf, kf, vf, agf, gf = (x.reshape(1, B * Tn, *x.shape[2:]) if B > 1 else x for x in (q, k, v, ag, g_cum))

    idx = plan.device_tensors(dev)
    starts, dh_walk = decay_tables(gf, plan)
    h_part, m_part = state_summaries(kf, vf, agf, gf, plan, starts)
    if initial_state is not None:
        h0 = state_kv_layout(initial_state, state_v_first)
        assert tuple(h0.shape) == (N, HV, K, V), f"initial_state must hold {N} states"
    else:
        h0 = None  # every sequence enters at zero
    s_in = scan_partitions(m_part, h_part, idx["seq_parts"], h0, reverse=False, num_seqs=N)

    factory, params = fwd_kernel_specs(H, HV, K, V, q.dtype, scale, True, True, output_final_state, False, **cfg)[1]
    kern = compile_kernel(factory, **params)
    o = torch.empty(1, B * Tn, HV, V, dtype=q.dtype, device=dev)
    ht = torch.empty(plan.num_parts if output_final_state else 1, HV, K, V, dtype=torch.float32, device=dev)
    states = ()
    if cfg.get("store_states"):
        states = (*_state_outputs(saved, int(idx["part_chunk_table"].shape[0]), vf, K), idx["part_chunk_offsets"])
    kern(qf, kf, vf, agf, gf, idx["part_cu"], idx["part_order"], s_in, o, ht, *states)
    # each sequence's last partition, gathered into a tensor of its own: a slice would be cheaper
    # on the host, but would keep every partition's state alive for as long as the caller keeps the
    # final states (a prefill's cache: NP / N times the memory)
    final = state_kv_layout(ht.index_select(0, idx["last_parts"]), state_v_first) if output_final_state else None
    split = {
        "part_cu": idx["part_cu"],
        "part_chunk_table": idx["part_chunk_table"],
        "part_chunk_offsets": idx["part_chunk_offsets"],
        "part_order": idx["part_order"],
        "seq_parts": idx["seq_parts"],
        "first_parts": idx["first_parts"],
        "S_in": s_in,
        "M": m_part,
        "dh_walk_chunks": dh_walk,
    }
    return (o.reshape(B, Tn, HV, V) if B > 1 else o), final, split
