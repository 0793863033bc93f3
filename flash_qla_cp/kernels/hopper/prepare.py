"""Prepare kernel (sm_90a): per (chunk, v-head), the chunk-local cumulative gate G and the gated
UT matrix Ag that every later kernel reads.

    G      = chunk-local inclusive cumsum of g                        (fp32)
    Lm_ij  = beta_i (k_i . k_j)            for i > j, else 0          (no gating)
    M      = (I + Lm)^-1                                              (unit lower triangular)
    Ag_ij  = M_ij exp(G_i - G_j) beta_j    for j <= i < L, else 0

The inverse: 16 x 16 diagonal blocks D by column-wise substitution, then with N the strictly
block-lower part and F = N D (nilpotent of order 4) the series M = D (I - F + F^2 - F^3) =
D (I - (I - (I - F) F) F), with tensor-core MMAs in `inv_dtype`: the partial products stay in
registers as the next MMA's A operand, so only F and the last factor pass through shared memory.
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from ...constants import KERNEL_GATE_FLOOR
from .common import CHUNK, LOG2E, checks_own_bounds, import_tilelang, tl_dtype


@checks_own_bounds
def build_prepare_kernel(H: int, HV: int, K: int, dtype: str, is_varlen: bool, threads: int = 128,
                         inv_dtype: str = "float16", blocks_per_sm: int = 1, heads_per_block: int = 1):
    """PrimFunc computing G (cumsum of g) and Ag for every chunk and v-head.

    Non-varlen arguments: k [B,T,H,K] dtype, g [B,T,HV] fp32, beta [B,T,HV] fp32,
    g_out [B,T,HV] fp32, a_out [B,T,HV,64] dtype.
    Varlen adds cu_seqlens [N+1] int32 and chunk_table [NC,2] int32 (B == 1).
    blocks_per_sm > 1: registers capped so that that many blocks fit an SM (`tools/tune_prepare.py`
    times the caps).
    heads_per_block = 2 (under GVA, dividing HV / H): a block takes two v-heads of one qk-head,
    forms k k^T (the chunk's one 64 x 64 x K product, and its k load) once for both and runs
    their diagonal-block substitutions side by side (64 threads each; one v-head leaves half the
    block waiting there); the rest is per v-head, the same arithmetic as one v-head per block
    (the outputs are bitwise equal), with the two Ag tiles stored last.
    """
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    G = HV // H
    VH = heads_per_block
    assert HV % H == 0 and G % VH == 0 and VH in (1, 2) and threads >= 64 * VH  # (64 substitute a v-head)
    block_heads = tuple(range(VH))  # a tuple, not a range: its loops unroll as the kernel is built

    @T.macro
    def substitute(n_s, d_s, col, run, lane):
        # Column-wise forward substitution inside each 16x16 diagonal block by 64 threads: thread
        # lane = (blk, c) owns column c of block blk in registers, so it needs no other thread's
        # results.
        blk = lane // 16
        c = lane % 16
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

    @T.macro
    def inverse_gated(n_s, d_s, z_s, z_f, w_f, w_a, out_s, g_s, b_s, L):
        # a v-head's Ag into out_s from its N (n_s) and diagonal-block inverse (d_s)
        # keep only the strictly block-lower part N
        for i, j in T.Parallel(C, C):
            if i // 16 == j // 16:
                n_s[i, j] = T.cast(0, inv_dtype)

        # (I + Lm)^-1 = D (I + F)^-1 with F = N D: M = D w, w = I - (I - (I - F) F) F
        T.gemm(n_s, d_s, z_f, clear_accum=True)
        T.copy(z_f, n_s)  # n_s now holds F (the B operand of the next two MMAs)
        for _ in T.serial(2):
            # w = I - (previous) F, rounded to inv_dtype by the copy into the A operand
            for i, j in T.Parallel(C, C):
                w_f[i, j] = T.if_then_else(i == j, T.float32(1), T.float32(0)) - z_f[i, j]
            T.copy(w_f, w_a)
            T.gemm(w_a, n_s, z_f, clear_accum=True)
        for i, j in T.Parallel(C, C):
            w_f[i, j] = T.if_then_else(i == j, T.float32(1), T.float32(0)) - z_f[i, j]
        T.copy(w_f, z_s)
        T.gemm(d_s, z_s, z_f, clear_accum=True)
        # Gated for every entry, then masked in a loop without loads. No clamp of the exponent:
        # entries above the diagonal may overflow to inf / NaN, but the select discards them
        # (a clamp could change valid entries wherever the cumsum is not exactly monotone).
        for i, j in T.Parallel(C, C):
            z_f[i, j] = z_f[i, j] * T.exp2((g_s[i] - g_s[j]) * LOG2E) * b_s[j]
        for i, j in T.Parallel(C, C):
            z_f[i, j] = T.if_then_else((i >= j) and (i < L) and (j < L), z_f[i, j], T.float32(0))
        T.copy(z_f, out_s)

    @T.macro
    def store_ag(out_s, a_out, bb, bhv, t0, L):
        if L == C:
            T.copy(out_s, a_out[bb, t0 : t0 + C, bhv, :])
        else:
            for i, j in T.Parallel(C, C):
                if i < L:
                    a_out[bb, t0 + i, bhv, j] = out_s[i, j]

    @T.macro
    def body(k, g, beta, g_out, a_out, bb, bhv0, t0, L):
        # v-heads bhv0 .. bhv0 + VH - 1, all of qk-head bh
        bh = bhv0 // G
        k_s = T.alloc_shared((C, K), dtype)
        g_s = [T.alloc_shared((C,), acc) for _ in block_heads]
        b_s = [T.alloc_shared((C,), acc) for _ in block_heads]
        kk_f = T.alloc_fragment((C, C), acc)
        # inversion operands: fp16 (wgmma, same 10-bit mantissa as tf32) or fp32 (tf32 mma)
        # per v-head: beta k k^T strictly lower -> N -> F, and the inverse of its block-diagonal part
        n_s = [T.alloc_shared((C, C), inv_dtype) for _ in block_heads]
        d_s = [T.alloc_shared((C, C), inv_dtype) for _ in block_heads]
        z_s = T.alloc_shared((C, C), inv_dtype)
        z_f = T.alloc_fragment((C, C), acc)
        w_f = T.alloc_fragment((C, C), acc)  # I - (...) F, fp32
        w_a = T.alloc_fragment((C, C), inv_dtype)  # the same as an MMA's register A operand
        out_s = [T.alloc_shared((C, C), dtype) for _ in block_heads]  # each v-head's Ag
        col = T.alloc_local((16,), acc)
        run = T.alloc_local((1,), acc)

        tx = T.get_thread_binding()

        if L == C:
            T.copy(k[bb, t0 : t0 + C, bh, :], k_s)
        else:
            # Rows >= L are zero: clamped-row loads (L >= 1), then the zeros in a store-only loop
            # (the elementwise rule, hopper/common.py: no load under a condition).
            for i, d in T.Parallel(C, K):
                k_s[i, d] = k[bb, t0 + T.min(i, L - 1), bh, d]
            for i, d in T.Parallel(C, K):
                if i >= L:
                    k_s[i, d] = T.cast(0, dtype)
        for head in block_heads:
            for i in T.Parallel(C):
                if i < L:
                    # floored (constants.KERNEL_GATE_FLOOR); a comparison keeps NaN gates NaN
                    g_s[head][i] = T.if_then_else(g[bb, t0 + i, bhv0 + head] < KERNEL_GATE_FLOOR,
                                                  T.float32(KERNEL_GATE_FLOOR), g[bb, t0 + i, bhv0 + head])
                    b_s[head][i] = beta[bb, t0 + i, bhv0 + head]
                else:
                    g_s[head][i] = T.float32(0)
                    b_s[head][i] = T.float32(0)
            T.cumsum(g_s[head], dim=0)
            for i in T.Parallel(C):
                if i < L:
                    g_out[bb, t0 + i, bhv0 + head] = g_s[head][i]

        T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
        # each v-head's beta k k^T, strictly lower: computed in registers (z_f: kk_f stays for the
        # next v-head), masked, then stored, loops of their own (the elementwise rule,
        # hopper/common.py)
        for head in block_heads:
            for i, j in T.Parallel(C, C):
                z_f[i, j] = kk_f[i, j] * b_s[head][i]
            for i, j in T.Parallel(C, C):
                z_f[i, j] = T.if_then_else(i > j, z_f[i, j], T.float32(0))
            T.copy(z_f, n_s[head])
        for i, j in T.Parallel(C, C):
            kk_f[i, j] = T.if_then_else(i == j, T.float32(1), T.float32(0))
        for head in block_heads:
            T.copy(kk_f, d_s[head])
        T.sync_threads()
        # the v-heads' substitutions side by side, 64 threads each
        for head in block_heads:
            if tx // 64 == head:
                substitute(n_s[head], d_s[head], col, run, tx % 64)
        T.sync_threads()

        for head in block_heads:
            if head > 0:
                T.sync_threads()  # the v-head before is done with z_s
            inverse_gated(n_s[head], d_s[head], z_s, z_f, w_f, w_a, out_s[head], g_s[head], b_s[head], L)
        # the stores last: a bulk store's wait for its read of shared memory ends the block rather
        # than holding the next v-head up at a barrier
        for head in block_heads:
            store_ag(out_s[head], a_out, bb, bhv0 + head, t0, L)

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
            with T.Kernel(NC, HV // VH, threads=threads) as (bc, bvh):
                if blocks_per_sm > 1:
                    T.annotate_min_blocks_per_sm(blocks_per_sm)
                n = chunk_tab[bc, 0]
                ci = chunk_tab[bc, 1]
                s0 = cu_seqlens[n]
                t0 = s0 + ci * C
                L = T.min(cu_seqlens[n + 1] - t0, C)
                body(k, g, beta, g_out, a_out, 0, bvh * VH, t0, L)

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
        with T.Kernel(T.ceildiv(Tlen, C), B * (HV // VH), threads=threads) as (bc, bbh):
            if blocks_per_sm > 1:
                T.annotate_min_blocks_per_sm(blocks_per_sm)
            bb = bbh // (HV // VH)
            bhv0 = bbh % (HV // VH) * VH
            t0 = bc * C
            L = T.min(Tlen - t0, C)
            body(k, g, beta, g_out, a_out, bb, bhv0, t0, L)

    return gdn_fwd_prepare
