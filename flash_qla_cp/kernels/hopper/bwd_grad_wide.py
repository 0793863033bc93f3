"""Every chunk's dq / dk / dg / dbeta for head dims past 128, one block per (chunk, v-head).

The grad kernel of `bwd_grad.py` keeps whole K x V states and 64 x V tiles in shared
memory: 529 KB at K = V = 256, over the 227 KB a block may have. This one walks V in slices of
`block_v`: each slice brings its columns of do, vres, dvn and of the two states S (entering the
chunk) and dS' (the gradient of the state leaving it), and adds its share to every product that
contracts over V:

  dAg += dvn vres^T,  Pm += dO v_new^T,  dq += dO S^T,  dk += -E t S^T + exp(GL - G) v_new dS'^T

(v_new = Ag vres and t = Ag^T dvn are formed per slice), and to the row sums that dg needs
(q . (dO S^T) as rowsum(dO o q S), and likewise for the two dk terms), so that no K x V tile and
no second C x K accumulator is ever held. After the slices, the C x C part is the grad kernel's
(`bwd_chunk_terms`): dKK from dAg, the decay gates, dbeta, the reverse cumulative sum of
dg, and Pm k, Pm^T q, dKK k, dKK^T k into dq and dk.

dq / dk come out per v-head ([1, T, HV, K], the input dtype); with HV > H the caller sums each
qk-head's v-heads (`v_head_sum.py`), as after the fused walk.
"""

from .bwd_chunk_terms import chunk_terms
from .common import CHUNK, LOG2E, import_tilelang, tl_dtype


