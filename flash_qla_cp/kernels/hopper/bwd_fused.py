"""Fused backward walk (sm_90a; KernelOptions.fused_walk): the dh walk and every
per-chunk gradient in one warp-specialised kernel.

One block per (sequence or partition, v-head) walks its chunks last to first with the whole
state gradient dS [K, V] in fp32 registers and forms dv, dq, dk, dg and dbeta per chunk from
tiles that stay on chip (the per-chunk formulas of `reference/backward.py`, those of the
three-kernel backward): dh, dvn and the 64 x 64 intermediates never reach memory; the chunk
states h and vres come from the h walk. The work of a chunk is shared by three warpgroups:

* state (threads 0-127): dS [K, V] fp32 in registers and the chain that needs it: publish dS'
  (bf16), k dS', dvn = P^T dO + exp(GL - G) k dS', t = Ag^T dvn (= dv), te = -exp(G) t, the
  update dS = exp(GL) dS' + q^T (scale exp(G) dO) + k^T te (q scaled into registers, the MMA's A
  operand, so dO needs no scaled copy in shared memory); and, from dvn, the 64 x 64 chain
  dAg = dvn vres^T, X = -(Ag^T dAg Ag^T) o Gam with its dG / dbeta sums (X o k k^T, dAg o Ag),
  published as the one tile X + X^T (strictly lower / upper: dk needs only (X + X^T) k).
* grad (threads 128-255): v_new, Pm, dq, dk's terms ((X + X^T) k with the state warpgroup's
  tile) and the other dG sums; and P = q k^T (gated, causal) of the next chunk for the
  state warpgroup, formed before this chunk's wait for X, so that the state warpgroup finds it
  ready when it starts that chunk (formed after, the state warpgroup waited ~19% of its samples
  for P, ncu). The grad warpgroup then issues nearly all the time: it sets the walk's pace.
* loader (threads 256-287, one warp): the chunk's inputs in four groups (dO / Ag, vres / h /
  q, k, G, beta), each reloaded by TMA, in that order, as soon as its consumers have released
  it; q, k, G and beta have two slots and load a chunk ahead (the next chunk's P needs them).
* tail (threads 288-351, two warps of the loader's warpgroup): dg and dbeta of a chunk from the
  row sums the other two leave in shared memory (its reverse cumulative sum by warp shuffles),
  while the grad warpgroup goes on with the next chunk: in the grad warpgroup that step took
  ~9.6% of the walk (H100, timed by deleting it); here the walk is ~7% faster than with it there.

Hand-overs between the consumers, each a single shared buffer with a ready / free mbarrier pair:
dS' (state -> grad), P (grad -> state), te and X + X^T (state -> grad; X's dG / dbeta sums go
with it in xr_s), the row sums (grad -> tail, with xr_s; two slots of each, one per chunk
parity: the tail reads a chunk's while the others work on the next; each slot is written again
only once the tail has released it). The 64 x 64 chain sits with the state warpgroup so that both
consumers stay busy (given only the dS chain, the state warpgroup idled ~70% of the time). te
and X + X^T are written over the state warpgroup's own tiles once it is done with them (dvn's,
M's), and Pm over P's once the state warpgroup has read P: that shared memory holds the second
slot of q and k.

Registers (setmaxnreg): state 256, grad 224, loader and tail 24 (the three sum to the 3 x 168
the block launches with: more would leave an increase waiting forever); ptxas (sm_90a,
`tools/kernel_sass.py`, 2026-12-07) reports 96 bytes of spill stores, 80 of them in the grad
warpgroup and 8 in the loader and tail warps; setting the two consumers' registers to 248 / 232
or 240 / 240 spilled about as much. Shared
memory 225 KiB of the 227 a block may have (checked by the CPU lowering tests). Only the grad
warpgroup may reduce across warps: TileLang's cross-warp reduction syncs on fixed named barriers
(1 and 2), so two warpgroups reducing at once would meet at the same barrier (the tail warps sum
across their two warps through shared memory and their own named barrier).
Only the walk's first chunk (a sequence's or partition's last) can be partial; the loader zeroes
its rows >= L after the TMA copies land, so no product needs more masks than the causal ones.

The v-head chain (chain_v_heads, GVA; `v_head_chain.py`): a qk-head's v-heads are one cluster
that adds their dq / dk rows in order into [1,T,H,K]; without it per-v-head parts [1,T,HV,K].

Arguments: q, k [1,T,H,K]; do, vres [1,T,HV,V]; ag [1,T,HV,64] (dtype); gc, g (the gate as
given), beta [1,T,HV] fp32; h [NC,HV,K,V] dtype (state entering each chunk); cu_seqlens, chunk_offsets [N+1] int32;
order [N] int32 (the sequences in the order their blocks start, `kernels.tables.walk_order`);
dht [NT,HV,K,V] fp32 (gradient of each sequence's final state; read when use_dht); outputs
dq_out, dk_out dtype: [1,T,H,K] with the chain, else [1,T,HV,K] (per v-head parts, or with
HV == H dq and dk), dv [1,T,HV,V] dtype,
dg, db [1,T,HV] fp32 (dg already reverse-cumsummed inside the chunk, 0 where g < KERNEL_GATE_FLOOR), dh0 [N0,HV,K,V] fp32
(written when store_dh0). Padding rows of a partial chunk carry q = k = v = 0 and beta = 0.
"""

