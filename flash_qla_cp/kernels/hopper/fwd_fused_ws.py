"""Warp-specialised fused forward (sm_90a): the chunk recurrence with the output off its path.

Same arguments and results as `fwd_fused.build_fused_fwd_kernel` (docs/kernels.md); only
the schedule differs. In the single-warpgroup kernel every chunk runs six GEMMs back to back,
and the three that make the output (q k^T, q S, P v_new) sit on the chain that carries the
state from chunk to chunk. Here one CTA runs three warpgroups:

* state  (threads   0-127): holds S[K, BV] in fp32 registers. Per chunk: publish S as bf16,
  x = k S, w = v - exp(G) x, v_new = Ag w (published), S = exp(G_L) S + k^T (exp(G_L - G) v_new).
  Two dependent GEMM steps plus the update: the critical path.
* output (threads 128-255): P = q k^T gated and masked (before S is known), then
  o = exp(G) q S + P v_new as soon as S and v_new are published; stores o from registers.
* loader (threads 256-383): one warp issues the TMA loads of the next chunk (q, k, v, Ag into
  a two-stage ring) and fills G; the other warps idle.

Synchronisation is by mbarriers: data_ready/data_free per ring stage, and per chunk
h_ready / vn_ready (state -> output) and out_done (output -> state: the single S and v_new
buffers may be overwritten). Shared-memory writes read by wgmma are fenced to the async proxy
before the barrier that publishes them.
"""

from .common import CHUNK, LOG2E, checks_own_bounds, import_tilelang, swizzle_read_tiles, tl_dtype
from .entries import fused_fwd_entry, ws_pieces


