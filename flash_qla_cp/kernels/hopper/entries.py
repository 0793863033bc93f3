"""Shared PrimFunc signatures and macros of the Hopper kernels.

* `fused_fwd_entry`: the fused forward's argument list and grid, around a per-block walk
  (`fwd_fused`, `fwd_fused_ws`, `fwd_fused_ws4`); `state_io` moves the entering / leaving state.
* `ws_pieces`: the macros both warp-specialised forwards share (masked P, stores, loader warp).
* `bwd_h_entry` / `bwd_dh_entry`: the backward walks' argument lists and grids, around the
  serial (`bwd_h`, `bwd_dh`) or warp-specialised (`bwd_h_ws`, `bwd_dh_ws`) walk.
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from .common import CHUNK, LOG2E, import_tilelang, ordered_block


def state_io(T, K, BV, use_initial_state, store_final_state, state_v_first):
    """TileLang macros (load_initial_state, store_final) moving a block's S[K, BV] fp32 slice
    between registers and h0 / ht (layout [.., V, K] when state_v_first); shared by every fused
    forward kernel."""

    @T.macro
    def load_initial_state(s_f, h0, n, bhv, v0):
        if use_initial_state:
            if state_v_first:
                for i, j in T.Parallel(K, BV):
                    s_f[i, j] = h0[n, bhv, v0 + j, i]
            else:
                T.copy(h0[n, bhv, :, v0 : v0 + BV], s_f)
        else:
            T.clear(s_f)

    @T.macro
    def store_final(s_f, ht, row, bhv, v0):
        if store_final_state:
            if row >= 0:  # -1: a partition that does not end its sequence (`ht_rows`)
                if state_v_first:
                    for i, j in T.Parallel(K, BV):
                        ht[row, bhv, v0 + j, i] = s_f[i, j]
                else:
                    T.copy(s_f, ht[row, bhv, :, v0 : v0 + BV])

    return load_initial_state, store_final


def fused_fwd_entry(body, H, HV, K, V, dtype, state_v_first, NV, threads, store_states=False,
                    norm_width=0):
    """The fused forward's PrimFunc around `body` (the per-CTA walk of one sequence, v-head and
    V block): the argument list of the SPEC and the grid (NV, sequences, HV). Shared by the
    single-warpgroup kernel and the warp-specialised ones (`fwd_fused_ws.py`, `fwd_fused_ws4.py`).
    The sequences are packed: q, k [1, T, H, K], v, o [1, T, HV, V], ag [1, T, HV, 64], gc
    [1, T, HV], then cu_seqlens [N + 1] int32 and an int32 [N] `order` (the sequences in the
    order their blocks start, `kernels.tables.walk_order`, longest first) and `ht_rows` [N]
    (the row of ht each sequence's walk writes, -1: none).

    store_states (warp-specialised body only) appends the outputs the backward would otherwise
    recompute: h_st [NC, HV, K, V] dtype, the state entering each chunk, and vres [1, T, HV, V]
    dtype, v - exp(G) (k S) (`bwd_h.build_bwd_h_kernel` writes the same two), then
    chunk_offsets [N + 1] int32: chunk c of sequence n is row chunk_offsets[n] + c.

    norm_width (a body that applies the layer's gated norm, `fwd_fused_ws4.py`): the PrimFunc
    takes the projection rows P [1, T, norm_width] dtype and the norm's weight [V] fp32 after ht
    and hands them to `body` as P, norm_weight."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    h_dims = (V, K) if state_v_first else (K, V)
    W = norm_width
    N0 = T.dynamic("n_h0")
    NT = T.dynamic("n_ht")
    NC = T.dynamic("num_chunks")
    Ttot = T.dynamic("num_tokens")
    N1 = T.dynamic("num_seqs_plus_one")
    NS = T.dynamic("num_seqs")  # order: the walk order of the sequences (`walk_order`)

    if store_states:

        @T.prim_func
        def gdn_fwd_fused_varlen_states(
            q: T.Tensor((1, Ttot, H, K), dtype),
            k: T.Tensor((1, Ttot, H, K), dtype),
            v: T.Tensor((1, Ttot, HV, V), dtype),
            ag: T.Tensor((1, Ttot, HV, C), dtype),
            gc: T.Tensor((1, Ttot, HV), acc),
            cu_seqlens: T.Tensor((N1,), "int32"),
            order: T.Tensor((NS,), "int32"),
            ht_rows: T.Tensor((NS,), "int32"),
            h0: T.Tensor((N0, HV, *h_dims), acc),
            o: T.Tensor((1, Ttot, HV, V), dtype),
            ht: T.Tensor((NT, HV, *h_dims), acc),
            h_st: T.Tensor((NC, HV, K, V), dtype),
            vres: T.Tensor((1, Ttot, HV, V), dtype),
            chunk_offsets: T.Tensor((N1,), "int32"),
        ):
            with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
                n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)
                s0 = cu_seqlens[n]
                body(q, k, v, ag, gc, h0, o, ht, n, ht_rows[n], bhv, bv, s0, cu_seqlens[n + 1] - s0,
                     h_st, vres, chunk_offsets[n])

        return gdn_fwd_fused_varlen_states

    if norm_width:

        @T.prim_func
        def gdn_fwd_fused_varlen_normed(
            q: T.Tensor((1, Ttot, H, K), dtype),
            k: T.Tensor((1, Ttot, H, K), dtype),
            v: T.Tensor((1, Ttot, HV, V), dtype),
            ag: T.Tensor((1, Ttot, HV, C), dtype),
            gc: T.Tensor((1, Ttot, HV), acc),
            cu_seqlens: T.Tensor((N1,), "int32"),
            order: T.Tensor((NS,), "int32"),
            ht_rows: T.Tensor((NS,), "int32"),
            h0: T.Tensor((N0, HV, *h_dims), acc),
            o: T.Tensor((1, Ttot, HV, V), dtype),
            ht: T.Tensor((NT, HV, *h_dims), acc),
            P: T.Tensor((1, Ttot, W), dtype),
            norm_weight: T.Tensor((V,), acc),
        ):
            with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
                n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)
                s0 = cu_seqlens[n]
                body(q, k, v, ag, gc, h0, o, ht, n, ht_rows[n], bhv, bv, s0, cu_seqlens[n + 1] - s0, P=P,
                     norm_weight=norm_weight)

        return gdn_fwd_fused_varlen_normed

    @T.prim_func
    def gdn_fwd_fused_varlen(
        q: T.Tensor((1, Ttot, H, K), dtype),
        k: T.Tensor((1, Ttot, H, K), dtype),
        v: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        cu_seqlens: T.Tensor((N1,), "int32"),
        order: T.Tensor((NS,), "int32"),
        ht_rows: T.Tensor((NS,), "int32"),
        h0: T.Tensor((N0, HV, *h_dims), acc),
        o: T.Tensor((1, Ttot, HV, V), dtype),
        ht: T.Tensor((NT, HV, *h_dims), acc),
    ):
        with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
            n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)
            s0 = cu_seqlens[n]
            body(q, k, v, ag, gc, h0, o, ht, n, ht_rows[n], bhv, bv, s0, cu_seqlens[n + 1] - s0)

    return gdn_fwd_fused_varlen