from ...constants import KERNEL_GATE_FLOOR
from .common import CHUNK, LOG2E, checks_own_bounds, import_tilelang, lowers_slowly, ordered_block, tl_dtype
from .v_head_chain import CHAIN_BARRIER, CHAIN_PRELUDE, MAX_CHAIN_GROUP


@lowers_slowly
@checks_own_bounds
def build_bwd_fused_ws_kernel(H: int, HV: int, K: int, V: int, dtype: str, scale: float, use_dht: bool,
                              store_dh0: bool, chain_v_heads: bool = False):
    """PrimFunc `gdn_bwd_fused_ws` (grid v-heads per qk-head x N x H, 384 threads; see the module
    docstring). chain_v_heads: dq, dk [1,T,H,K] summed over each qk-head's v-heads in the walk
    (the v-head chain) instead of per-v-head parts [1,T,HV,K]."""
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    scale = float(scale)
    assert HV % H == 0 and K % 32 == 0 and V % 16 == 0 and K <= 128 and V <= 128
    chain = bool(chain_v_heads) and grp > 1
    assert not chain or grp <= MAX_CHAIN_GROUP
    HQ = H if chain else HV  # heads of the dq / dk outputs
    WG = 128
    # registers per thread (setmaxnreg; 128 x (state + grad + loader) <= 64K)
    STATE_REGS, GRAD_REGS, LOADER_REGS = 256, 224, 24
    RS = 16  # rows per slice of the <S, dS'> reduction
    TAIL = 2 * WG + 32  # the first of the dG tail's 64 threads (two warps of the loader's warpgroup)
    TAIL_BARRIER = 8  # their named barrier (TileLang's own syncs use ids 0-4 here)

    Ttot = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N1 = T.dynamic("num_seqs_plus_one")
    NS = T.dynamic("num_seqs")
    NT = T.dynamic("n_dht")
    N0 = T.dynamic("n_dh0")

    @T.macro
    def rowsum_times(x, y, row, out):
        # out = rowsum(x o y) (x, y [C, C] fp32 fragments; x is overwritten); a row sum stays
        # inside each warp (see the state warpgroup's note on reductions)
        for i, j in T.Parallel(C, C):
            x[i, j] = x[i, j] * y[i, j]
        T.reduce_sum(x, row, dim=1)
        T.copy(row, out)

    @T.macro
    def gate_p(g_s, qk_f, cc_f, p_s, p_ready, slot):
        # P = scale tril_incl(q k^T o Gam) of the chunk in q / k / G slot `slot` from its q k^T in
        # qk_f, for the state warpgroup (q k^T stays in qk_f for the grad warpgroup's Pm o q k^T).
        # Gate, mask, store in loops of their own (the elementwise rule, hopper/common.py); G
        # falls along the chunk, so the clamp changes only masked entries.
        for i, j in T.Parallel(C, C):
            cc_f[i, j] = qk_f[i, j] * T.exp2(T.min(g_s[slot, i] - g_s[slot, j], T.float32(0)) * LOG2E) * scale
        for i, j in T.Parallel(C, C):
            cc_f[i, j] = T.if_then_else(i >= j, cc_f[i, j], T.float32(0))
        T.copy(cc_f, p_s)  # the state warpgroup has read the last P (the grad waited before Pm)
        T.fence_proxy_async()
        T.barrier_arrive(p_ready)

    @T.macro
    def land_rows(out, rows, t0, L, oh, add):
        # a chunk's dq or dk rows (fp32 fragment) into out: stored, or with `add` (the v-head
        # chain's ranks after the first) added where they lie by reductions in L2 (in rank order)
        if add:
            # (column pairs; the prelude makes them REDs: no value comes back, nothing waits on it)
            for i, d in T.Parallel(C, K):
                if i < L:
                    T.atomic_add(out[0, t0 + i, oh, d], rows[i, d])
        else:
            for i, d in T.Parallel(C, K):
                if i < L:
                    out[0, t0 + i, oh, d] = rows[i, d]

    @T.macro
    def load_qkg(q, k, gc, beta, q_s, k_s, g_s, b_s, ready_c, s0, c, bh, bhv, slot):
        # q, k (TMA), G and beta of the whole chunk c into slot `slot`
        t0 = s0 + c * C
        T.tma_copy(q[0, t0 : t0 + C, bh, :], q_s[slot, :, :], barrier=ready_c[slot])
        T.tma_copy(k[0, t0 : t0 + C, bh, :], k_s[slot, :, :], barrier=ready_c[slot])
        for i in T.Parallel(C):
            g_s[slot, i] = gc[0, t0 + i, bhv]
            b_s[slot, i] = beta[0, t0 + i, bhv]
        T.barrier_arrive(ready_c[slot])

    @T.prim_func
    def gdn_bwd_fused_ws(
        q: T.Tensor((1, Ttot, H, K), dtype),
        k: T.Tensor((1, Ttot, H, K), dtype),
        do: T.Tensor((1, Ttot, HV, V), dtype),
        vres: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        g: T.Tensor((1, Ttot, HV), acc),
        beta: T.Tensor((1, Ttot, HV), acc),
        h: T.Tensor((NC, HV, K, V), dtype),
        cu_seqlens: T.Tensor((N1,), "int32"),
        chunk_offsets: T.Tensor((N1,), "int32"),
        order: T.Tensor((NS,), "int32"),
        dht: T.Tensor((NT, HV, K, V), acc),
        dq_out: T.Tensor((1, Ttot, HQ, K), dtype),
        dk_out: T.Tensor((1, Ttot, HQ, K), dtype),
        dv: T.Tensor((1, Ttot, HV, V), dtype),
        dg: T.Tensor((1, Ttot, HV), acc),
        db: T.Tensor((1, Ttot, HV), acc),
        dh0: T.Tensor((N0, HV, K, V), acc),
    ):
        # a qk-head's v-heads are one cluster (chain) or launch side by side (x fastest)
        with T.Kernel(grp, N1 - 1, H, threads=3 * WG, cluster_dims=(grp, 1, 1) if chain else None,
                      prelude=CHAIN_PRELUDE if chain else None) as (rank, bn, bh_block):
            n, bh = ordered_block(order, bn, bh_block, N1 - 1, H)  # longest sequences first
            bhv = bh * grp + rank
            oh = bh if chain else bhv  # head of this block's dq / dk rows
            s0 = cu_seqlens[n]
            seq_len = cu_seqlens[n + 1] - s0
            c_first = chunk_offsets[n]
            n_chunks = T.ceildiv(seq_len, C)

            # inputs, in four load groups: A (Ag, vres), B (dO), H (h), C (q, k, G, beta: two slots,
            # so that the next chunk's land while this one's are in use and the grad warpgroup can
            # form the next chunk's P before this chunk's end)
            a_s = T.alloc_shared((C, C), dtype)
            vr_s = T.alloc_shared((C, V), dtype)
            do_s = T.alloc_shared((C, V), dtype)
            h_s = T.alloc_shared((K, V), dtype)
            q_s = T.alloc_shared((2, C, K), dtype)
            k_s = T.alloc_shared((2, C, K), dtype)
            g_s = T.alloc_shared((2, C), acc)
            b_s = T.alloc_shared((2, C), acc)
            # hand-overs between the state and grad warpgroups
            dh_s = T.alloc_shared((K, V), dtype)  # dS' (gradient of the state leaving the chunk)
            p_s = T.alloc_shared((C, C), dtype)  # P (grad -> state), then Pm (the grad's own)
            # the state's row / column sums for dG and dbeta, one slot per chunk parity (the grad
            # warpgroup reads a chunk's at its end, when the state warpgroup may be a chunk ahead):
            # 0 colsum(dAg o Ag), 1 / 2 row / col of X o kk^T
            xr_s = T.alloc_shared((2, 3, C), acc)
            # the grad's row terms of dG, one slot per chunk parity (the tail reads a chunk's while the
            # grad warpgroup works on the next): 0 / 1 row / col of Pm o qk^T, 2 the q term, 3 the
            # -E t S^T term, 4 the v_new dS'^T term
            r_s = T.alloc_shared((2, 5, C), acc)
            hrow_s = T.alloc_shared((2, RS), acc)  # exp(GL) <S, dS'>'s row-slice sums
            wt_s = T.alloc_shared((2, 4), acc)  # the tail's warp totals: suffix sums, then c
            # the state warpgroup's, each handed to the grad warpgroup at the end of its use
            dvn_s = T.alloc_shared((C, V), dtype)  # dvn, then te = -exp(G) t (-> grad)
            da_s = T.alloc_shared((C, C), dtype)  # dAg, then dAg Ag^T, then X + X^T (-> grad)
            # private to the grad warpgroup
            vn_s = T.alloc_shared((C, V), dtype)  # v_new

            # state warpgroup
            ds_f = T.alloc_fragment((K, V), acc)
            cv_f = T.alloc_fragment((C, V), acc)
            sa_f = T.alloc_fragment((C, C), acc)
            sx_f = T.alloc_fragment((C, C), acc)
            srow_f = T.alloc_fragment((C,), acc)
            sd_f = T.alloc_fragment((C, C), acc)  # dAg^T o Ag^T, apart from sx_f (see the note below)
            sxt_f = T.alloc_fragment((C, C), acc)  # X^T
            qe_f = T.alloc_fragment((K, C), dtype)  # (scale exp(G) q)^T: the update's register A operand
            sdrow_f = T.alloc_fragment((C,), acc)
            glast_s = T.alloc_var(acc)
            # grad warpgroup
            qk_f = T.alloc_fragment((C, C), acc)
            cc_f = T.alloc_fragment((C, C), acc)
            x_f = T.alloc_fragment((C, C), acc)
            vn_f = T.alloc_fragment((C, V), acc)
            acc_f = T.alloc_fragment((C, K), acc)  # dq, then dk
            tmp_f = T.alloc_fragment((C, K), acc)
            hd_f = T.alloc_fragment((RS, V), acc)
            hrow_f = T.alloc_fragment((RS,), acc)
            # one fragment per reduction result (and per unrelated use): a fragment shared by
            # several reductions joins their loops into one layout-inference component, which
            # TileLang searches root by root (tens of seconds of lowering for the same code)
            pmqk_row_f = T.alloc_fragment((C,), acc)
            q_term_f = T.alloc_fragment((C,), acc)
            te_term_f = T.alloc_fragment((C,), acc)
            vn_term_f = T.alloc_fragment((C,), acc)
            col_f = T.alloc_fragment((C,), acc)
            glast_g = T.alloc_var(acc)
            # the dG tail's (one thread per row)
            dg_v = T.alloc_var(acc)
            c_v = T.alloc_var(acc)

            landed = T.alloc_barrier(arrive_count=32)  # the walk's first tiles (the loader waits)
            ready_a = T.alloc_barrier(arrive_count=32)  # the loader warp's arrivals + TMA bytes
            ready_b = T.alloc_barrier(arrive_count=32)
            ready_h = T.alloc_barrier(arrive_count=32)
            ready_c = T.alloc_barrier(arrive_count=[32, 32])  # one per slot
            free_a = T.alloc_barrier(arrive_count=2 * WG)  # both consumers are done with a group
            free_b = T.alloc_barrier(arrive_count=2 * WG)
            free_h = T.alloc_barrier(arrive_count=WG)  # h: the grad warpgroup's alone
            free_c = T.alloc_barrier(arrive_count=[2 * WG + C, 2 * WG + C])  # consumers and the tail (beta)
            ds_ready = T.alloc_barrier(arrive_count=WG)
            ds_free = T.alloc_barrier(arrive_count=WG)
            p_ready = T.alloc_barrier(arrive_count=WG)
            p_free = T.alloc_barrier(arrive_count=WG)
            x_ready = T.alloc_barrier(arrive_count=WG)
            x_free = T.alloc_barrier(arrive_count=WG)
            te_ready = T.alloc_barrier(arrive_count=WG)
            te_free = T.alloc_barrier(arrive_count=WG)
            tail_ready = T.alloc_barrier(arrive_count=[WG, WG])  # a chunk's r_s / hrow_s slot (grad -> tail)
            tail_free = T.alloc_barrier(arrive_count=[C, C])  # the tail is done with a slot of r_s and xr_s

            tx = T.get_thread_binding()
            if chain:
                # chunks whose dq / dk rows the v-head before has published (raised by one of its
                # grad threads after the group's barrier); zero before any block may raise it
                published = T.alloc_shared((1,), "int32")
                if tx == 0:
                    published[0] = 0
                T.call_extern("handle", "fqc_cluster_sync")

            # A wait with parity (cc + 1) % 2 is for the previous chunk's arrival: it passes at
            # once for cc = 0 (a fresh mbarrier counts its phase before the first as complete).
            if tx < WG:
                # ---------------- state warpgroup ----------------
                T.set_max_nreg(STATE_REGS, 1)
                if use_dht:
                    T.copy(dht[n, bhv, :, :], ds_f)
                else:
                    T.clear(ds_f)
                for cc in T.serial(n_chunks):
                    c = n_chunks - 1 - cc
                    t0 = s0 + c * C
                    L = T.min(seq_len - c * C, C)
                    s = cc % 2
                    ph = cc % 2
                    T.barrier_wait(ds_free, (cc + 1) % 2)  # grad has read the last chunk's dS'
                    T.copy(ds_f, dh_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(ds_ready)
                    T.barrier_wait(ready_c[s], (cc // 2) % 2)
                    T.gemm(k_s[s, :, :], dh_s, cv_f, clear_accum=True)
                    glast_s = g_s[s, C - 1]
                    for i, d in T.Parallel(C, V):
                        cv_f[i, d] = cv_f[i, d] * T.exp2((glast_s - g_s[s, i]) * LOG2E)
                    # the update dS = exp(GL) dS' + q^T (scale exp(G) dO) + k^T te starts here: dS'
                    # is in dh_s now
                    for i, d in T.Parallel(K, V):
                        ds_f[i, d] = ds_f[i, d] * T.exp2(glast_s * LOG2E)
                    # dvn = P^T dO + diag(exp(GL - G)) k dS'  (rows >= L zero)
                    T.barrier_wait(ready_b, ph)
                    T.barrier_wait(p_ready, ph)
                    T.gemm(p_s, do_s, cv_f, transpose_A=True)
                    T.barrier_arrive(p_free)
                    for i, d in T.Parallel(C, V):
                        cv_f[i, d] = T.if_then_else(i < L, cv_f[i, d], T.float32(0))
                    T.barrier_wait(te_free, (cc + 1) % 2)  # grad has read the last chunk's te
                    T.copy(cv_f, dvn_s)
                    T.fence_proxy_async()
                    # q^T (scale exp(G) dO), q scaled on its way into registers: dO's last use here
                    for d, i in T.Parallel(K, C):
                        qe_f[d, i] = q_s[s, i, d] * T.exp2(g_s[s, i] * LOG2E) * scale
                    T.gemm(qe_f, do_s, ds_f)
                    T.barrier_arrive(free_b)
                    # Column sums here are row sums of the transposed products: a row sum is a
                    # shuffle inside each warp, while a column sum crosses warps through TileLang's
                    # named barrier 1, which the grad warpgroup's reductions use at the same time
                    # (v2 did that: dg came out non-deterministic).
                    # dAg = tril_incl(dvn vres^T) -> da_s
                    T.barrier_wait(ready_a, ph)
                    T.gemm(dvn_s, vr_s, sa_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        sa_f[i, j] = T.if_then_else(i >= j, sa_f[i, j], T.float32(0))
                    T.barrier_wait(x_free, (cc + 1) % 2)  # grad has read the last chunk's X + X^T
                    T.copy(sa_f, da_s)
                    T.fence_proxy_async()
                    # colsum(dAg o Ag) (feeds dbeta) = rowsum(dAg^T o Ag^T), dAg^T = vres dvn^T
                    T.gemm(vr_s, dvn_s, sd_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        sd_f[i, j] = sd_f[i, j] * a_s[j, i]
                    for i, j in T.Parallel(C, C):
                        sd_f[i, j] = T.if_then_else(j >= i, sd_f[i, j], T.float32(0))
                    T.reduce_sum(sd_f, sdrow_f, dim=1)
                    T.barrier_wait(tail_free[s], (cc // 2 + 1) % 2)  # the tail has read chunk cc - 2's
                    T.copy(sdrow_f, xr_s[s, 0, :])
                    # t = Ag^T dvn (= dv), dvn's last use; te = -exp(G) t over dvn in its tile, for the
                    # grad warpgroup and the update's k^T te
                    T.gemm(a_s, dvn_s, cv_f, transpose_A=True, clear_accum=True)
                    for i, d in T.Parallel(C, V):
                        if i < L:
                            dv[0, t0 + i, bhv, d] = cv_f[i, d]
                    for i, d in T.Parallel(C, V):
                        cv_f[i, d] = -cv_f[i, d] * T.exp2(g_s[s, i] * LOG2E)
                    T.copy(cv_f, dvn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(te_ready)
                    T.gemm(k_s[s, :, :], dvn_s, ds_f, transpose_A=True)
                    # M = dAg Ag^T -> da_s; X = -(Ag^T M) o Gam, strictly lower (= diag(beta) dA o Gam)
                    T.gemm(da_s, a_s, sa_f, transpose_B=True, clear_accum=True)
                    T.copy(sa_f, da_s)
                    T.fence_proxy_async()
                    T.gemm(a_s, da_s, sx_f, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        sx_f[i, j] = -sx_f[i, j] * T.exp2(T.min(g_s[s, i] - g_s[s, j], T.float32(0)) * LOG2E)
                    for i, j in T.Parallel(C, C):
                        sx_f[i, j] = T.if_then_else(i > j, sx_f[i, j], T.float32(0))
                    # X^T = -(M^T Ag) o Gam^T, strictly upper: colsum(X o k k^T) = rowsum(X^T o k k^T)
                    T.gemm(da_s, a_s, sxt_f, transpose_A=True, clear_accum=True)
                    T.barrier_arrive(free_a)
                    for i, j in T.Parallel(C, C):
                        sxt_f[i, j] = -sxt_f[i, j] * T.exp2(T.min(g_s[s, j] - g_s[s, i], T.float32(0)) * LOG2E)
                    for i, j in T.Parallel(C, C):
                        sxt_f[i, j] = T.if_then_else(j > i, sxt_f[i, j], T.float32(0))
                    # da_s becomes X + X^T (disjoint triangles): the grad warpgroup's dk needs only
                    # (X + X^T) k, one GEMM instead of two
                    for i, j in T.Parallel(C, C):
                        da_s[i, j] = sx_f[i, j] + sxt_f[i, j]
                    T.fence_proxy_async()
                    # rowsum(X o k k^T) and rowsum(X^T o k k^T) feed dG and dbeta
                    T.gemm(k_s[s, :, :], k_s[s, :, :], sa_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(free_c[s])
                    rowsum_times(sx_f, sa_f, srow_f, xr_s[s, 1, :])
                    rowsum_times(sxt_f, sa_f, srow_f, xr_s[s, 2, :])
                    T.barrier_arrive(x_ready)  # X + X^T and this chunk's xr_s
                if store_dh0:
                    T.copy(ds_f, dh0[n, bhv, :, :])
            elif tx < 2 * WG:
                # ---------------- grad warpgroup ----------------
                T.set_max_nreg(GRAD_REGS, 1)
                # P of the walk's first chunk; each chunk forms the next one's P before it waits
                # for the state warpgroup's X, so that the state warpgroup finds P ready when it
                # starts its next chunk
                if n_chunks > 0:
                    T.barrier_wait(ready_c[0], 0)
                    T.gemm(q_s[0, :, :], k_s[0, :, :], qk_f, transpose_B=True, clear_accum=True)
                    gate_p(g_s, qk_f, cc_f, p_s, p_ready, 0)
                for cc in T.serial(n_chunks):
                    c = n_chunks - 1 - cc
                    t0 = s0 + c * C
                    L = T.min(seq_len - c * C, C)
                    s = cc % 2
                    ph = cc % 2
                    glast_g = g_s[s, C - 1]
                    # v_new = Ag vres (the grad warpgroup's last read of Ag and vres)
                    T.barrier_wait(ready_a, ph)
                    T.gemm(a_s, vr_s, vn_f, clear_accum=True)
                    T.barrier_arrive(free_a)
                    T.copy(vn_f, vn_s)
                    T.fence_proxy_async()
                    # Pm = scale tril_incl(dO v_new^T o Gam) -> p_s once the state warpgroup has read P;
                    # Pm o q k^T feeds dG (qk_f: this chunk's q k^T, formed a chunk ahead)
                    T.barrier_wait(ready_b, ph)
                    T.gemm(do_s, vn_s, cc_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        cc_f[i, j] = cc_f[i, j] * T.exp2(T.min(g_s[s, i] - g_s[s, j], T.float32(0)) * LOG2E) * scale
                    for i, j in T.Parallel(C, C):
                        cc_f[i, j] = T.if_then_else(i >= j, cc_f[i, j], T.float32(0))
                        x_f[i, j] = cc_f[i, j] * qk_f[i, j]
                    T.barrier_wait(p_free, ph)
                    T.copy(cc_f, p_s)
                    T.fence_proxy_async()
                    # dq = scale E dO S^T + Pm k: dO S^T in flight with the sums of Pm o q k^T (this
                    # warpgroup sets the walk's pace: a synchronous product leaves it idle)
                    T.barrier_wait(ready_h, ph)
                    T.wgmma_gemm(do_s, h_s, acc_f, transpose_B=True, clear_accum=True)
                    T.reduce_sum(x_f, pmqk_row_f, dim=1)
                    # batched: two barrier pairs for the 16 columns a thread holds instead of 16
                    # pairs (the unbatched sum took ~22% of this warpgroup's time, ncu); 8, not 16:
                    # its workspace (batch x 128 floats) has to fit in what shared memory is left
                    T.reduce_sum(x_f, col_f, dim=0, batch=8)
                    T.barrier_wait(tail_free[s], (cc // 2 + 1) % 2)  # the tail has read chunk cc - 2's
                    T.copy(pmqk_row_f, r_s[s, 0, :])
                    T.copy(col_f, r_s[s, 1, :])
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_f, num_regs=C * K // WG)  # no read of acc_f before the wait
                    T.barrier_arrive(free_b)
                    for i, d in T.Parallel(C, K):
                        acc_f[i, d] = acc_f[i, d] * (T.exp2(g_s[s, i] * LOG2E) * scale)
                    for i, d in T.Parallel(C, K):
                        tmp_f[i, d] = acc_f[i, d] * q_s[s, i, d]
                    # Pm k in flight with the q term's row sums
                    T.wgmma_gemm(p_s, k_s[s, :, :], acc_f)
                    T.reduce_sum(tmp_f, q_term_f, dim=1)
                    T.copy(q_term_f, r_s[s, 2, :])
                    if chain:
                        # publish the last chunk's rows (landed half a chunk ago: the release
                        # rarely waits), and wait until the v-head before has landed this chunk's
                        if rank < grp - 1 and cc > 0:
                            T.call_extern("handle", "fqc_publish", T.address_of(published[0]), rank + 1, CHAIN_BARRIER)
                        if rank > 0:
                            T.call_extern("handle", "fqc_wait_count", T.address_of(published[0]), cc + 1, CHAIN_BARRIER)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_f, num_regs=C * K // WG)
                    land_rows(dq_out, acc_f, t0, L, oh, (rank > 0) if chain else False)
                    # dk = Pm^T q + diag(exp(GL - G)) v_new dS'^T + X k + X^T k - E t S^T
                    T.gemm(p_s, q_s[s, :, :], acc_f, transpose_A=True, clear_accum=True)
                    T.barrier_wait(ds_ready, ph)
                    # exp(GL) <S, dS'> (S = h, the state entering the chunk), in row slices
                    T.clear(hd_f)
                    for sl in T.serial(K // RS):
                        for i, d in T.Parallel(RS, V):
                            hd_f[i, d] += T.cast(h_s[sl * RS + i, d], acc) * T.cast(dh_s[sl * RS + i, d], acc)
                    T.reduce_sum(hd_f, hrow_f, dim=1)
                    for i in T.Parallel(RS):
                        hrow_f[i] = hrow_f[i] * T.exp2(glast_g * LOG2E)
                    T.copy(hrow_f, hrow_s[s, :])
                    T.gemm(vn_s, dh_s, tmp_f, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(ds_free)
                    # the next chunk's q k^T (Pm's last read was the product above) in flight with the
                    # v_new term
                    if cc + 1 < n_chunks:
                        T.barrier_wait(ready_c[1 - s], ((cc + 1) // 2) % 2)
                        T.wgmma_gemm(q_s[1 - s, :, :], k_s[1 - s, :, :], qk_f, transpose_B=True, clear_accum=True)
                    for i, d in T.Parallel(C, K):
                        tmp_f[i, d] = tmp_f[i, d] * T.exp2((glast_g - g_s[s, i]) * LOG2E)
                    for i, d in T.Parallel(C, K):
                        acc_f[i, d] = acc_f[i, d] + tmp_f[i, d]
                    for i, d in T.Parallel(C, K):
                        tmp_f[i, d] = tmp_f[i, d] * k_s[s, i, d]
                    T.reduce_sum(tmp_f, vn_term_f, dim=1)
                    T.copy(vn_term_f, r_s[s, 4, :])
                    if cc + 1 < n_chunks:
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(qk_f, num_regs=C * C // WG)
                        gate_p(g_s, qk_f, cc_f, p_s, p_ready, 1 - s)
                    # X k + X^T k = (X + X^T) k (da_s and the dG / dbeta sums from the state warpgroup)
                    # and - E t S^T (te = -E t from the state warpgroup, in dvn_s): one wait for both
                    T.barrier_wait(x_ready, ph)
                    T.wgmma_gemm(da_s, k_s[s, :, :], acc_f)
                    T.barrier_wait(te_ready, ph)
                    T.gemm(dvn_s, h_s, tmp_f, transpose_B=True, clear_accum=True)
                    T.warpgroup_fence_operand(acc_f, num_regs=C * K // WG)
                    T.barrier_arrive(x_free)
                    T.barrier_arrive(te_free)
                    T.barrier_arrive(free_h)
                    for i, d in T.Parallel(C, K):
                        acc_f[i, d] = acc_f[i, d] + tmp_f[i, d]
                    for i, d in T.Parallel(C, K):
                        tmp_f[i, d] = tmp_f[i, d] * k_s[s, i, d]
                    T.reduce_sum(tmp_f, te_term_f, dim=1)
                    T.copy(te_term_f, r_s[s, 3, :])
                    land_rows(dk_out, acc_f, t0, L, oh, (rank > 0) if chain else False)
                    T.barrier_arrive(tail_ready[s])  # dG and dbeta: the tail warps
                    T.barrier_arrive(free_c[s])  # q, k, G and beta (the tail still reads beta)
                if chain:
                    if rank < grp - 1 and n_chunks > 0:
                        T.call_extern("handle", "fqc_publish", T.address_of(published[0]), rank + 1, CHAIN_BARRIER)
            else:
                # ---------------- loader: one warp ----------------
                T.set_max_nreg(LOADER_REGS, 0)
                if tx < TAIL:
                    if n_chunks > 0:
                        # the walk's first chunk (the sequence's last, the only one that can be
                        # partial)
                        t_first = s0 + (n_chunks - 1) * C
                        L_first = seq_len - (n_chunks - 1) * C
                        for i in T.Parallel(C):
                            g_s[0, i] = gc[0, t_first + T.min(i, L_first - 1), bhv]
                            b_s[0, i] = T.if_then_else(i < L_first, beta[0, t_first + T.min(i, L_first - 1), bhv],
                                                       T.float32(0))
                        # whole tiles by TMA; for a partial chunk the loader waits for them and
                        # zeroes rows >= L (the next sequence's tokens, or past the tensor: zeros)
                        # before releasing them
                        T.tma_copy(ag[0, t_first : t_first + C, bhv, :], a_s, barrier=landed)
                        T.tma_copy(vres[0, t_first : t_first + C, bhv, :], vr_s, barrier=landed)
                        T.tma_copy(h[c_first + n_chunks - 1, bhv, :, :], h_s, barrier=landed)
                        T.tma_copy(do[0, t_first : t_first + C, bhv, :], do_s, barrier=landed)
                        T.tma_copy(q[0, t_first : t_first + C, bh, :], q_s[0, :, :], barrier=landed)
                        T.tma_copy(k[0, t_first : t_first + C, bh, :], k_s[0, :, :], barrier=landed)
                        T.barrier_arrive(landed)
                        T.barrier_wait(landed, 0)
                        if L_first < C:
                            # row by row (1-D parallel loops): a masked 2-D loop per tile
                            # took ~1.8 s of the kernel's lowering
                            for i in T.serial(C - L_first):
                                for d in T.Parallel(C):
                                    a_s[L_first + i, d] = T.cast(0, dtype)
                                for d in T.Parallel(V):
                                    vr_s[L_first + i, d] = T.cast(0, dtype)
                                    do_s[L_first + i, d] = T.cast(0, dtype)
                                for d in T.Parallel(K):
                                    q_s[0, L_first + i, d] = T.cast(0, dtype)
                                    k_s[0, L_first + i, d] = T.cast(0, dtype)
                            T.fence_proxy_async()
                        T.barrier_arrive(ready_a)
                        T.barrier_arrive(ready_b)
                        T.barrier_arrive(ready_h)
                        T.barrier_arrive(ready_c[0])
                        if n_chunks > 1:  # the next chunk's slot is free
                            load_qkg(q, k, gc, beta, q_s, k_s, g_s, b_s, ready_c, s0, n_chunks - 2, bh, bhv, 1)
                    # every later chunk is whole. Each group is reloaded in the order the consumers
                    # release them (dO early in a chunk, then Ag / vres, then h); q, k, G and beta
                    # one chunk ahead, once both consumers are done with the chunk before
                    for cn in T.serial(n_chunks - 1):
                        cc = cn + 1
                        c = n_chunks - 1 - cc
                        t0 = s0 + c * C
                        T.barrier_wait(free_b, cn % 2)
                        T.tma_copy(do[0, t0 : t0 + C, bhv, :], do_s, barrier=ready_b)
                        T.barrier_arrive(ready_b)
                        T.barrier_wait(free_a, cn % 2)
                        T.tma_copy(ag[0, t0 : t0 + C, bhv, :], a_s, barrier=ready_a)
                        T.tma_copy(vres[0, t0 : t0 + C, bhv, :], vr_s, barrier=ready_a)
                        T.barrier_arrive(ready_a)
                        T.barrier_wait(free_h, cn % 2)
                        T.tma_copy(h[c_first + c, bhv, :, :], h_s, barrier=ready_h)
                        T.barrier_arrive(ready_h)
                        if cc + 1 < n_chunks:
                            T.barrier_wait(free_c[1 - cc % 2], ((cc + 1) // 2 + 1) % 2)
                            load_qkg(q, k, gc, beta, q_s, k_s, g_s, b_s, ready_c, s0, c - 1, bh, bhv, 1 - cc % 2)
                elif tx < TAIL + C:
                    # dG and dbeta, a thread per row, off the grad warpgroup's path. dg[i] =
                    # sum_{j >= i} d[j] + c: d the grad's and the state's row terms, c the sum over the
                    # chunk of the last valid row's scalar terms (exp(GL) <S, dS'> and the v_new
                    # terms), which reach every row i < L. The suffix sum runs in each warp by
                    # shuffles; the first warp adds the second's total, both add c (via wt_s)
                    row = tx - TAIL
                    lane = row % 32
                    for cc in T.serial(n_chunks):
                        c = n_chunks - 1 - cc
                        t0 = s0 + c * C
                        L = T.min(seq_len - c * C, C)
                        s = cc % 2
                        # a gate below the floor was read as the floor: its gradient is 0, not the
                        # rounding residue of the reverse sum (read before the wait: off its path)
                        floored = g[0, t0 + T.min(row, L - 1), bhv] < T.float32(KERNEL_GATE_FLOOR)
                        T.barrier_wait(tail_ready[s], (cc // 2) % 2)
                        dg_v = (r_s[s, 2, row] + r_s[s, 3, row] - r_s[s, 4, row] + r_s[s, 0, row] - r_s[s, 1, row]
                                + xr_s[s, 1, row] - xr_s[s, 2, row])
                        c_v = r_s[s, 4, row] + T.if_then_else(row < RS, hrow_s[s, T.min(row, RS - 1)], T.float32(0))
                        for sh in T.unroll(5):
                            shifted = T.shfl_down(dg_v, 1 << sh)
                            dg_v = dg_v + T.if_then_else(lane + (1 << sh) < 32, shifted, T.float32(0))
                        c_v = T.warp_reduce_sum(c_v)
                        if lane == 0:
                            wt_s[s, row // 32] = dg_v
                            wt_s[s, 2 + row // 32] = c_v
                        T.sync_threads(TAIL_BARRIER, C)
                        dg_v = dg_v + T.if_then_else(row < 32, wt_s[s, 1], T.float32(0)) + wt_s[s, 2] + wt_s[s, 3]
                        if row < L:
                            dg[0, t0 + row, bhv] = T.if_then_else(floored, T.float32(0), dg_v)
                            db[0, t0 + row, bhv] = T.if_then_else(
                                b_s[s, row] != T.float32(0), (xr_s[s, 1, row] + xr_s[s, 0, row]) / b_s[s, row],
                                T.float32(0))
                        T.barrier_arrive(tail_free[s])
                        T.barrier_arrive(free_c[s])

    return gdn_bwd_fused_ws
