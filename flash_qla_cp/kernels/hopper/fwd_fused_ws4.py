"""Four-warpgroup fused forward (sm_90a): the state chain split over two warpgroups so that one
block can carry a whole 128-wide state.

Same arguments and results as `fwd_fused.build_fused_fwd_kernel` (and `store_states` as in
`fwd_fused_ws.py`). In the three-warpgroup kernel the state warpgroup holds S[K, BV] and the
two [64, BV] accumulators of its chain (k S, then Ag w), 2 x 64 + 64 floats per thread at
BV = 64: a 128-wide block would not fit its registers. Here:

* state  (threads   0-127): S[K, BV] fp32 only. Per chunk: publish S (bf16), S *= exp(G_L),
  then S += k^T v_d once the value warpgroup has published v_d. One GEMM on the chain.
* value  (threads 128-255): x = k S, w = v - exp(G) x, v_new = Ag w; publishes v_new for the
  output and v_d = exp(G_L - G) v_new (rows < L) for the state.
* output (threads 256-383): P = q k^T gated and masked (before S is known), o = exp(G) q S +
  P v_new, stored from registers; with store_states it TMA-stores h and w as they appear.
* loader (threads 384-511): one warp issues the TMA loads of q, k, v, Ag into a ring and fills G.

The chain from one chunk's state to the next is the same arithmetic as in the three-warpgroup
kernel, in the same order (so outputs are expected to agree bit for bit at equal block_v); only
the warpgroup that runs each step changes. Hand-overs, each a shared tile with ready / free
mbarriers: h (state -> value, output; h_free when both have read it), v_new / v_d (value ->
output / state; vn_free when the output has read v_new: the state has read v_d before it
publishes the next h, which the value warpgroup waits for).

With `gated_norm` (inference: no chunk states stored) the output warpgroup also applies the
layer's gated RMSNorm to each chunk of o before storing it, so `o` receives y = o * rsqrt(mean(o^2)
+ eps) * weight * silu(z) (`gated_norm.py`'s arithmetic, from o in fp32 instead of its bf16
copy) and the layer skips the norm's own pass over o. The block holds whole 128-wide rows of o, so
the mean is a row reduction in registers. z comes by TMA from its columns of the projection rows
P into a tile of its own, issued at the start of the chunk; to make room for that tile P = q k^T
stays in registers as the A operand of the P v_new GEMM instead of going through shared memory.
"""

from .common import CHUNK, LOG2E, checks_own_bounds, import_tilelang, swizzle_read_tiles, tl_dtype
from .entries import fused_fwd_entry, ws_pieces