def ws_pieces(T, H, HV, K, BV, dtype, scale, use_initial_state, store_final_state, state_v_first):
    """The steps both warp-specialised forwards (this kernel and `fwd_fused_ws4.py`) share, as
    TileLang macros: entering / leaving state (`state_io`), the output's masked P,
    the stores, the loader warp's loop."""
    C = CHUNK
    G = HV // H
    load_initial_state, store_final = state_io(T, K, BV, use_initial_state, store_final_state, state_v_first)

    @T.macro
    def masked_p(q_s, k_s, g_s, s, p_f, p_s, shared=True):
        # P = q k^T gated, masked, scaled, stored (the elementwise rule, hopper/common.py) into
        # p_s: a shared tile, or with shared=False a register fragment (a GEMM's A operand). G
        # falls along the chunk, so the clamp changes only the masked entries (it keeps their
        # exponentials finite).
        T.gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(C, C):
            p_f[i, j] = p_f[i, j] * T.exp2(T.min(g_s[s, i] - g_s[s, j], T.float32(0)) * LOG2E)
        for i, j in T.Parallel(C, C):
            p_f[i, j] = T.if_then_else(i >= j, p_f[i, j] * scale, T.float32(0))
        T.copy(p_f, p_s)
        if shared:
            T.fence_proxy_async()

    @T.macro
    def store_w(w_s, vres, t0, bhv, v0, L):
        # v - exp(G) k S of a chunk (store_states): TMA for whole chunks, rows < L otherwise
        if L == C:
            T.tma_copy(w_s, vres[0, t0 : t0 + C, bhv, v0 : v0 + BV])
        else:
            for i, j in T.Parallel(C, BV):
                if i < L:
                    vres[0, t0 + i, bhv, v0 + j] = w_s[i, j]

    @T.macro
    def store_o(o_f, o, t0, bhv, v0, L):
        for i, j in T.Parallel(C, BV):
            if i < L:
                o[0, t0 + i, bhv, v0 + j] = o_f[i, j]

    @T.macro
    def loader(q, k, v, ag, gc, q_s, k_s, v_s, a_s, g_s, data_ready, data_free, bhv, v0, t_start, seq_len, NS):
        # one warp: whole 64-row tiles even for a partial last chunk (rows >= L are masked out
        # downstream; TMA zero-fills past the tensor), G rows clamped to the last valid one
        bh = bhv // G
        for c in T.serial(T.ceildiv(seq_len, C)):
            s = c % NS
            t0 = t_start + c * C
            L = T.min(seq_len - c * C, C)
            T.barrier_wait(data_free[s], (c // NS + 1) % 2)
            T.tma_copy(q[0, t0 : t0 + C, bh, :], q_s[s, :, :], barrier=data_ready[s])
            T.tma_copy(k[0, t0 : t0 + C, bh, :], k_s[s, :, :], barrier=data_ready[s])
            T.tma_copy(v[0, t0 : t0 + C, bhv, v0 : v0 + BV], v_s[s, :, :], barrier=data_ready[s])
            T.tma_copy(ag[0, t0 : t0 + C, bhv, :], a_s[s, :, :], barrier=data_ready[s])
            for i in T.Parallel(C):
                g_s[s, i] = gc[0, t0 + T.min(i, L - 1), bhv]
            T.barrier_arrive(data_ready[s])

    return load_initial_state, store_final, masked_p, store_w, store_o, loader


def bwd_h_entry(walk, H, HV, K, V, dtype, NV, threads):
    """PrimFunc `gdn_bwd_h` (the h walk's argument list, grid (NV, N, HV)) around `walk`, a
    T.macro (k, v, ag, gc, cu_seqlens, chunk_offsets, h0, h_out, vres_out, bv, n, bhv).
    Shared by the serial and the warp-specialised (`bwd_h_ws.py`) kernels. Like the dh
    walk's, its grid starts the sequences of `order` ([N] int32, `walk_order`) in turn."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    Ttot = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N1 = T.dynamic("num_seqs_plus_one")
    NS = T.dynamic("num_seqs")
    N0 = T.dynamic("n_h0")

    @T.prim_func
    def gdn_bwd_h(
        k: T.Tensor((1, Ttot, H, K), dtype),
        v: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        order: T.Tensor((NS,), "int32"),
        h0: T.Tensor((N0, HV, K, V), acc),
        h_out: T.Tensor((NC, HV, K, V), dtype),
        vres_out: T.Tensor((1, Ttot, HV, V), dtype),
    ):
        with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
            n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)  # longest sequences first
            walk(k, v, ag, gc, cu_seqlens, chunk_offsets, h0, h_out, vres_out, bv, n, bhv)

    return gdn_bwd_h


def bwd_dh_entry(walk, H, HV, K, V, dtype, NV, threads, limit_chunks=False):
    """PrimFunc `gdn_bwd_dh` (the dh walk's argument list, grid (NV, N, HV)) around `walk`, a
    T.macro (q, k, do, ag, gc, cu_seqlens, chunk_offsets, dht, dh_out, dvn_out, dv_out, dh0,
    walk_chunks, bv, n, bhv). Shared by the serial and the warp-specialised
    (`bwd_dh_ws.py`) kernels. With limit_chunks the PrimFunc takes one more argument,
    walk_chunks [N, HV] int32 (the walk covers only the first walk_chunks[n, h] chunks of
    sequence n, from a zero or given exit gradient there) and writes only dh0: it has no dh_out /
    dvn_out / dv_out arguments (`walk` gets None for them and must not store them); else `walk`
    gets dh0 in walk_chunks' place and must not read it."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    Ttot = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N1 = T.dynamic("num_seqs_plus_one")
    NS = T.dynamic("num_seqs")
    NT = T.dynamic("n_dht")
    N0 = T.dynamic("n_dh0")

    if not limit_chunks:
        @T.prim_func
        def gdn_bwd_dh(
            q: T.Tensor((1, Ttot, H, K), dtype),
            k: T.Tensor((1, Ttot, H, K), dtype),
            do: T.Tensor((1, Ttot, HV, V), dtype),
            ag: T.Tensor((1, Ttot, HV, C), dtype),
            gc: T.Tensor((1, Ttot, HV), acc),
            cu_seqlens: T.Tensor((N1,), "int32"),
            chunk_offsets: T.Tensor((N1,), "int32"),
            order: T.Tensor((NS,), "int32"),
            dht: T.Tensor((NT, HV, K, V), acc),
            dh_out: T.Tensor((NC, HV, K, V), dtype),
            dvn_out: T.Tensor((1, Ttot, HV, V), dtype),
            dv_out: T.Tensor((1, Ttot, HV, V), dtype),
            dh0: T.Tensor((N0, HV, K, V), acc),
        ):
            with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
                n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)  # longest sequences first
                walk(q, k, do, ag, gc, cu_seqlens, chunk_offsets, dht, dh_out, dvn_out, dv_out, dh0, dh0, bv, n,
                     bhv)

        return gdn_bwd_dh

    NW = T.dynamic("n_walk")

    @T.prim_func
    def gdn_bwd_dh_limited(
        q: T.Tensor((1, Ttot, H, K), dtype),
        k: T.Tensor((1, Ttot, H, K), dtype),
        do: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        order: T.Tensor((NS,), "int32"),
        dht: T.Tensor((NT, HV, K, V), acc),
        dh0: T.Tensor((N0, HV, K, V), acc),
        walk_chunks: T.Tensor((NW, HV), "int32"),
    ):
        with T.Kernel(NV, N1 - 1, HV, threads=threads) as (bv, bn, bh):
            n, bhv = ordered_block(order, bn, bh, N1 - 1, HV)  # longest sequences first
            walk(q, k, do, ag, gc, cu_seqlens, chunk_offsets, dht, None, None, None, dh0, walk_chunks, bv, n, bhv)

    return gdn_bwd_dh_limited
