"""Fused backward walk (sm_90a; off by default, FUSED_WALK): the dh walk and every per-chunk
gradient in one kernel.

One block per (sequence or partition, v-head) walks its chunks last to first with the whole
state gradient dS [K, V] in fp32 registers, and per chunk forms dv, dq, dk, dg and dbeta from
tiles that stay on chip: the per-chunk formulas of `reference_backward.py` (its docstring),
which are those of the three-kernel backward in `tilelang_bwd_impl.py`. dh, dvn and the
64 x 64 intermediates never reach memory; the chunk states h and vres come from the h walk.
dq and dk are written per v-head (dq_part / dk_part [1, T, HV, K], dtype) and summed over each
qk-head's v-heads afterwards (`_fused_walk` in tilelang_bwd_impl.py; with HV == H they are dq, dk).

Loads: the next chunk of a walk is always whole (only a sequence's or partition's last chunk,
walked first, can be partial), so one warp issues its tiles as TMA copies as soon as the last
reader of each buffer is done (Ag and vres after X, h and dO after the first dk GEMM, q and k
after the dS update), all on one mbarrier the block waits on at the next chunk's start. The
walk's first chunk is loaded the same way when whole and element-wise when partial.

Arguments: q, k [1,T,H,K]; do, vres [1,T,HV,V]; ag [1,T,HV,64] (dtype); gc, beta [1,T,HV]
fp32; h [NC,HV,K,V] dtype (state entering each chunk); cu_seqlens, chunk_offsets [N+1] int32;
dht [NT,HV,K,V] fp32 (gradient of each sequence's final state; read when use_dht); outputs
dq_part, dk_part [1,T,HV,K] dtype, dv [1,T,HV,V] dtype, dg, db [1,T,HV] fp32 (dg already
reverse-cumsummed inside the chunk), dh0 [N0,HV,K,V] fp32 (written when store_dh0).

Whole 64-row tiles are read with rows >= L clamped to the chunk's last row and then zeroed, so
partial chunks need no other masking than the causal ones (padding rows carry q = k = v = 0,
beta = 0 and repeat G[L-1], as in the SPEC).
"""

from .tilelang_common import CHUNK, import_tilelang, tl_dtype

LOG2E = 1.4426950408889634


