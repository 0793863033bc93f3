"""Warp-specialised backward dh walk (sm_90a): `build_bwd_dh_kernel`'s contract, a shorter chain.

Same arguments and outputs as `bwd_dh.build_bwd_dh_kernel` (docs/kernels.md). Per chunk (walked last to first) with dS' the gradient of the state leaving it:

    dvn = mask_L(P^T dO + diag(exp(GL - G)) (k dS'))        t = Ag^T dvn   (= dv)
    dS  = exp(GL) dS' + q^T (scale exp(G) dO) - k^T (exp(G) t)

The gates are applied to the small [64, BV] operands (dO, t, the k dS' rows) instead of to
scaled copies of q and k, and three warpgroups share the work:

* state (threads 0-127): dS[K, BV] in fp32 registers; stores dh (= dS' as published), then
  k dS', dvn, t, dv, and the dS update: three dependent GEMMs per chunk.
* aux (threads 128-255): the parts without dS: P = q k^T (gated, causal, scaled, rows >= L
  zero), P^T dO (fp32 into shared memory) and scale exp(G) dO, for the state warpgroup.
* loader (threads 256-383): one warp TMA-loads q, k, dO, Ag into a two-stage ring and fills G.

Whole 64-row tiles are loaded for a partial chunk (rows >= L belong to the next sequence or
are zero past the tensor); every product that could read them is masked: P rows, the dO rows
the update reads, and the dvn rows (which zero t's rows too, as Ag's columns >= L are zero).
"""

from .common import CHUNK, LOG2E, import_tilelang, tl_dtype
from .entries import bwd_dh_entry


def walked_chunks(T, n_chunks, walk_chunks, n, bhv, limit_chunks: bool):
    """The dh walk's chunk count: all `n_chunks`, or at most walk_chunks[n, bhv]."""
    return T.min(n_chunks, walk_chunks[n, bhv]) if limit_chunks else n_chunks


