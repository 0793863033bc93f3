"""Single-warpgroup fused forward (sm_90a): the chunk recurrence and the output in one walk.

One block per (V block, sequence, v-head) walks the sequence's chunks with S[K, block_v] in fp32
registers; six wgmma GEMMs per chunk:

    v_new = Ag (v - exp(G) * (k S))
    o     = scale * (exp(G) * (q S) + tril_incl(q k^T * exp(G_i - G_j)) v_new)
    S'    = exp(G_L) S + (k * exp(G_L - G))^T v_new

The warp-specialised forwards (`fwd_fused_ws`, `fwd_fused_ws4`) have the same contract and take
the output off the state's path; this kernel runs the head dims past 128, where only its tiles
fit in shared memory (q / k tiles of 64 x K leave room for block_v <= 32).
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from .common import CHUNK, LOG2E, import_tilelang, tl_dtype
from .entries import fused_fwd_entry, state_io


def build_fused_fwd_kernel(
    H: int,
    HV: int,
    K: int,
    V: int,
    dtype: str,
    scale: float,
    use_initial_state: bool,
    store_final_state: bool,
    state_v_first: bool = False,
    block_v: int = 64,
):
    """PrimFunc walking every sequence chunk by chunk with S[K, block_v] held in fp32.

    Arguments (`entries.fused_fwd_entry`: packed sequences): q,k [1,T,H,K], v [1,T,HV,V], ag
    [1,T,HV,64] dtype, gc [1,T,HV] fp32, cu_seqlens [N+1], order [N], ht_rows [N] int32, h0
    [N0,HV,K,V] fp32, o [1,T,HV,V] dtype, ht [N1,HV,K,V] fp32 (state dims swapped when
    state_v_first; h0/ht may be 1-row dummies when unused).
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
    threads = 128
    load_initial_state, store_final = state_io(T, K, BV, use_initial_state, store_final_state, state_v_first)

    @T.macro
    def body(q, k, v, ag, gc, h0, o, ht, n, ht_row, bhv, bv, t_start, seq_len):
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

        s_f = T.alloc_fragment((K, BV), acc)
        x_f = T.alloc_fragment((C, BV), acc)
        vn_f = T.alloc_fragment((C, BV), acc)
        p_f = T.alloc_fragment((C, C), acc)
        o_f = T.alloc_fragment((C, BV), acc)
        glast = T.alloc_var(acc)

        load_initial_state(s_f, h0, n, bhv, v0)

        n_chunks = T.ceildiv(seq_len, C)
        for c in T.Pipelined(n_chunks, num_stages=2):
            t0 = t_start + c * C
            L = T.min(seq_len - c * C, C)
            # Whole 64-row tiles are loaded even for a partial last chunk: rows >= L hold the
            # next sequence's tokens (or zeros past the end of the tensor). They are harmless:
            # Ag has zero columns >= L, the causal mask keeps them out of valid outputs, and
            # the state update selects them away below.
            T.copy(q[0, t0 : t0 + C, bh, :], q_s)
            T.copy(k[0, t0 : t0 + C, bh, :], k_s)
            T.copy(v[0, t0 : t0 + C, bhv, v0 : v0 + BV], v_s)
            T.copy(ag[0, t0 : t0 + C, bhv, :], a_s)
            for i in T.Parallel(C):
                # padding rows repeat the last valid G: every exponent below stays <= 0
                g_s[i] = gc[0, t0 + T.min(i, L - 1), bhv]

            # Private copy of G: the pipeliner may hand g_s's stage back to the producer as
            # soon as the q_s group is released, so later reads go to gl_s.
            for i in T.Parallel(C):
                gl_s[i] = g_s[i]
            T.copy(s_f, h_s)
            # three independent products, one wait; the last one is synchronous so that
            # q_s / k_s are no longer read when their stage is released to the producer
            T.wgmma_gemm(k_s, h_s, x_f, clear_accum=True)
            T.wgmma_gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
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
            T.wgmma_gemm(p_s, vn_s, o_f)
            T.gemm(k_s, vd_s, s_f, transpose_A=True)  # synchronous: waits for both
            # straight from registers: no wait on a bulk store in the chunk loop
            for i, j in T.Parallel(C, BV):
                if i < L:
                    o[0, t0 + i, bhv, v0 + j] = o_f[i, j]

        store_final(s_f, ht, ht_row, bhv, v0)

    return fused_fwd_entry(body, H, HV, K, V, dtype, state_v_first, NV, threads)
