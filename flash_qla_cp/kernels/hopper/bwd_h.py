"""Backward h walk, one warpgroup (sm_90a): the chunk states the backward needs, recomputed.

Grid (V / block_v, N, HV), 128 threads, one block walks one sequence (or partition) forward
with S[K, block_v] in fp32 registers and writes, per chunk, h [NC, HV, K, V] (the state
entering it, input dtype) and vres [1, T, HV, V] = v - exp(G) k S. `bwd_h_ws` has the same
contract with the loads off the chain; this one runs where that one does not pay (the split
backward's many short partitions) or does not fit (K > 128).
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from .common import CHUNK, LOG2E, import_tilelang, tl_dtype
from .entries import bwd_h_entry


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
        # loads, masks and shared stores in loops of their own (the elementwise rule, hopper/common.py)
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
