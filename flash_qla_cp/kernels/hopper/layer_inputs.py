"""The op's inputs from the projection rows, one pass: causal short conv + SiLU over the q, k, v
channels, q and k l2-normalised per head, and the gates g = -exp(A_log) softplus(a + dt_bias),
beta = sigmoid(b) (x2 with allow_neg_eigval).

One block per (BT tokens, one q, k or v head): it reads its head's columns of P for its tokens and
the K - 1 before them (the conv window), so a q or k head's whole vector is in the block for the
l2 norm; a v-head block also forms that v-head's gates. Same arithmetic as
`reference.layer_steps.op_inputs_forward` (fp32, rounded once when stored).

A tap t - s exists when positions[t] >= s (the token's index in its sequence): packed sequences
and batch rows never see each other. Taps before the first token read `history` [K - 1, C], the
conv inputs before it: under context parallelism the previous rank's last ones, reached by
counting the first sequence's positions from K - 1 (elsewhere positions start at 0 and the
history is never read).
"""

from .common import import_tilelang, tl_dtype

L2NORM_EPS = 1e-6
SOFTPLUS_LINEAR_ABOVE = 20.0  # torch's softplus threshold: softplus(x) = x above it
WINDOW_ROWS = 16  # rows kept for the conv window ahead of a tile (conv_size - 1 <= 15)


def conv_macros(T, NT, conv_size: int, acc: str):
    """The TileLang macros both layer-input kernels share: `load_window` reads a tile's conv inputs
    (rows t0 - (K-1) .., from P or, before the first token, from `history`), its head's taps and
    which taps exist; `conv` forms the pre-activation conv of `rows` tokens from them."""
    K = conv_size
    W = conv_size - 1

    @T.macro
    def load_window(P, history, weight, positions, t0, col, chan, D, rows, x_s, w_s, m_s):
        for i, d in T.Parallel(rows + WINDOW_ROWS, D):
            x_s[i, d] = T.if_then_else(t0 - W + i >= 0, P[T.max(T.min(t0 - W + i, NT - 1), 0), col + d],
                                       history[T.max(t0 + i, 0) % W, chan + d])
        for j, d in T.Parallel(K, D):
            w_s[j, d] = weight[chan + d, j]
        for e, j in T.Parallel(rows, K):  # tap j of token t0 + e exists
            m_s[e, j] = T.if_then_else(positions[T.min(t0 + e, NT - 1)] >= W - j, T.float32(1), T.float32(0))

    @T.macro
    def conv(x_s, w_s, m_s, y_f, rows, D):
        """y_f[e, d] = sum_j w[j, d] x[t0 + e - (W - j), d] over the taps that exist."""
        T.clear(y_f)
        for j in T.unroll(K):
            for e, d in T.Parallel(rows, D):
                y_f[e, d] += T.cast(x_s[e + j, d], acc) * w_s[j, d] * m_s[e, j]

    return load_window, conv


