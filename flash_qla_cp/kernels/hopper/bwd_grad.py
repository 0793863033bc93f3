"""Grad kernel (sm_90a): every chunk's dq, dk, dg and dbeta from the two walks' states.

Grid (NC, H), 256 threads: one block per chunk and qk-head walks the HV / H v-heads of that
head in order, so q and k are read once and dq, dk accumulate on chip and are written once in
the input dtype; dg (already reverse-cumsummed inside the chunk) and dbeta in fp32. Whole
chunks are loaded by one warp's TMA copies and waited for once. Per v-head:

    dq  += scale E dO S^T + Pm k
    dk  += -E t S^T + diag(exp(GL - G)) v_new dS'^T + Pm^T q + dKK k + dKK^T k
    dAg, dKK, Pm, dg and dbeta: the C x C steps of `bwd_chunk_terms`

Head dims past 128 do not fit (529 KB of shared memory at K = V = 256): `bwd_grad_wide`.
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from .bwd_chunk_terms import chunk_terms
from .common import CHUNK, LOG2E, import_tilelang, tl_dtype


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
        g: T.Tensor((1, Ttot, HV), acc),
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

                store_dg_dbeta(r_q, r_kw, r_kd, r_1r, r_1c, r_2r, r_2c, r_ab, sc_s, dg_s, b_s, g, dg_out, db_out, t0,
                               bhv, L)

            if L == C:
                T.copy(dq_f, dq_out[0, t0 : t0 + C, bh, :])
                T.copy(dk_f, dk_out[0, t0 : t0 + C, bh, :])
            else:
                for i, d in T.Parallel(C, K):
                    if i < L:
                        dq_out[0, t0 + i, bh, d] = dq_f[i, d]
                        dk_out[0, t0 + i, bh, d] = dk_f[i, d]

    return gdn_bwd_grad_group