@checks_own_bounds
def build_fused_fwd_ws4_kernel(
    H: int,
    HV: int,
    K: int,
    V: int,
    dtype: str,
    scale: float,
    use_initial_state: bool,
    store_final_state: bool,
    state_v_first: bool = False,
    block_v: int = 128,
    num_stages: int = 2,
    store_states: bool = False,
    gated_norm: tuple | None = None,
):
    """PrimFunc with the signature of `build_fused_fwd_kernel` (grid (V / block_v, N, HV),
    512 threads). num_stages: depth of the loader's ring. Whole chunks of o leave through a
    shared tile and a TMA store (coalesced) instead of each thread's fragment stores.
    gated_norm: (width, z_offset, z_head_stride, eps) of the layer's projection rows P
    (`reference.layer_steps.ProjectionLayout`): o receives the gated norm's output, and the
    PrimFunc takes P and the norm's fp32 weight [V] after ht (`fused_fwd_entry`); needs
    block_v == V and no store_states."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    BV = block_v
    assert V % BV == 0 and BV % 16 == 0 and K % 64 == 0 and K <= 128 and num_stages >= 2
    normed = gated_norm is not None
    assert not normed or (BV == V and not store_states), "the gated norm needs whole rows of o, no stored states"
    if normed:
        _, z_offset, z_head_stride, eps = gated_norm
        eps = float(eps)
        group = HV // H
    NS = num_stages
    NV = V // BV
    scale = float(scale)
    WG = 128
    # registers per thread (setmaxnreg, multiples of 8, 128 x sum <= 64K): the state warpgroup
    # holds K x BV / 128 floats of S (128 at BV = 128), the value warpgroup two [64, BV]
    # accumulators, the output warpgroup P and o
    STATE_REGS, VALUE_REGS, OUTPUT_REGS, LOADER_REGS = 168, 168, 144, 32
    if gated_norm is not None:
        # with the norm's epilogue ptxas spills (4-12 bytes) at 168 / 168 / 144 / 32 and at caps moved to
        # the output warpgroup; none here (`nvcc -Xptxas -v` on the lowered source, 2026-12-06)
        STATE_REGS, VALUE_REGS, OUTPUT_REGS, LOADER_REGS = 176, 168, 144, 24
    O_TILE_BARRIER = 12  # a named barrier id TileLang's own per-warpgroup syncs (3-5) do not use
    load_initial_state, store_final, masked_p, store_w, store_o, loader = ws_pieces(
        T, H, HV, K, BV, dtype, scale, use_initial_state, store_final_state, state_v_first)

    @T.macro
    def body(q, k, v, ag, gc, h0, o, ht, n, ht_row, bhv, bv, t_start, seq_len, h_st=None, vres=None, c_base=0, P=None,
             norm_weight=None):
        v0 = bv * BV
        # ring of NS stages filled by the loader
        q_s = T.alloc_shared((NS, C, K), dtype)
        k_s = T.alloc_shared((NS, C, K), dtype)
        v_s = T.alloc_shared((NS, C, BV), dtype)
        swizzle_read_tiles(v_s)  # read elementwise: no bank conflicts
        a_s = T.alloc_shared((NS, C, C), dtype)
        g_s = T.alloc_shared((NS, C), acc)
        # hand-overs
        h_s = T.alloc_shared((K, BV), dtype)  # S entering the chunk: state -> value, output
        vn_s = T.alloc_shared((C, BV), dtype)  # v_new: value -> output
        vd_s = T.alloc_shared((C, BV), dtype)  # exp(G_L - G) v_new, rows < L: value -> state
        # private
        w_s = T.alloc_shared((C, BV), dtype)  # value (read by the output's TMA store)
        if normed:
            p_s = T.alloc_fragment((C, C), dtype)  # output: P as the GEMM's register operand
            z_s = T.alloc_shared((C, BV), dtype)  # output: z of the chunk (TMA)
            swizzle_read_tiles(z_s)
            nw_s = T.alloc_shared((BV,), acc)  # output: the norm's weight
            ms_r = T.alloc_reducer((C,), acc, op="sum")
            ms_f = T.alloc_fragment((C,), acc)
            z_ready = T.alloc_barrier(arrive_count=WG)
        else:
            p_s = T.alloc_shared((C, C), dtype)  # output
        o_s = T.alloc_shared((C, BV), dtype)  # output (TMA store source)
        s_f = T.alloc_fragment((K, BV), acc)
        x_f = T.alloc_fragment((C, BV), acc)
        vn_f = T.alloc_fragment((C, BV), acc)
        p_f = T.alloc_fragment((C, C), acc)
        o_f = T.alloc_fragment((C, BV), acc)
        glast = T.alloc_var(acc)
        data_ready = T.alloc_barrier(arrive_count=[32] * NS)
        data_free = T.alloc_barrier(arrive_count=[3 * WG] * NS)
        h_ready = T.alloc_barrier(arrive_count=WG)
        h_free = T.alloc_barrier(arrive_count=2 * WG)
        vn_ready = T.alloc_barrier(arrive_count=WG)
        vn_free = T.alloc_barrier(arrive_count=WG)

        n_chunks = T.ceildiv(seq_len, C)
        tx = T.get_thread_binding()

        if tx < WG:
            # ---- state warpgroup ----
            T.set_max_nreg(STATE_REGS, 1)
            load_initial_state(s_f, h0, n, bhv, v0)
            for c in T.serial(n_chunks):
                s = c % NS
                T.barrier_wait(data_ready[s], (c // NS) % 2)
                T.barrier_wait(h_free, (c + 1) % 2)  # chunk c-1's h_s is read
                T.copy(s_f, h_s)
                T.fence_proxy_async()
                T.barrier_arrive(h_ready)
                glast = g_s[s, C - 1]  # padding rows repeat the last valid G
                for i, j in T.Parallel(K, BV):
                    s_f[i, j] = s_f[i, j] * T.exp2(glast * LOG2E)
                T.barrier_wait(vn_ready, c % 2)
                T.gemm(k_s[s, :, :], vd_s, s_f, transpose_A=True)
                T.barrier_arrive(data_free[s])
            store_final(s_f, ht, ht_row, bhv, v0)
        elif tx < 2 * WG:
            # ---- value warpgroup ----
            T.set_max_nreg(VALUE_REGS, 1)
            for c in T.serial(n_chunks):
                s = c % NS
                L = T.min(seq_len - c * C, C)
                T.barrier_wait(data_ready[s], (c // NS) % 2)
                T.barrier_wait(h_ready, c % 2)
                T.gemm(k_s[s, :, :], h_s, x_f, clear_accum=True)
                T.barrier_arrive(h_free)
                # compute in registers, then store (the elementwise rule, hopper/common.py)
                for i, j in T.Parallel(C, BV):
                    x_f[i, j] = v_s[s, i, j] - T.exp2(g_s[s, i] * LOG2E) * x_f[i, j]
                # chunk c-1's v_new, and its w (the output's TMA store), are read
                T.barrier_wait(vn_free, (c + 1) % 2)
                T.copy(x_f, w_s)
                T.fence_proxy_async()
                T.gemm(a_s[s, :, :], w_s, vn_f, clear_accum=True)
                glast = g_s[s, C - 1]
                T.copy(vn_f, vn_s)
                # gate, row mask, store: loops of their own (the elementwise rule)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = vn_f[i, j] * T.exp2((glast - g_s[s, i]) * LOG2E)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = T.if_then_else(i < L, vn_f[i, j], T.float32(0))
                T.copy(vn_f, vd_s)
                T.fence_proxy_async()
                T.barrier_arrive(vn_ready)
                T.barrier_arrive(data_free[s])
        elif tx < 3 * WG:
            # ---- output warpgroup ----
            T.set_max_nreg(OUTPUT_REGS, 1)
            if normed:
                z_col = z_offset + (bhv // group) * z_head_stride + (bhv % group) * V
                for j in T.Parallel(BV):
                    nw_s[j] = norm_weight[j]
                T.sync_threads(O_TILE_BARRIER, WG)
            for c in T.serial(n_chunks):
                s = c % NS
                t0 = t_start + c * C
                L = T.min(seq_len - c * C, C)
                if normed:  # (z_s is free: every thread read the last chunk's z before that chunk's store)
                    T.tma_copy(P[0, t0 : t0 + C, z_col : z_col + BV], z_s, barrier=z_ready)
                    T.barrier_arrive(z_ready)
                T.barrier_wait(data_ready[s], (c // NS) % 2)
                masked_p(q_s, k_s, g_s, s, p_f, p_s, not normed)
                T.barrier_wait(h_ready, c % 2)
                if store_states:  # TMA store, waited for (smem read) before h_free
                    T.tma_copy(h_s, h_st[c_base + c, bhv, :, v0 : v0 + BV])
                T.gemm(q_s[s, :, :], h_s, o_f, clear_accum=True)
                if store_states:
                    T.tma_store_wait(0)
                T.barrier_arrive(h_free)
                for i, j in T.Parallel(C, BV):
                    o_f[i, j] = o_f[i, j] * (T.exp2(g_s[s, i] * LOG2E) * scale)
                T.barrier_wait(vn_ready, c % 2)
                if store_states:  # w_s is complete once v_new is
                    store_w(w_s, vres, t0, bhv, v0, L)
                T.gemm(p_s, vn_s, o_f)
                if store_states:
                    T.tma_store_wait(0)
                T.barrier_arrive(vn_free)
                T.barrier_arrive(data_free[s])
                if normed:
                    T.barrier_wait(z_ready, c % 2)
                    T.reducer_init(ms_r)
                    for i, j in T.Parallel(C, BV):
                        T.reducer_update(ms_r[i], o_f[i, j] * o_f[i, j])
                    T.finalize_reducer(ms_r, ms_f)
                    for i in T.Parallel(C):
                        ms_f[i] = T.rsqrt(ms_f[i] / V + eps)
                    for i, j in T.Parallel(C, BV):
                        z = T.cast(z_s[i, j], acc)
                        o_f[i, j] = o_f[i, j] * ms_f[i] * nw_s[j] * z / (T.float32(1) + T.exp(-z))
                # o by TMA for whole chunks only (a partial chunk's rows past L belong to the next sequence)
                if L == C:
                    T.tma_store_wait(0)  # the previous chunk's store has read o_s
                    T.sync_threads(O_TILE_BARRIER, WG)
                    T.copy(o_f, o_s)
                    T.fence_proxy_async()
                    T.sync_threads(O_TILE_BARRIER, WG)
                    T.tma_copy(o_s, o[0, t0 : t0 + C, bhv, v0 : v0 + BV])
                else:
                    store_o(o_f, o, t0, bhv, v0, L)
            T.tma_store_wait(0)  # o_s must outlive the last store's read
        else:
            # ---- loader: one warp issues the loads, the other three wait at the exit ----
            T.set_max_nreg(LOADER_REGS, 0)
            if tx < 3 * WG + 32:
                loader(q, k, v, ag, gc, q_s, k_s, v_s, a_s, g_s, data_ready, data_free, bhv, v0, t_start,
                       seq_len, NS)

    return fused_fwd_entry(body, H, HV, K, V, dtype, state_v_first, NV, 4 * WG, store_states,
                           gated_norm[0] if normed else 0)
