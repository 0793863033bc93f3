"""Warp-specialised backward h walk (sm_90a): `build_bwd_h_kernel`'s contract with loads off the chain.

Same arguments and outputs as `bwd_h.build_bwd_h_kernel` (docs/kernels.md): per chunk it stores h (the state entering the chunk) and vres = v - exp(G) k S, then
moves S to the next chunk. It is the forward's state path (`fwd_fused_ws.py`) without the
output: one warpgroup holds S[K, BV] in fp32 registers and runs the three dependent GEMMs, one
loader warp TMA-loads k, v, Ag into a two-stage ring and fills G, so the next chunk's loads
never wait for this chunk's products. h and vres go to memory straight from registers.

Whole 64-row tiles are loaded for a partial chunk; rows >= L are masked where they could reach
a valid result (v_new rows, hence the update), as in the forward.
"""

from .common import CHUNK, LOG2E, import_tilelang, tl_dtype
from .entries import bwd_h_entry


def build_bwd_h_ws_kernel(H: int, HV: int, K: int, V: int, dtype: str, use_initial_state: bool, block_v: int = 32):
    """PrimFunc with the signature of `build_bwd_h_kernel` (grid V/BV x N x HV, 256 threads)."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    BV = block_v
    assert HV % H == 0 and V % BV == 0 and BV % 16 == 0 and K % 64 == 0
    NV = V // BV
    WG = 128
    LOADER_REGS, STATE_REGS = 40, 232

    @T.macro
    def walk(k, v, ag, gc, cu_seqlens, chunk_offsets, h0, h_out, vres_out, bv, n, bhv):
        bh = bhv // grp
        v0 = bv * BV
        s0 = cu_seqlens[n]
        seq_len = cu_seqlens[n + 1] - s0
        c_first = chunk_offsets[n]
        n_chunks = T.ceildiv(seq_len, C)

        k_s = T.alloc_shared((2, C, K), dtype)
        v_s = T.alloc_shared((2, C, BV), dtype)
        a_s = T.alloc_shared((2, C, C), dtype)
        g_s = T.alloc_shared((2, C), acc)
        h_s = T.alloc_shared((K, BV), dtype)
        vr_s = T.alloc_shared((C, BV), dtype)
        vn_s = T.alloc_shared((C, BV), dtype)

        s_f = T.alloc_fragment((K, BV), acc)
        x_f = T.alloc_fragment((C, BV), acc)
        vn_f = T.alloc_fragment((C, BV), acc)
        glast = T.alloc_var(acc)

        data_ready = T.alloc_barrier(arrive_count=[32, 32])
        data_free = T.alloc_barrier(arrive_count=[WG, WG])

        tx = T.get_thread_binding()

        if tx < WG:
            # ---- state warpgroup ----
            T.set_max_nreg(STATE_REGS, 1)
            if use_initial_state:
                T.copy(h0[n, bhv, :, v0 : v0 + BV], s_f)
            else:
                T.clear(s_f)
            for c in T.serial(n_chunks):
                s = c % 2
                t0 = s0 + c * C
                L = T.min(seq_len - c * C, C)
                T.barrier_wait(data_ready[s], (c // 2) % 2)
                for i, j in T.Parallel(K, BV):
                    h_out[c_first + c, bhv, i, v0 + j] = s_f[i, j]
                T.copy(s_f, h_s)
                T.fence_proxy_async()
                T.gemm(k_s[s, :, :], h_s, x_f, clear_accum=True)
                for i, j in T.Parallel(C, BV):
                    x_f[i, j] = v_s[s, i, j] - T.exp2(g_s[s, i] * LOG2E) * x_f[i, j]
                T.copy(x_f, vr_s)
                T.fence_proxy_async()
                for i, j in T.Parallel(C, BV):
                    if i < L:
                        vres_out[0, t0 + i, bhv, v0 + j] = x_f[i, j]
                T.gemm(a_s[s, :, :], vr_s, vn_f, clear_accum=True)
                glast = g_s[s, C - 1]  # padding rows repeat the last valid G
                # gate, row mask, store: three loops (the elementwise rule, hopper/common.py)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = vn_f[i, j] * T.exp2((glast - g_s[s, i]) * LOG2E)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = T.if_then_else(i < L, vn_f[i, j], T.float32(0))
                T.copy(vn_f, vn_s)
                T.fence_proxy_async()
                for i, j in T.Parallel(K, BV):
                    s_f[i, j] = s_f[i, j] * T.exp2(glast * LOG2E)
                T.gemm(k_s[s, :, :], vn_s, s_f, transpose_A=True)
                T.barrier_arrive(data_free[s])
        else:
            # ---- loader: one warp issues the loads ----
            T.set_max_nreg(LOADER_REGS, 0)
            if tx < WG + 32:
                for c in T.serial(n_chunks):
                    s = c % 2
                    t0 = s0 + c * C
                    L = T.min(seq_len - c * C, C)
                    T.barrier_wait(data_free[s], (c // 2 + 1) % 2)
                    T.tma_copy(k[0, t0 : t0 + C, bh, :], k_s[s, :, :], barrier=data_ready[s])
                    T.tma_copy(v[0, t0 : t0 + C, bhv, v0 : v0 + BV], v_s[s, :, :], barrier=data_ready[s])
                    T.tma_copy(ag[0, t0 : t0 + C, bhv, :], a_s[s, :, :], barrier=data_ready[s])
                    for i in T.Parallel(C):
                        g_s[s, i] = gc[0, t0 + T.min(i, L - 1), bhv]
                    T.barrier_arrive(data_ready[s])

    return bwd_h_entry(walk, H, HV, K, V, dtype, NV, 2 * WG)