def build_bwd_fused_walk_kernel(H: int, HV: int, K: int, V: int, dtype: str, scale: float, use_dht: bool,
                                store_dh0: bool, threads: int = 256):
    """PrimFunc `gdn_bwd_fused` (grid N x HV; see the module docstring)."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    scale = float(scale)
    assert HV % H == 0 and K % 32 == 0 and V % 16 == 0 and K <= 128 and V <= 128
    RS = 32  # rows per slice of the <S, dS'> reduction

    Ttot = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N1 = T.dynamic("num_seqs_plus_one")
    NT = T.dynamic("n_dht")
    N0 = T.dynamic("n_dh0")

    @T.macro
    def load_rows(src, dst, t0, L, head, width):
        # rows >= L: the chunk's last row (clamped, no load under a condition), zeroed below
        for i, d in T.Parallel(C, width):
            dst[i, d] = src[0, t0 + T.min(i, L - 1), head, d]
        for i, d in T.Parallel(C, width):
            if i >= L:
                dst[i, d] = T.cast(0, dtype)

    @T.prim_func
    def gdn_bwd_fused(
        q: T.Tensor((1, Ttot, H, K), dtype),
        k: T.Tensor((1, Ttot, H, K), dtype),
        do: T.Tensor((1, Ttot, HV, V), dtype),
        vres: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        beta: T.Tensor((1, Ttot, HV), acc),
        h: T.Tensor((NC, HV, K, V), dtype),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        dht: T.Tensor((NT, HV, K, V), acc),
        dq_part: T.Tensor((1, Ttot, HV, K), dtype),
        dk_part: T.Tensor((1, Ttot, HV, K), dtype),
        dv: T.Tensor((1, Ttot, HV, V), dtype),
        dg: T.Tensor((1, Ttot, HV), acc),
        db: T.Tensor((1, Ttot, HV), acc),
        dh0: T.Tensor((N0, HV, K, V), acc),
    ):
        with T.Kernel(N1 - 1, HV, threads=threads) as (n, bhv):
            bh = bhv // grp
            s0 = cu_seqlens[n]
            seq_len = cu_seqlens[n + 1] - s0
            c_first = chunk_offsets[n]
            n_chunks = T.ceildiv(seq_len, C)

            # inputs of one chunk (TMA targets from the second chunk walked on)
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            do_s = T.alloc_shared((C, V), dtype)
            vr_s = T.alloc_shared((C, V), dtype)
            a_s = T.alloc_shared((C, C), dtype)
            h_s = T.alloc_shared((K, V), dtype)
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            # on-chip intermediates
            dh_s = T.alloc_shared((K, V), dtype)  # dS' (gradient of the state leaving the chunk)
            dvn_s = T.alloc_shared((C, V), dtype)  # dvn, then scale exp(G) dO for the dS update
            te_s = T.alloc_shared((C, V), dtype)  # -exp(G) t
            vn_s = T.alloc_shared((C, V), dtype)  # v_new
            m1_s = T.alloc_shared((C, C), dtype)  # P, then dAg, then Pm
            m2_s = T.alloc_shared((C, C), dtype)  # dAg Ag^T, then X
            # row / column sums for dG and dbeta: 0 colsum(dAg o Ag), 1 / 2 row / col of X o kk^T,
            # 3 / 4 row / col of Pm o qk^T, 5 the q term, 6 the -E t S^T term, 7 the v_new dS'^T term
            r_s = T.alloc_shared((8, C), acc)
            dg_s = T.alloc_shared((C,), acc)
            sc_s = T.alloc_shared((2,), acc)

            ds_f = T.alloc_fragment((K, V), acc)
            qk_f = T.alloc_fragment((C, C), acc)
            kk_f = T.alloc_fragment((C, C), acc)
            cc_f = T.alloc_fragment((C, C), acc)
            x_f = T.alloc_fragment((C, C), acc)
            cv_f = T.alloc_fragment((C, V), acc)
            dq_f = T.alloc_fragment((C, K), acc)
            dk_f = T.alloc_fragment((C, K), acc)
            tmp_f = T.alloc_fragment((C, K), acc)
            hd_f = T.alloc_fragment((RS, V), acc)
            hrow_f = T.alloc_fragment((RS,), acc)
            row_f = T.alloc_fragment((C,), acc)
            col_f = T.alloc_fragment((C,), acc)
            one_f = T.alloc_fragment((1,), acc)
            glast = T.alloc_var(acc)
            tiles_ready = T.alloc_barrier(arrive_count=32)  # one warp's arrivals + the TMA bytes
            parity = T.alloc_var("int32")
            tx = T.get_thread_binding()

            if use_dht:
                T.copy(dht[n, bhv, :, :], ds_f)
            else:
                T.clear(ds_f)
            parity = 0

            # the walk's first chunk (the sequence's last): TMA when whole, element-wise when not
            if n_chunks > 0:
                t_first = s0 + (n_chunks - 1) * C
                L_first = seq_len - (n_chunks - 1) * C
                if L_first == C:
                    if tx < 32:
                        T.tma_copy(q[0, t_first : t_first + C, bh, :], q_s, barrier=tiles_ready)
                        T.tma_copy(k[0, t_first : t_first + C, bh, :], k_s, barrier=tiles_ready)
                        T.tma_copy(do[0, t_first : t_first + C, bhv, :], do_s, barrier=tiles_ready)
                        T.tma_copy(vres[0, t_first : t_first + C, bhv, :], vr_s, barrier=tiles_ready)
                        T.tma_copy(ag[0, t_first : t_first + C, bhv, :], a_s, barrier=tiles_ready)
                        T.tma_copy(h[c_first + n_chunks - 1, bhv, :, :], h_s, barrier=tiles_ready)
                        T.barrier_arrive(tiles_ready)
                else:
                    load_rows(q, q_s, t_first, L_first, bh, K)
                    load_rows(k, k_s, t_first, L_first, bh, K)
                    load_rows(do, do_s, t_first, L_first, bhv, V)
                    load_rows(vres, vr_s, t_first, L_first, bhv, V)
                    load_rows(ag, a_s, t_first, L_first, bhv, C)
                    T.copy(h[c_first + n_chunks - 1, bhv, :, :], h_s)

            for cc in T.serial(n_chunks):
                c = n_chunks - 1 - cc
                t0 = s0 + c * C
                L = T.min(seq_len - c * C, C)
                cidx = c_first + c
                tn = t0 - C  # the next chunk walked (whole), prefetched below when cc + 1 < n_chunks

                T.sync_threads()  # the previous chunk's g, beta and row sums are read by everyone
                if L == C:
                    T.barrier_wait(tiles_ready, parity)
                    parity = 1 - parity
                for i in T.Parallel(C):
                    g_s[i] = gc[0, t0 + T.min(i, L - 1), bhv]
                    b_s[i] = T.if_then_else(i < L, beta[0, t0 + T.min(i, L - 1), bhv], T.float32(0))
                T.copy(ds_f, dh_s)
                glast = g_s[C - 1]
                # three independent products, one wait (q k^T and k k^T stay for the dG terms)
                T.wgmma_gemm(q_s, k_s, qk_f, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
                T.gemm(k_s, dh_s, cv_f, clear_accum=True)

                # exp(GL) <S, dS'> (S = h, the state entering the chunk), in row slices
                T.clear(hd_f)
                for sl in T.serial(K // RS):
                    for i, d in T.Parallel(RS, V):
                        hd_f[i, d] += T.cast(h_s[sl * RS + i, d], acc) * T.cast(dh_s[sl * RS + i, d], acc)
                T.reduce_sum(hd_f, hrow_f, dim=1)
                T.reduce_sum(hrow_f, one_f, dim=0)
                sc_s[0] = one_f[0] * T.exp2(glast * LOG2E)

                # P = scale tril_incl(q k^T o Gam) -> m1_s.
                # Gate, mask, store in loops of their own (the elementwise rule, tilelang_common);
                # G falls along the chunk, so the clamp changes only masked entries.
                for i, j in T.Parallel(C, C):
                    cc_f[i, j] = qk_f[i, j] * T.exp2(T.min(g_s[i] - g_s[j], T.float32(0)) * LOG2E) * scale
                for i, j in T.Parallel(C, C):
                    cc_f[i, j] = T.if_then_else(i >= j, cc_f[i, j], T.float32(0))
                T.copy(cc_f, m1_s)

                # dvn = P^T dO + diag(exp(GL - G)) k dS'  (rows >= L zero)
                for i, d in T.Parallel(C, V):
                    cv_f[i, d] = cv_f[i, d] * T.exp2((glast - g_s[i]) * LOG2E)
                T.gemm(m1_s, do_s, cv_f, transpose_A=True)
                for i, d in T.Parallel(C, V):
                    cv_f[i, d] = T.if_then_else(i < L, cv_f[i, d], T.float32(0))
                T.copy(cv_f, dvn_s)

                # t = Ag^T dvn (= dv); te = -exp(G) t
                T.gemm(a_s, dvn_s, cv_f, transpose_A=True, clear_accum=True)
                for i, d in T.Parallel(C, V):
                    if i < L:
                        dv[0, t0 + i, bhv, d] = cv_f[i, d]
                for i, d in T.Parallel(C, V):
                    cv_f[i, d] = -cv_f[i, d] * T.exp2(g_s[i] * LOG2E)
                T.copy(cv_f, te_s)

                # v_new = Ag vres in flight with dAg = tril_incl(dvn vres^T); colsum(dAg o Ag)
                # feeds dbeta
                T.wgmma_gemm(a_s, vr_s, cv_f, clear_accum=True)
                T.gemm(dvn_s, vr_s, cc_f, transpose_B=True, clear_accum=True)
                T.copy(cv_f, vn_s)
                for i, j in T.Parallel(C, C):
                    cc_f[i, j] = T.if_then_else(i >= j, cc_f[i, j], T.float32(0))
                T.copy(cc_f, m1_s)
                for i, j in T.Parallel(C, C):
                    x_f[i, j] = cc_f[i, j] * a_s[i, j]
                T.reduce_sum(x_f, col_f, dim=0)
                T.copy(col_f, r_s[0, :])

                # X = -(Ag^T dAg Ag^T) o Gam, strictly lower (= diag(beta) dA o Gam)
                T.gemm(m1_s, a_s, cc_f, transpose_B=True, clear_accum=True)
                T.copy(cc_f, m2_s)
                T.gemm(a_s, m2_s, x_f, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    x_f[i, j] = -x_f[i, j] * T.exp2(T.min(g_s[i] - g_s[j], T.float32(0)) * LOG2E)
                for i, j in T.Parallel(C, C):
                    x_f[i, j] = T.if_then_else(i > j, x_f[i, j], T.float32(0))
                    cc_f[i, j] = x_f[i, j] * kk_f[i, j]
                T.copy(x_f, m2_s)
                T.reduce_sum(cc_f, row_f, dim=1)
                T.reduce_sum(cc_f, col_f, dim=0)
                T.copy(row_f, r_s[1, :])
                T.copy(col_f, r_s[2, :])

                # Ag and vres have had their last readers: the next chunk's start loading
                if cc + 1 < n_chunks:
                    T.sync_threads()
                    if tx < 32:
                        T.fence_proxy_async()
                        T.tma_copy(ag[0, tn : tn + C, bhv, :], a_s, barrier=tiles_ready)
                        T.tma_copy(vres[0, tn : tn + C, bhv, :], vr_s, barrier=tiles_ready)

                # Pm = scale tril_incl(dO v_new^T o Gam) -> m1_s; Pm o q k^T feeds dG
                T.gemm(do_s, vn_s, cc_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    cc_f[i, j] = cc_f[i, j] * T.exp2(T.min(g_s[i] - g_s[j], T.float32(0)) * LOG2E) * scale
                for i, j in T.Parallel(C, C):
                    cc_f[i, j] = T.if_then_else(i >= j, cc_f[i, j], T.float32(0))
                    x_f[i, j] = cc_f[i, j] * qk_f[i, j]
                T.copy(cc_f, m1_s)
                T.reduce_sum(x_f, row_f, dim=1)
                T.reduce_sum(x_f, col_f, dim=0)
                T.copy(row_f, r_s[3, :])
                T.copy(col_f, r_s[4, :])

                # dq = scale E dO S^T + Pm k
                T.gemm(do_s, h_s, dq_f, transpose_B=True, clear_accum=True)
                for i, d in T.Parallel(C, K):
                    dq_f[i, d] = dq_f[i, d] * (T.exp2(g_s[i] * LOG2E) * scale)
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = dq_f[i, d] * q_s[i, d]
                T.reduce_sum(tmp_f, row_f, dim=1)
                T.copy(row_f, r_s[5, :])
                T.gemm(m1_s, k_s, dq_f)
                for i, d in T.Parallel(C, K):
                    if i < L:
                        dq_part[0, t0 + i, bhv, d] = dq_f[i, d]
                # scale exp(G) dO for the dS update, into dvn's tile (free since dAg): dO is done
                for i, d in T.Parallel(C, V):
                    cv_f[i, d] = T.cast(do_s[i, d], acc) * (T.exp2(g_s[i] * LOG2E) * scale)
                T.copy(cv_f, dvn_s)

                # dk = -E t S^T + diag(exp(GL - G)) v_new dS'^T + Pm^T q + X k + X^T k
                T.gemm(te_s, h_s, dk_f, transpose_B=True, clear_accum=True)
                # h and dO have had their last readers
                if cc + 1 < n_chunks:
                    T.sync_threads()
                    if tx < 32:
                        T.fence_proxy_async()
                        T.tma_copy(h[cidx - 1, bhv, :, :], h_s, barrier=tiles_ready)
                        T.tma_copy(do[0, tn : tn + C, bhv, :], do_s, barrier=tiles_ready)
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = dk_f[i, d] * k_s[i, d]
                T.reduce_sum(tmp_f, row_f, dim=1)
                T.copy(row_f, r_s[6, :])
                T.gemm(vn_s, dh_s, tmp_f, transpose_B=True, clear_accum=True)
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = tmp_f[i, d] * T.exp2((glast - g_s[i]) * LOG2E)
                for i, d in T.Parallel(C, K):
                    dk_f[i, d] = dk_f[i, d] + tmp_f[i, d]
                for i, d in T.Parallel(C, K):
                    tmp_f[i, d] = tmp_f[i, d] * k_s[i, d]
                T.reduce_sum(tmp_f, row_f, dim=1)
                T.copy(row_f, r_s[7, :])
                T.reduce_sum(row_f, one_f, dim=0)
                sc_s[1] = one_f[0]
                T.wgmma_gemm(m1_s, q_s, dk_f, transpose_A=True)
                T.wgmma_gemm(m2_s, k_s, dk_f)
                T.gemm(m2_s, k_s, dk_f, transpose_A=True)
                for i, d in T.Parallel(C, K):
                    if i < L:
                        dk_part[0, t0 + i, bhv, d] = dk_f[i, d]

                # dG (reverse cumsum inside the chunk) and dbeta
                for i in T.Parallel(C):
                    dg_s[i] = (
                        r_s[5, i] + r_s[6, i] - r_s[7, i] + r_s[3, i] - r_s[4, i] + r_s[1, i] - r_s[2, i]
                        + T.if_then_else(i == L - 1, sc_s[0] + sc_s[1], T.float32(0))
                    )
                T.cumsum(dg_s, dim=0, reverse=True)
                for i in T.Parallel(C):
                    if i < L:
                        dg[0, t0 + i, bhv] = dg_s[i]
                        db[0, t0 + i, bhv] = T.if_then_else(
                            b_s[i] != T.float32(0), (r_s[1, i] + r_s[0, i]) / b_s[i], T.float32(0)
                        )

                # dS = exp(GL) dS' + q^T (scale E dO) - k^T (E t)
                for i, d in T.Parallel(K, V):
                    ds_f[i, d] = ds_f[i, d] * T.exp2(glast * LOG2E)
                T.wgmma_gemm(q_s, dvn_s, ds_f, transpose_A=True)
                T.gemm(k_s, te_s, ds_f, transpose_A=True)
                # q and k have had their last readers: the next chunk's loads are all issued
                if cc + 1 < n_chunks:
                    T.sync_threads()
                    if tx < 32:
                        T.fence_proxy_async()
                        T.tma_copy(q[0, tn : tn + C, bh, :], q_s, barrier=tiles_ready)
                        T.tma_copy(k[0, tn : tn + C, bh, :], k_s, barrier=tiles_ready)
                        T.barrier_arrive(tiles_ready)

            if store_dh0:
                T.copy(ds_f, dh0[n, bhv, :, :])

    return gdn_bwd_fused
