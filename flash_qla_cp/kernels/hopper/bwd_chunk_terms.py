"""The C x C part of a chunk's gradients, shared by both grad kernels as TileLang macros.

`bwd_grad.build_bwd_grad_group_kernel` (head dims up to 128, whole states on chip) and
`bwd_grad_wide.build_bwd_grad_wide_kernel` (V in slices) form the products that
contract over V differently, then run the same steps on the C x C matrices:

  dAg = tril_incl(dvn vres^T)                  -> colsum(dAg o Ag) for dbeta
  dKK = -(Ag^T (dAg Ag^T)) o Gam, strictly lower -> its row / column sums with k k^T
  Pm  = scale tril_incl(dO v_new^T o Gam)      -> its row / column sums with q k^T
  dg (reverse cumulative sum inside the chunk; 0 where the gate g is below the kernels' floor,
  which prepare read as the floor) and dbeta, stored for the valid rows

Gam_ij = exp(G_i - G_j). Each elementwise step has a loop of its own (the elementwise rule,
hopper/common.py); G falls along the chunk, so clamping the exponent changes only masked entries.
"""

from ...constants import KERNEL_GATE_FLOOR
from .common import CHUNK, LOG2E


def chunk_terms(T, scale):
    """(dag_terms, dkk_terms, pm_terms, store_dg_dbeta) macros for one kernel (`scale` the
    output scale)."""
    C = CHUNK

    @T.macro
    def dag_terms(dag_f, x_f, a_s, m1_s, col_f, r_ab):
        # dag_f: dvn vres^T in, tril_incl of it out (and in m1_s)
        for i, j in T.Parallel(C, C):
            dag_f[i, j] = T.if_then_else(i >= j, dag_f[i, j], T.float32(0))
        T.copy(dag_f, m1_s)
        for i, j in T.Parallel(C, C):
            x_f[i, j] = dag_f[i, j] * a_s[i, j]
        T.reduce_sum(x_f, col_f, dim=0)
        T.copy(col_f, r_ab)

    @T.macro
    def dkk_terms(cc_f, cc2_f, x_f, kk_f, a_s, m1_s, m2_s, g_s, row_f, col_f, r_2r, r_2c):
        # m1_s: dAg; kk_f: k k^T. dKK ends in m2_s
        T.gemm(m1_s, a_s, cc_f, transpose_B=True, clear_accum=True)
        T.copy(cc_f, m2_s)
        T.gemm(a_s, m2_s, cc2_f, transpose_A=True, clear_accum=True)
        for i, j in T.Parallel(C, C):
            cc2_f[i, j] = -cc2_f[i, j] * T.exp2(T.min(g_s[i] - g_s[j], T.float32(0)) * LOG2E)
        for i, j in T.Parallel(C, C):
            cc2_f[i, j] = T.if_then_else(i > j, cc2_f[i, j], T.float32(0))
            x_f[i, j] = cc2_f[i, j] * kk_f[i, j]
        T.copy(cc2_f, m2_s)
        T.reduce_sum(x_f, row_f, dim=1)
        T.reduce_sum(x_f, col_f, dim=0)
        T.copy(row_f, r_2r)
        T.copy(col_f, r_2c)

    @T.macro
    def pm_terms(pm_f, x_f, qk_f, g_s, m1_s, row_f, col_f, r_1r, r_1c):
        # pm_f: dO v_new^T in, Pm out (and in m1_s); qk_f: q k^T
        for i, j in T.Parallel(C, C):
            pm_f[i, j] = pm_f[i, j] * T.exp2(T.min(g_s[i] - g_s[j], T.float32(0)) * LOG2E) * scale
        for i, j in T.Parallel(C, C):
            pm_f[i, j] = T.if_then_else(i >= j, pm_f[i, j], T.float32(0))
            x_f[i, j] = pm_f[i, j] * qk_f[i, j]
        T.copy(pm_f, m1_s)
        T.reduce_sum(x_f, row_f, dim=1)
        T.reduce_sum(x_f, col_f, dim=0)
        T.copy(row_f, r_1r)
        T.copy(col_f, r_1c)

    @T.macro
    def store_dg_dbeta(r_q, r_kw, r_kd, r_1r, r_1c, r_2r, r_2c, r_ab, sc_s, dg_s, b_s, g, dg_out, db_out, t0, bhv, L):
        # dg from the row sums (plus the state terms sc_s on the last valid row), reverse
        # cumulative sum; dbeta from the dKK row sums and colsum(dAg o Ag), divided by beta
        for i in T.Parallel(C):
            dg_s[i] = (
                r_q[i] + r_kw[i] - r_kd[i] + r_1r[i] - r_1c[i] + r_2r[i] - r_2c[i]
                + T.if_then_else(i == L - 1, sc_s[0] + sc_s[1], T.float32(0))
            )
        T.cumsum(dg_s, dim=0, reverse=True)
        for i in T.Parallel(C):
            if i < L:
                dg_out[0, t0 + i, bhv] = T.if_then_else(g[0, t0 + i, bhv] < T.float32(KERNEL_GATE_FLOOR), T.float32(0),
                                                        dg_s[i])
                db_out[0, t0 + i, bhv] = T.if_then_else(
                    b_s[i] != T.float32(0), (r_2r[i] + r_ab[i]) / b_s[i], T.float32(0)
                )

    return dag_terms, dkk_terms, pm_terms, store_dg_dbeta
