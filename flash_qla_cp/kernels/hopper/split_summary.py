"""State summary of each partition (sm_90a; the intra-card split, `kernels/split.py`): the affine
map S_out = M S_in + h of its chunks, from a zero start.

h is the recurrence on v; M is the same recurrence run on the identity with zero input (columns
of [h | M] are independent, so the grid covers V + K columns in blocks). No q and no output:
three GEMMs per chunk. Warm-up shortcut (`starts`, per partition and v-head): where the gates
decay past the fp32 resolution over the partition's last chunks, h walks only those chunks and
M is 0.
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from .common import CHUNK, LOG2E, import_tilelang, tl_dtype


def build_state_summary_kernel(H: int, HV: int, K: int, V: int, dtype: str, block_c: int = 64,
                               threads: int = 128, num_stages: int = 2):
    """PrimFunc: grid ((V + K) / block_c, len(todo), HV). Column block c0 < V runs the
    recurrence on v[:, c0:c0+block_c] from zero and writes h; c0 >= V runs it on zero input
    from the identity's columns and writes M. Packed [1, T] inputs; partitions by part_cu.

    Arguments: k [1,T,H,K], v [1,T,HV,V], ag [1,T,HV,64] dtype; gc [1,T,HV] fp32;
    part_cu [NP+1] int32; todo [NT] int32 (partitions to summarise); starts [NP,HV] int32
    (`warmup_starts`: h walks from that chunk and M is 0; -1: every chunk, M kept);
    h_out [NP,HV,K,V] fp32; m_out [NP,HV,K,K] fp32.
    """
    _, T = import_tilelang()
    C = CHUNK
    acc = "float32"
    dtype = tl_dtype(dtype)
    grp = HV // H
    BC = block_c
    assert HV % H == 0 and V % BC == 0 and K % BC == 0 and BC % 16 == 0
    NB = (V + K) // BC

    Ttot = T.dynamic("num_tokens")
    NP1 = T.dynamic("num_parts_plus_one")
    NP = T.dynamic("num_parts")
    NT = T.dynamic("num_todo")

    @T.prim_func
    def gdn_state_summary(
        k: T.Tensor((1, Ttot, H, K), dtype),
        v: T.Tensor((1, Ttot, HV, V), dtype),
        ag: T.Tensor((1, Ttot, HV, C), dtype),
        gc: T.Tensor((1, Ttot, HV), acc),
        part_cu: T.Tensor((NP1,), "int32"),
        todo: T.Tensor((NT,), "int32"),
        starts: T.Tensor((NP, HV), "int32"),
        h_out: T.Tensor((NP, HV, K, V), acc),
        m_out: T.Tensor((NP, HV, K, K), acc),
    ):
        with T.Kernel(NB, NT, HV, threads=threads) as (bc, bt, bhv):
            p = todo[bt]
            bh = bhv // grp
            c0 = bc * BC
            v_col = T.min(c0, V - BC)  # M blocks read a (discarded) v tile too: one code path

            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, BC), dtype)
            a_s = T.alloc_shared((C, C), dtype)
            g_s = T.alloc_shared((C,), acc)
            gl_s = T.alloc_shared((C,), acc)
            h_s = T.alloc_shared((K, BC), dtype)
            w_s = T.alloc_shared((C, BC), dtype)
            vd_s = T.alloc_shared((C, BC), dtype)

            s_f = T.alloc_fragment((K, BC), acc)
            x_f = T.alloc_fragment((C, BC), acc)
            vn_f = T.alloc_fragment((C, BC), acc)
            glast = T.alloc_var(acc)

            # warm-up shortcut: the walk starts at chunk `first` (h) or not at all (dropped M)
            first = T.max(starts[p, bhv], 0)
            dropped = (c0 >= V) and (starts[p, bhv] >= 0)
            t_start = part_cu[p] + first * C
            seq_len = part_cu[p + 1] - t_start
            n_chunks = T.ceildiv(seq_len, C)
            for i, j in T.Parallel(K, BC):
                s_f[i, j] = T.if_then_else((c0 >= V) and (i == c0 - V + j) and (not dropped), T.float32(1),
                                           T.float32(0))

            for c in T.Pipelined(T.if_then_else(dropped, 0, n_chunks), num_stages=num_stages):
                t0 = t_start + c * C
                L = T.min(seq_len - c * C, C)
                # whole tiles, as in the fused forward: rows >= L are masked out of the update
                T.copy(k[0, t0 : t0 + C, bh, :], k_s)
                T.copy(v[0, t0 : t0 + C, bhv, v_col : v_col + BC], v_s)
                T.copy(ag[0, t0 : t0 + C, bhv, :], a_s)
                for i in T.Parallel(C):
                    g_s[i] = gc[0, t0 + T.min(i, L - 1), bhv]
                for i in T.Parallel(C):
                    gl_s[i] = g_s[i]
                T.copy(s_f, h_s)
                T.gemm(k_s, h_s, x_f, clear_accum=True)
                # loads, masks and shared stores in loops of their own (the elementwise rule,
                # hopper/common.py). The v tile is always loaded (finite), so M blocks zero it by
                # a factor.
                for i, j in T.Parallel(C, BC):
                    x_f[i, j] = (T.cast(v_s[i, j], acc) * T.if_then_else(c0 < V, T.float32(1), T.float32(0))
                                 - T.exp2(gl_s[i] * LOG2E) * x_f[i, j])
                T.copy(x_f, w_s)
                T.gemm(a_s, w_s, vn_f, clear_accum=True)
                glast = gl_s[C - 1]
                for i, j in T.Parallel(C, BC):
                    vn_f[i, j] = vn_f[i, j] * T.exp2((glast - gl_s[i]) * LOG2E)
                for i, j in T.Parallel(C, BC):
                    vn_f[i, j] = T.if_then_else(i < L, vn_f[i, j], T.float32(0))
                T.copy(vn_f, vd_s)
                for i, j in T.Parallel(K, BC):
                    s_f[i, j] = s_f[i, j] * T.exp2(glast * LOG2E)
                T.gemm(k_s, vd_s, s_f, transpose_A=True)

            if c0 < V:
                T.copy(s_f, h_out[p, bhv, :, c0 : c0 + BC])
            else:
                T.copy(s_f, m_out[p, bhv, :, c0 - V : c0 - V + BC])

    return gdn_state_summary