def build_bwd_grad_wide_kernel(H: int, HV: int, K: int, V: int, dtype: str, scale: float, block_v: int = 64,
                               threads: int = 256):
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    BV = block_v
    RS = 32  # rows per slice of the <S, dS'> sum
    assert HV % H == 0 and K % RS == 0 and V % BV == 0 and BV % 16 == 0
    scale = float(scale)
    dag_terms, dkk_terms, pm_terms, store_dg_dbeta = chunk_terms(T, scale)

    Ttot = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N1 = T.dynamic("num_seqs_plus_one")

    @T.prim_func
    def gdn_bwd_grad_wide(
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
        dq_part: T.Tensor((1, Ttot, HV, K), dtype),
        dk_part: T.Tensor((1, Ttot, HV, K), dtype),
        dg_out: T.Tensor((1, Ttot, HV), acc),
        db_out: T.Tensor((1, Ttot, HV), acc),
    ):
        with T.Kernel(NC, HV, threads=threads) as (bc, bhv):
            bh = bhv // grp
            n = chunk_tab[bc, 0]
            t0 = cu_seqlens[n] + chunk_tab[bc, 1] * C
            L = T.min(cu_seqlens[n + 1] - t0, C)

            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            a_s = T.alloc_shared((C, C), dtype)
            do_s = T.alloc_shared((C, BV), dtype)
            vr_s = T.alloc_shared((C, BV), dtype)
            dvn_s = T.alloc_shared((C, BV), dtype)
            vn_s = T.alloc_shared((C, BV), dtype)  # v_new
            vt_s = T.alloc_shared((C, BV), dtype)  # exp(GL - G) v_new (valid rows)
            tn_s = T.alloc_shared((C, BV), dtype)  # -E t
            h_s = T.alloc_shared((K, BV), dtype)
            dh_s = T.alloc_shared((K, BV), dtype)
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

            dq_f = T.alloc_fragment((C, K), acc)
            dk_f = T.alloc_fragment((C, K), acc)
            dag_f = T.alloc_fragment((C, C), acc)
            pm_f = T.alloc_fragment((C, C), acc)
            cv_f = T.alloc_fragment((C, BV), acc)
            cc_f = T.alloc_fragment((C, C), acc)
            kk_f = T.alloc_fragment((C, C), acc)
            x_f = T.alloc_fragment((C, C), acc)
            hd_f = T.alloc_fragment((RS, BV), acc)
            rq_f = T.alloc_fragment((C,), acc)
            rkw_f = T.alloc_fragment((C,), acc)
            rkd_f = T.alloc_fragment((C,), acc)
            row_f = T.alloc_fragment((C,), acc)
            col_f = T.alloc_fragment((C,), acc)
            hrow_f = T.alloc_fragment((RS,), acc)
            one_f = T.alloc_fragment((1,), acc)
            glast = T.alloc_var(acc)

            # padding rows of a short last chunk: zero (q, k, do, vres, dvn, Ag, beta); G keeps
            # the last valid row's value
            for i, d in T.Parallel(C, K):
                q_s[i, d] = T.if_then_else(i < L, q[0, t0 + T.min(i, L - 1), bh, d], T.cast(0, dtype))
                k_s[i, d] = T.if_then_else(i < L, k[0, t0 + T.min(i, L - 1), bh, d], T.cast(0, dtype))
            for i, j in T.Parallel(C, C):
                a_s[i, j] = T.if_then_else(i < L, ag[0, t0 + T.min(i, L - 1), bhv, j], T.cast(0, dtype))
            for i in T.Parallel(C):
                g_s[i] = gc[0, t0 + T.min(i, L - 1), bhv]
                b_s[i] = T.if_then_else(i < L, beta[0, t0 + T.min(i, L - 1), bhv], T.float32(0))
            glast = g_s[C - 1]
            T.clear(dq_f)
            T.clear(dk_f)
            T.clear(dag_f)
            T.clear(pm_f)
            T.clear(hd_f)
            T.clear(rq_f)
            T.clear(rkw_f)
            T.clear(rkd_f)

            for iv in T.serial(V // BV):
                v0 = iv * BV
                for i, d in T.Parallel(C, BV):
                    do_s[i, d] = T.if_then_else(i < L, do[0, t0 + T.min(i, L - 1), bhv, v0 + d], T.cast(0, dtype))
                    vr_s[i, d] = T.if_then_else(i < L, vres[0, t0 + T.min(i, L - 1), bhv, v0 + d], T.cast(0, dtype))
                    dvn_s[i, d] = T.if_then_else(i < L, dvn[0, t0 + T.min(i, L - 1), bhv, v0 + d], T.cast(0, dtype))
                T.copy(h[bc, bhv, :, v0 : v0 + BV], h_s)
                T.copy(dh[bc, bhv, :, v0 : v0 + BV], dh_s)

                # v_new = Ag vres, and its rows scaled by exp(GL - G) (zero past L) for dS'
                T.gemm(a_s, vr_s, cv_f, clear_accum=True)
                T.copy(cv_f, vn_s)
                for i, d in T.Parallel(C, BV):
                    cv_f[i, d] = T.if_then_else(i < L, cv_f[i, d] * T.exp2((glast - g_s[i]) * LOG2E), T.float32(0))
                T.copy(cv_f, vt_s)
                # -E t, t = Ag^T dvn
                T.gemm(a_s, dvn_s, cv_f, transpose_A=True, clear_accum=True)
                for i, d in T.Parallel(C, BV):
                    cv_f[i, d] = -cv_f[i, d] * T.exp2(g_s[i] * LOG2E)
                T.copy(cv_f, tn_s)

                # the products that contract over V
                T.gemm(dvn_s, vr_s, dag_f, transpose_B=True)
                T.gemm(do_s, vn_s, pm_f, transpose_B=True)
                T.gemm(do_s, h_s, dq_f, transpose_B=True)
                T.gemm(tn_s, h_s, dk_f, transpose_B=True)
                T.gemm(vt_s, dh_s, dk_f, transpose_B=True)

                # row sums for dg: q . (dO S^T) = rowsum(dO o (q S)), and the two dk terms with k
                T.gemm(q_s, h_s, cv_f, clear_accum=True)
                for i, d in T.Parallel(C, BV):
                    cv_f[i, d] = cv_f[i, d] * do_s[i, d]
                T.reduce_sum(cv_f, rq_f, dim=1, clear=False)
                T.gemm(k_s, h_s, cv_f, clear_accum=True)
                for i, d in T.Parallel(C, BV):
                    cv_f[i, d] = cv_f[i, d] * tn_s[i, d]
                T.reduce_sum(cv_f, rkw_f, dim=1, clear=False)
                T.gemm(k_s, dh_s, cv_f, clear_accum=True)
                for i, d in T.Parallel(C, BV):
                    cv_f[i, d] = cv_f[i, d] * vt_s[i, d]
                T.reduce_sum(cv_f, rkd_f, dim=1, clear=False)
                # <S, dS'>
                for sl in T.serial(K // RS):
                    for i, d in T.Parallel(RS, BV):
                        hd_f[i, d] += T.cast(h_s[sl * RS + i, d], acc) * T.cast(dh_s[sl * RS + i, d], acc)

            # scale E on the dq rows (and on their row sums)
            for i, d in T.Parallel(C, K):
                dq_f[i, d] = dq_f[i, d] * (T.exp2(g_s[i] * LOG2E) * scale)
            for i in T.Parallel(C):
                r_q[i] = rq_f[i] * (T.exp2(g_s[i] * LOG2E) * scale)
            T.copy(rkw_f, r_kw)
            T.copy(rkd_f, r_kd)
            T.reduce_sum(rkd_f, one_f, dim=0)
            sc_s[1] = one_f[0]
            T.reduce_sum(hd_f, hrow_f, dim=1)
            T.reduce_sum(hrow_f, one_f, dim=0)
            sc_s[0] = one_f[0] * T.exp2(glast * LOG2E)

            # the C x C terms (bwd_chunk_terms): dAg, dKK with k k^T, Pm with q k^T
            dag_terms(dag_f, x_f, a_s, m1_s, col_f, r_ab)
            T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
            dkk_terms(cc_f, dag_f, x_f, kk_f, a_s, m1_s, m2_s, g_s, row_f, col_f, r_2r, r_2c)
            T.gemm(q_s, k_s, cc_f, transpose_B=True, clear_accum=True)
            pm_terms(pm_f, x_f, cc_f, g_s, m1_s, row_f, col_f, r_1r, r_1c)

            # dq += Pm k;  dk += Pm^T q + dKK k + dKK^T k
            T.gemm(m1_s, k_s, dq_f)
            T.gemm(m1_s, q_s, dk_f, transpose_A=True)
            T.gemm(m2_s, k_s, dk_f)
            T.gemm(m2_s, k_s, dk_f, transpose_A=True)

            store_dg_dbeta(r_q, r_kw, r_kd, r_1r, r_1c, r_2r, r_2c, r_ab, sc_s, dg_s, b_s, g, dg_out, db_out, t0, bhv,
                           L)
            for i, d in T.Parallel(C, K):
                if i < L:
                    dq_part[0, t0 + i, bhv, d] = dq_f[i, d]
                    dk_part[0, t0 + i, bhv, d] = dk_f[i, d]

    return gdn_bwd_grad_wide