@checks_own_bounds
def build_fused_fwd_ws_kernel(
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
    num_stages: int = 2,
    store_states: bool = False,
):
    """PrimFunc with the signature of `build_fused_fwd_kernel` (grid (V / block_v, N, HV),
    384 threads). num_stages: depth of the loader's ring (chunks loaded ahead).

    store_states: also write each chunk's entering state and v - exp(G) k S (the h walk's
    outputs, `fused_fwd_entry`), so that the backward need not recompute them. The output
    warpgroup TMA-stores them from the state warpgroup's shared tiles as soon as they are
    published and waits for the stores to have read them only before it releases the tiles
    (out_done)."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    BV = block_v
    assert V % BV == 0 and BV % 16 == 0 and K % 64 == 0 and num_stages >= 2
    NS = num_stages
    NV = V // BV
    scale = float(scale)
    WG = 128
    # registers per thread (setmaxnreg): the loader gives its share to the two consumers,
    # whose S block and accumulators (BV = 64: 128 floats) must not spill
    LOADER_REGS, CONSUMER_REGS = 40, 232
    load_initial_state, store_final, masked_p, store_w, store_o, loader = ws_pieces(
        T, H, HV, K, BV, dtype, scale, use_initial_state, store_final_state, state_v_first)

    @T.macro
    def body(q, k, v, ag, gc, h0, o, ht, n, ht_row, bhv, bv, t_start, seq_len, h_st=None, vres=None, c_base=0):
        v0 = bv * BV
        # ring of NS stages filled by the loader
        q_s = T.alloc_shared((NS, C, K), dtype)
        k_s = T.alloc_shared((NS, C, K), dtype)
        v_s = T.alloc_shared((NS, C, BV), dtype)
        swizzle_read_tiles(v_s)  # read elementwise: no bank conflicts
        a_s = T.alloc_shared((NS, C, C), dtype)
        g_s = T.alloc_shared((NS, C), acc)
        # state -> output (single buffers, released by out_done)
        h_s = T.alloc_shared((K, BV), dtype)
        vn_s = T.alloc_shared((C, BV), dtype)
        # private to one warpgroup
        w_s = T.alloc_shared((C, BV), dtype)
        vd_s = T.alloc_shared((C, BV), dtype)
        p_s = T.alloc_shared((C, C), dtype)
        s_f = T.alloc_fragment((K, BV), acc)
        x_f = T.alloc_fragment((C, BV), acc)
        vn_f = T.alloc_fragment((C, BV), acc)
        p_f = T.alloc_fragment((C, C), acc)
        o_f = T.alloc_fragment((C, BV), acc)
        glast = T.alloc_var(acc)
        data_ready = T.alloc_barrier(arrive_count=[32] * NS)
        data_free = T.alloc_barrier(arrive_count=[2 * WG] * NS)
        h_ready = T.alloc_barrier(arrive_count=WG)
        vn_ready = T.alloc_barrier(arrive_count=WG)
        out_done = T.alloc_barrier(arrive_count=WG)

        n_chunks = T.ceildiv(seq_len, C)
        tx = T.get_thread_binding()

        if tx < WG:
            # ---- state warpgroup ----
            T.set_max_nreg(CONSUMER_REGS, 1)
            load_initial_state(s_f, h0, n, bhv, v0)
            for c in T.serial(n_chunks):
                s = c % NS
                L = T.min(seq_len - c * C, C)
                T.barrier_wait(data_ready[s], (c // NS) % 2)
                T.barrier_wait(out_done, (c + 1) % 2)  # chunk c-1's reads of h_s / vn_s are done
                T.copy(s_f, h_s)
                T.fence_proxy_async()
                T.barrier_arrive(h_ready)
                T.gemm(k_s[s, :, :], h_s, x_f, clear_accum=True)
                # compute in registers, then store (the elementwise rule, hopper/common.py)
                for i, j in T.Parallel(C, BV):
                    x_f[i, j] = v_s[s, i, j] - T.exp2(g_s[s, i] * LOG2E) * x_f[i, j]
                T.copy(x_f, w_s)
                T.fence_proxy_async()
                T.gemm(a_s[s, :, :], w_s, vn_f, clear_accum=True)
                glast = g_s[s, C - 1]  # padding rows repeat the last valid G
                T.copy(vn_f, vn_s)
                T.fence_proxy_async()
                T.barrier_arrive(vn_ready)
                # gate, row mask, store: three loops (the elementwise rule, hopper/common.py)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = vn_f[i, j] * T.exp2((glast - g_s[s, i]) * LOG2E)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = T.if_then_else(i < L, vn_f[i, j], T.float32(0))
                T.copy(vn_f, vd_s)
                T.fence_proxy_async()
                for i, j in T.Parallel(K, BV):
                    s_f[i, j] = s_f[i, j] * T.exp2(glast * LOG2E)
                T.gemm(k_s[s, :, :], vd_s, s_f, transpose_A=True)
                T.barrier_arrive(data_free[s])
            store_final(s_f, ht, ht_row, bhv, v0)
        elif tx < 2 * WG:
            # ---- output warpgroup ----
            T.set_max_nreg(CONSUMER_REGS, 1)
            for c in T.serial(n_chunks):
                s = c % NS
                t0 = t_start + c * C
                L = T.min(seq_len - c * C, C)
                T.barrier_wait(data_ready[s], (c // NS) % 2)
                masked_p(q_s, k_s, g_s, s, p_f, p_s)
                T.barrier_wait(h_ready, c % 2)
                if store_states:  # TMA store, waited for (smem read) only before out_done
                    T.tma_copy(h_s, h_st[c_base + c, bhv, :, v0 : v0 + BV])
                T.gemm(q_s[s, :, :], h_s, o_f, clear_accum=True)
                for i, j in T.Parallel(C, BV):
                    o_f[i, j] = o_f[i, j] * (T.exp2(g_s[s, i] * LOG2E) * scale)
                T.barrier_wait(vn_ready, c % 2)
                if store_states:  # w_s is complete once v_new is (state warpgroup: w, then Ag w)
                    store_w(w_s, vres, t0, bhv, v0, L)
                T.gemm(p_s, vn_s, o_f)
                if store_states:  # the stores have read h_s / w_s before they are released
                    T.tma_store_wait(0)
                T.barrier_arrive(out_done)
                T.barrier_arrive(data_free[s])
                store_o(o_f, o, t0, bhv, v0, L)
        else:
            # ---- loader: one warp issues the loads, the other three wait at the exit ----
            T.set_max_nreg(LOADER_REGS, 0)
            if tx < 2 * WG + 32:
                loader(q, k, v, ag, gc, q_s, k_s, v_s, a_s, g_s, data_ready, data_free, bhv, v0, t_start,
                       seq_len, NS)

    return fused_fwd_entry(body, H, HV, K, V, dtype, state_v_first, NV, 3 * WG, store_states)