def build_bwd_dh_ws_kernel(H: int, HV: int, K: int, V: int, dtype: str, scale: float, use_dht: bool,
                           store_dh0: bool, block_v: int = 32, limit_chunks: bool = False):
    """PrimFunc with the signature of `build_bwd_dh_kernel` (grid V/BV x N x HV, 384 threads;
    limit_chunks as there)."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    BV = block_v
    assert HV % H == 0 and V % BV == 0 and BV % 16 == 0 and K % 64 == 0
    NV = V // BV
    scale = float(scale)
    WG = 128
    LOADER_REGS, CONSUMER_REGS = 40, 232

    @T.macro
    def walk(q, k, do, ag, gc, cu_seqlens, chunk_offsets, dht, dh_out, dvn_out, dv_out, dh0, walk_chunks, bv, n,
             bhv):
        bh = bhv // grp
        v0 = bv * BV
        s0 = cu_seqlens[n]
        seq_len = cu_seqlens[n + 1] - s0
        c_first = chunk_offsets[n]
        n_chunks = walked_chunks(T, T.ceildiv(seq_len, C), walk_chunks, n, bhv, limit_chunks)

        # two-stage ring filled by the loader
        q_s = T.alloc_shared((2, C, K), dtype)
        k_s = T.alloc_shared((2, C, K), dtype)
        do_s = T.alloc_shared((2, C, BV), dtype)
        a_s = T.alloc_shared((2, C, C), dtype)
        g_s = T.alloc_shared((2, C), acc)
        # aux -> state (single buffers, released by state_done)
        pdo_s = T.alloc_shared((C, BV), acc)
        doe_s = T.alloc_shared((C, BV), dtype)
        # private to one warpgroup
        p_s = T.alloc_shared((C, C), dtype)
        dh_s = T.alloc_shared((K, BV), dtype)
        dvn_s = T.alloc_shared((C, BV), dtype)
        tn_s = T.alloc_shared((C, BV), dtype)

        ds_f = T.alloc_fragment((K, BV), acc)
        x_f = T.alloc_fragment((C, BV), acc)
        t_f = T.alloc_fragment((C, BV), acc)
        p_f = T.alloc_fragment((C, C), acc)
        pdo_f = T.alloc_fragment((C, BV), acc)
        doe_f = T.alloc_fragment((C, BV), acc)
        glast = T.alloc_var(acc)

        data_ready = T.alloc_barrier(arrive_count=[32, 32])
        data_free = T.alloc_barrier(arrive_count=[2 * WG, 2 * WG])
        aux_ready = T.alloc_barrier(arrive_count=WG)
        state_done = T.alloc_barrier(arrive_count=WG)

        tx = T.get_thread_binding()

        if tx < WG:
            # ---- state warpgroup ----
            T.set_max_nreg(CONSUMER_REGS, 1)
            if use_dht:
                T.copy(dht[n, bhv, :, v0 : v0 + BV], ds_f)
            else:
                T.clear(ds_f)
            for cc in T.serial(n_chunks):
                s = cc % 2
                c = n_chunks - 1 - cc
                t0 = s0 + c * C
                L = T.min(seq_len - c * C, C)
                T.barrier_wait(data_ready[s], (cc // 2) % 2)
                # dh of this chunk: the gradient of the state leaving it (not stored by the
                # limited walk, which only wants dh0)
                if not limit_chunks:
                    for i, j in T.Parallel(K, BV):
                        dh_out[c_first + c, bhv, i, v0 + j] = ds_f[i, j]
                T.copy(ds_f, dh_s)
                T.fence_proxy_async()
                T.gemm(k_s[s, :, :], dh_s, x_f, clear_accum=True)
                glast = g_s[s, C - 1]  # padding rows repeat the last valid G
                T.barrier_wait(aux_ready, cc % 2)
                # gate, row mask, store: three loops (the elementwise rule, hopper/common.py)
                for i, j in T.Parallel(C, BV):
                    x_f[i, j] = x_f[i, j] * T.exp2((glast - g_s[s, i]) * LOG2E) + pdo_s[i, j]
                for i, j in T.Parallel(C, BV):
                    x_f[i, j] = T.if_then_else(i < L, x_f[i, j], T.float32(0))
                T.copy(x_f, dvn_s)
                T.fence_proxy_async()
                if not limit_chunks:
                    for i, j in T.Parallel(C, BV):
                        if i < L:
                            dvn_out[0, t0 + i, bhv, v0 + j] = x_f[i, j]
                # dv = t = Ag^T dvn
                T.gemm(a_s[s, :, :], dvn_s, t_f, transpose_A=True, clear_accum=True)
                if not limit_chunks:
                    for i, j in T.Parallel(C, BV):
                        if i < L:
                            dv_out[0, t0 + i, bhv, v0 + j] = t_f[i, j]
                for i, j in T.Parallel(C, BV):
                    t_f[i, j] = -t_f[i, j] * T.exp2(g_s[s, i] * LOG2E)
                T.copy(t_f, tn_s)
                T.fence_proxy_async()
                # dS = exp(GL) dS' + q^T (scale exp(G) dO) - k^T (exp(G) t)
                for i, j in T.Parallel(K, BV):
                    ds_f[i, j] = ds_f[i, j] * T.exp2(glast * LOG2E)
                T.gemm(q_s[s, :, :], doe_s, ds_f, transpose_A=True)
                T.gemm(k_s[s, :, :], tn_s, ds_f, transpose_A=True)
                T.barrier_arrive(state_done)
                T.barrier_arrive(data_free[s])
            if store_dh0:
                T.copy(ds_f, dh0[n, bhv, :, v0 : v0 + BV])
        elif tx < 2 * WG:
            # ---- aux warpgroup ----
            T.set_max_nreg(CONSUMER_REGS, 1)
            for cc in T.serial(n_chunks):
                s = cc % 2
                c = n_chunks - 1 - cc
                L = T.min(seq_len - c * C, C)
                T.barrier_wait(data_ready[s], (cc // 2) % 2)
                T.gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True, clear_accum=True)
                # gated, masked, stored (the elementwise rule, hopper/common.py); G falls along
                # the chunk, so the clamp only touches masked entries
                for i, j in T.Parallel(C, C):
                    p_f[i, j] = p_f[i, j] * T.exp2(T.min(g_s[s, i] - g_s[s, j], T.float32(0)) * LOG2E)
                for i, j in T.Parallel(C, C):
                    p_f[i, j] = T.if_then_else((i >= j) and (i < L), p_f[i, j] * scale, T.float32(0))
                T.copy(p_f, p_s)
                T.fence_proxy_async()
                T.gemm(p_s, do_s[s, :, :], pdo_f, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, BV):
                    doe_f[i, j] = do_s[s, i, j] * (T.exp2(g_s[s, i] * LOG2E) * scale)
                for i, j in T.Parallel(C, BV):
                    doe_f[i, j] = T.if_then_else(i < L, doe_f[i, j], T.float32(0))
                T.barrier_wait(state_done, (cc + 1) % 2)  # chunk cc-1's reads are done
                T.copy(pdo_f, pdo_s)
                T.copy(doe_f, doe_s)
                T.fence_proxy_async()
                T.barrier_arrive(aux_ready)
                T.barrier_arrive(data_free[s])
        else:
            # ---- loader: one warp issues the loads ----
            T.set_max_nreg(LOADER_REGS, 0)
            if tx < 2 * WG + 32:
                for cc in T.serial(n_chunks):
                    s = cc % 2
                    c = n_chunks - 1 - cc
                    t0 = s0 + c * C
                    L = T.min(seq_len - c * C, C)
                    T.barrier_wait(data_free[s], (cc // 2 + 1) % 2)
                    T.tma_copy(q[0, t0 : t0 + C, bh, :], q_s[s, :, :], barrier=data_ready[s])
                    T.tma_copy(k[0, t0 : t0 + C, bh, :], k_s[s, :, :], barrier=data_ready[s])
                    T.tma_copy(do[0, t0 : t0 + C, bhv, v0 : v0 + BV], do_s[s, :, :], barrier=data_ready[s])
                    T.tma_copy(ag[0, t0 : t0 + C, bhv, :], a_s[s, :, :], barrier=data_ready[s])
                    for i in T.Parallel(C):
                        g_s[s, i] = gc[0, t0 + T.min(i, L - 1), bhv]
                    T.barrier_arrive(data_ready[s])

    return bwd_dh_entry(walk, H, HV, K, V, dtype, NV, 3 * WG, limit_chunks)
