"""Backward dh walk, one warpgroup (sm_90a): the reverse recurrence of the state gradient.

Grid (V / block_v, N, HV), 128 threads, one block walks one sequence (or partition) from its
last chunk with dS[K, block_v] in fp32 registers (S' the state leaving a chunk):

    dvn = P^T dO + diag(exp(GL - G)) k dS'          (gradient of v_new)
    dv  = Ag^T dvn
    dS  = exp(GL) dS' + (scale E q)^T dO - (E k)^T dv

and writes dh [NC, HV, K, V] (dS' of each chunk), dvn, dv and dh0. `bwd_dh_ws` has the same
contract (and the split backward's chunk-limited variant); this one runs the head dims past
128, where only its tiles fit.
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from .common import CHUNK, LOG2E, import_tilelang, tl_dtype
from .entries import bwd_dh_entry


def build_bwd_dh_kernel(H: int, HV: int, K: int, V: int, dtype: str, scale: float, use_dht: bool,
                        store_dh0: bool, block_v: int = 64, threads: int = 128):
    """Reverse walk over the chunks of each sequence (grid V/BV x N x HV)."""
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
        # dh of this chunk = gradient of the state leaving it
        T.copy(ds_f, dh_s)
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
        n_chunks = T.ceildiv(seq_len, C)

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

    return bwd_dh_entry(walk, H, HV, K, V, dtype, NV, threads)