def build_layer_inputs_kernel(H: int, HV: int, dk: int, dv: int, width: int, q_offset: int, q_head_stride: int,
                              k_offset: int, k_head_stride: int, v_offset: int, v_head_stride: int, b_offset: int,
                              b_head_stride: int, a_offset: int, a_head_stride: int, conv_size: int, dtype: str,
                              allow_neg_eigval: bool, block_tokens: int = 64, blocks_per_sm: int = 1):
    """PrimFunc `gdn_layer_inputs(P, history, weight, positions, A_log, dt_bias, q, k, v, g, beta)`:
    P [NT, width], history [conv_size - 1, C] dtype; weight [C, conv_size] fp32 (C = 2 H dk + HV dv,
    channels q, k, v); positions [NT] int32; A_log, dt_bias [HV] fp32 -> q, k [NT, H, dk], v [NT, HV, dv] dtype,
    g, beta [NT, HV] fp32. Grid (ceil(NT / block_tokens), 2 H + HV), 256 threads (blocks_per_sm > 1:
    registers capped so that that many blocks fit an SM; `tools/tune_layer.py` times it)."""
    _, T = import_tilelang()
    assert 2 <= conv_size <= WINDOW_ROWS, conv_size
    dtype = tl_dtype(dtype)
    acc = "float32"
    r = HV // H
    K = conv_size
    W = conv_size - 1
    BT = block_tokens
    C = 2 * H * dk + HV * dv
    beta_scale = 2.0 if allow_neg_eigval else 1.0
    NT = T.dynamic("num_tokens")

    load_window, conv = conv_macros(T, NT, conv_size, acc)

    @T.macro
    def conv_silu(P, history, weight, positions, t0, col, chan, D, x_s, w_s, m_s, y_f):
        """y_f[i, d] = silu(sum_j w[chan + d, j] x[t0 + i - (W - j), col + d]) over the taps in the sequence."""
        load_window(P, history, weight, positions, t0, col, chan, D, BT, x_s, w_s, m_s)
        conv(x_s, w_s, m_s, y_f, BT, D)
        for i, d in T.Parallel(BT, D):
            y_f[i, d] = y_f[i, d] / (T.float32(1) + T.exp(-y_f[i, d]))

    @T.macro
    def store_normalised(out, head, t0, y_f, sq_f, ss_f):
        for i, d in T.Parallel(BT, dk):
            sq_f[i, d] = y_f[i, d] * y_f[i, d]
        T.reduce_sum(sq_f, ss_f, dim=1)
        for i, d in T.Parallel(BT, dk):
            if t0 + i < NT:
                out[t0 + i, head, d] = T.cast(y_f[i, d] * T.rsqrt(ss_f[i] + L2NORM_EPS), dtype)

    @T.prim_func
    def gdn_layer_inputs(
        P: T.Tensor((NT, width), dtype),
        history: T.Tensor((W, C), dtype),
        weight: T.Tensor((C, K), acc),
        positions: T.Tensor((NT,), "int32"),
        A_log: T.Tensor((HV,), acc),
        dt_bias: T.Tensor((HV,), acc),
        q: T.Tensor((NT, H, dk), dtype),
        k: T.Tensor((NT, H, dk), dtype),
        v: T.Tensor((NT, HV, dv), dtype),
        g: T.Tensor((NT, HV), acc),
        beta: T.Tensor((NT, HV), acc),
    ):
        with T.Kernel(T.ceildiv(NT, BT), 2 * H + HV, threads=256) as (bt, slot):
            if blocks_per_sm > 1:  # (ptxas then keeps to 65536 / (256 x blocks_per_sm) registers)
                T.annotate_min_blocks_per_sm(blocks_per_sm)
            t0 = bt * BT
            m_s = T.alloc_shared((BT, K), acc)
            xk_s = T.alloc_shared((BT + WINDOW_ROWS, dk), dtype)
            wk_s = T.alloc_shared((K, dk), acc)
            yk_f = T.alloc_fragment((BT, dk), acc)
            sq_f = T.alloc_fragment((BT, dk), acc)
            ss_f = T.alloc_fragment((BT,), acc)
            if dv == dk:  # (one set of buffers serves q, k and v heads)
                xv_s, wv_s, yv_f = xk_s, wk_s, yk_f
            else:
                xv_s = T.alloc_shared((BT + WINDOW_ROWS, dv), dtype)
                wv_s = T.alloc_shared((K, dv), acc)
                yv_f = T.alloc_fragment((BT, dv), acc)
            if slot < H:
                conv_silu(P, history, weight, positions, t0, q_offset + slot * q_head_stride, slot * dk, dk, xk_s, wk_s, m_s,
                          yk_f)
                store_normalised(q, slot, t0, yk_f, sq_f, ss_f)
            elif slot < 2 * H:
                h = slot - H
                conv_silu(P, history, weight, positions, t0, k_offset + h * k_head_stride, H * dk + h * dk, dk, xk_s, wk_s,
                          m_s, yk_f)
                store_normalised(k, h, t0, yk_f, sq_f, ss_f)
            else:
                hv = slot - 2 * H
                h = hv // r
                j = hv % r
                conv_silu(P, history, weight, positions, t0, v_offset + h * v_head_stride + j * dv,
                          2 * H * dk + hv * dv, dv, xv_s, wv_s, m_s, yv_f)
                for i, d in T.Parallel(BT, dv):
                    if t0 + i < NT:
                        v[t0 + i, hv, d] = T.cast(yv_f[i, d], dtype)
                for i in T.Parallel(BT):
                    if t0 + i < NT:
                        pre = T.cast(P[t0 + i, a_offset + h * a_head_stride + j], acc) + dt_bias[hv]
                        softplus = T.if_then_else(pre > SOFTPLUS_LINEAR_ABOVE, pre, T.log1p(T.exp(pre)))
                        g[t0 + i, hv] = -T.exp(A_log[hv]) * softplus
                        b = T.cast(P[t0 + i, b_offset + h * b_head_stride + j], acc)
                        beta[t0 + i, hv] = beta_scale / (T.float32(1) + T.exp(-b))

    return gdn_layer_inputs
