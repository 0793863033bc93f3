"""Partition scan (sm_90a; the intra-card split, `kernels/split.py`): per sequence,
S_in(p + 1) = M_p S_in(p) + h_p over its partitions (fp32 state, tf32 products), or in reverse
with M^T for the backward's exit gradients: dS_out(p - 1) = M_p^T dS_out(p) + dS_local(p).
"""

# (no `from __future__ import annotations`: TileLang evaluates the kernel signatures)

from .common import import_tilelang


def build_partition_scan_kernel(HV: int, K: int, V: int, reverse: bool, block_v: int = 32, threads: int = 128,
                                use_s0: bool = True):
    """PrimFunc: grid (V / block_v, N, HV). For the partitions of sequence n in order
    (reverse: last to first) writes out[p] = S, then S = m[p] S + add[p] (not after the
    final one); the next step's m and add load while this step multiplies. S starts from s0[n]
    (the initial state, or the final-state gradient), or from zero without use_s0 (s0 is then
    not read: any [N0, HV, K, V] fp32 tensor, no zero fill on the host). (Skipping the product
    where the summary dropped m[p] was tried: a branch inside the pipelined loop made the H200
    scan 30x slower and wrong, so m = 0 is multiplied like any other.)

    Arguments: m [NP,HV,K,K] fp32 (M, or M^T for the reverse scan), add [NP,HV,K,V] fp32,
    seq_parts [N+1] int32, s0 [N,HV,K,V] fp32, out [NP,HV,K,V] fp32.
    """
    _, T = import_tilelang()
    acc = "float32"
    BV = block_v
    assert V % BV == 0 and BV % 16 == 0
    NP = T.dynamic("num_parts")
    N1 = T.dynamic("num_seqs_plus_one")
    N0 = T.dynamic("n_s0")

    @T.prim_func
    def gdn_partition_scan(
        m: T.Tensor((NP, HV, K, K), acc),
        add: T.Tensor((NP, HV, K, V), acc),
        seq_parts: T.Tensor((N1,), "int32"),
        s0: T.Tensor((N0, HV, K, V), acc),
        out: T.Tensor((NP, HV, K, V), acc),
    ):
        with T.Kernel(V // BV, N1 - 1, HV, threads=threads) as (bv, n, bhv):
            v0 = bv * BV
            p_first = seq_parts[n]
            n_parts = seq_parts[n + 1] - p_first
            m_s = T.alloc_shared((K, K), acc)
            a_s = T.alloc_shared((K, BV), acc)
            st_s = T.alloc_shared((BV, K), acc)  # S^T: the tf32 MMA wants both operands K-major
            s_f = T.alloc_fragment((K, BV), acc)

            if use_s0:
                T.copy(s0[n, bhv, :, v0 : v0 + BV], s_f)
            else:
                T.clear(s_f)
            # every sequence has >= 1 partition; the loads of step i + 1 overlap step i's product
            for i in T.Pipelined(n_parts - 1, num_stages=2):
                p = (p_first + n_parts - 1 - i) if reverse else (p_first + i)
                T.copy(m[p, bhv, :, :], m_s)
                T.copy(add[p, bhv, :, v0 : v0 + BV], a_s)
                T.copy(s_f, out[p, bhv, :, v0 : v0 + BV])
                for r, c in T.Parallel(K, BV):
                    st_s[c, r] = s_f[r, c]
                T.copy(a_s, s_f)
                T.gemm(m_s, st_s, s_f, transpose_B=True)
            T.copy(s_f, out[p_first if reverse else p_first + n_parts - 1, bhv, :, v0 : v0 + BV])

    return gdn_partition_scan
