"""Backward of `layer_inputs.py`: from the op's input gradients (dq, dk of the normalised q, k; dv,
dg, dbeta) to the gradient of the projection rows (their q, k, v, b, a columns) and the partial sums
of the conv weight, A_log and dt_bias gradients.

One block per (BT output tokens, one q, k or v head). The conv input's gradient at token t needs
the pre-conv gradient dy at t .. t + K - 1, so a block recomputes the conv (y, silu, the l2 norm)
for its BT tokens and the LOOKAHEAD after them, forms dy there, and reads it back for the
transposed conv; a tap t + s counts when positions[t + s] == positions[t] + s (same sequence).
Parameter gradients are written per block (the conv weight's) or per token (A_log's, dt_bias's),
in fp32, and summed on the host in a fixed order (deterministic). The first block also writes dy of
the first K - 1 tokens (dy_head), from which the host forms the gradient of the conv `history`
(context parallelism). Same arithmetic as `reference.layer_steps.op_inputs_backward`.
"""

from .common import import_tilelang, tl_dtype
from .layer_inputs import L2NORM_EPS, SOFTPLUS_LINEAR_ABOVE, WINDOW_ROWS

LOOKAHEAD = 16  # tokens after a block's outputs whose dy the transposed conv reads (conv_size - 1 <= 15)


def conv_macros(T, NT, conv_size: int, acc: str):
    """The backward's conv steps: `load_window` reads a tile's conv inputs (rows t0 - (K-1) ..,
    from P or, before the first token, from `history`), its head's taps and which taps exist;
    `conv` forms the pre-activation conv of `rows` tokens from them."""
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


def build_layer_inputs_bwd_kernel(H: int, HV: int, dk: int, dv: int, width: int, q_offset: int, q_head_stride: int,
                                  k_offset: int, k_head_stride: int, v_offset: int, v_head_stride: int, b_offset: int,
                                  b_head_stride: int, a_offset: int, a_head_stride: int, z_offset: int,
                                  z_head_stride: int, conv_size: int, dtype: str, allow_neg_eigval: bool,
                                  block_tokens: int = 32, grad_parts: int = 1,
                                  blocks_per_sm: int = 1):
    """PrimFunc `gdn_layer_inputs_bwd(P, history, weight, positions, A_log, dt_bias, grad_q, grad_k, grad_v, dg,
    dbeta, dz, dP, dweight_part, da_tokens, dA_log_tokens, dy_head)`: inputs as `build_layer_inputs_kernel` plus
    the gradients grad_q, grad_k [NT, H, dk] (with grad_parts > 1: [NT, H, grad_parts, dk], the op's
    per-v-head parts, summed here), grad_v [NT, HV, dv] (dtype), dg, dbeta [NT, HV] fp32 and the gated
    norm's dz [NT, HV, dv] (dtype, copied into dP's z columns by the v-head blocks: the layer's
    backward then holds no dP before this kernel and runs no strided copy); writes every column of
    dP [NT, width] (dtype), dweight_part [blocks, C, conv_size] and, per
    token, the terms of the dt_bias and A_log gradients, da_tokens and dA_log_tokens [NT, HV], and
    dy_head [conv_size - 1, C] (fp32). Grid (blocks = ceil(NT / block_tokens),
    2 H + HV), 256 threads (blocks_per_sm > 1: registers capped so that that many blocks fit an
    SM; `tools/tune_layer.py` times it)."""
    _, T = import_tilelang()
    assert 2 <= conv_size <= WINDOW_ROWS, conv_size
    dtype = tl_dtype(dtype)
    acc = "float32"
    r = HV // H
    K = conv_size
    W = conv_size - 1
    BT = block_tokens
    E = BT + LOOKAHEAD  # tokens whose dy a block forms
    C = 2 * H * dk + HV * dv
    beta_scale = 2.0 if allow_neg_eigval else 1.0
    NT = T.dynamic("num_tokens")
    NB = T.dynamic("num_blocks")
    load_window, conv = conv_macros(T, NT, conv_size, acc)
    assert grad_parts == 1 or grad_parts == r, (grad_parts, r)
    qk_parts = grad_parts if grad_parts > 1 else 0  # (0: grad_q, grad_k without a parts dim)
    qk_grad_shape = (NT, H, grad_parts, dk) if qk_parts else (NT, H, dk)

    @T.macro
    def conv_grad(P, history, weight, positions, grad, parts, head, t0, bt, col, chan, D, normalise, dP, dweight_part,
                  dy_head, x_s, w_s, m_s, n_s, dy_s, y_f, dn_f, red_f, rs_f, dot_f, out_f, col_f):
        # the conv's inputs for tokens t0 - W .. t0 + E - 1 (clamped rows are masked)
        load_window(P, history, weight, positions, t0, col, chan, D, E, x_s, w_s, m_s)
        for i, j in T.Parallel(BT, K):  # token t0 + i + (W - j) is in t0 + i's sequence
            n_s[i, j] = T.if_then_else(
                (t0 + i + W - j < NT)
                and (positions[T.min(t0 + i + W - j, NT - 1)] == positions[T.min(t0 + i, NT - 1)] + (W - j)),
                T.float32(1), T.float32(0))
        conv(x_s, w_s, m_s, y_f, E, D)
        if parts == 0:  # grad [NT, heads, D]
            for e, d in T.Parallel(E, D):
                dn_f[e, d] = T.if_then_else(t0 + e < NT, T.cast(grad[T.min(t0 + e, NT - 1), head, d], acc),
                                            T.float32(0))
        else:  # grad [NT, heads, parts, D]: the op's per-v-head parts, summed here in fp32
            for e, d in T.Parallel(E, D):
                dn_f[e, d] = T.if_then_else(t0 + e < NT, T.cast(grad[T.min(t0 + e, NT - 1), head, 0, d], acc),
                                            T.float32(0))
            for j in range(1, parts):  # (unrolled as the kernel is traced)
                for e, d in T.Parallel(E, D):
                    dn_f[e, d] += T.if_then_else(t0 + e < NT, T.cast(grad[T.min(t0 + e, NT - 1), head, j, d], acc),
                                                 T.float32(0))
        if normalise:  # dn_f becomes the gradient of silu's output s through the l2 norm
            # (s = silu(y) is recomputed where used: one fragment fewer keeps two blocks per SM)
            for e, d in T.Parallel(E, D):
                red_f[e, d] = y_f[e, d] / (T.float32(1) + T.exp(-y_f[e, d]))
                red_f[e, d] = red_f[e, d] * red_f[e, d]
            T.reduce_sum(red_f, rs_f, dim=1)
            for e, d in T.Parallel(E, D):
                red_f[e, d] = y_f[e, d] / (T.float32(1) + T.exp(-y_f[e, d])) * dn_f[e, d]
            T.reduce_sum(red_f, dot_f, dim=1)
            for e in T.Parallel(E):
                rs_f[e] = T.rsqrt(rs_f[e] + L2NORM_EPS)
            for e, d in T.Parallel(E, D):
                dn_f[e, d] = rs_f[e] * dn_f[e, d] - (y_f[e, d] / (T.float32(1) + T.exp(-y_f[e, d]))) * (
                    rs_f[e] * rs_f[e] * rs_f[e] * dot_f[e])
        for e, d in T.Parallel(E, D):  # dy = ds * silu'(y)
            sig = T.float32(1) / (T.float32(1) + T.exp(-y_f[e, d]))
            dy_s[e, d] = dn_f[e, d] * sig * (T.float32(1) + y_f[e, d] * (T.float32(1) - sig))
        for e, d in T.Parallel(E, D):
            if bt == 0 and e < W:
                dy_head[e, chan + d] = dy_s[e, d]
        T.clear(out_f)
        for j in T.unroll(K):
            for i, d in T.Parallel(BT, D):
                out_f[i, d] += w_s[j, d] * dy_s[i + W - j, d] * n_s[i, j]
        for i, d in T.Parallel(BT, D):
            if t0 + i < NT:
                dP[t0 + i, col + d] = T.cast(out_f[i, d], dtype)
        for j in T.unroll(K):  # d weight[:, j] = sum over the block's tokens of dy * (the input tap j read)
            for i, d in T.Parallel(BT, D):
                out_f[i, d] = dy_s[i, d] * T.cast(x_s[i + j, d], acc) * m_s[i, j]
            T.reduce_sum(out_f, col_f, dim=0)
            for d in T.Parallel(D):
                dweight_part[bt, chan + d, j] = col_f[d]

    @T.prim_func
    def gdn_layer_inputs_bwd(
        P: T.Tensor((NT, width), dtype),
        history: T.Tensor((W, C), dtype),
        weight: T.Tensor((C, K), acc),
        positions: T.Tensor((NT,), "int32"),
        A_log: T.Tensor((HV,), acc),
        dt_bias: T.Tensor((HV,), acc),
        grad_q: T.Tensor(qk_grad_shape, dtype),
        grad_k: T.Tensor(qk_grad_shape, dtype),
        grad_v: T.Tensor((NT, HV, dv), dtype),
        dg: T.Tensor((NT, HV), acc),
        dbeta: T.Tensor((NT, HV), acc),
        dz: T.Tensor((NT, HV, dv), dtype),
        dP: T.Tensor((NT, width), dtype),
        dweight_part: T.Tensor((NB, C, K), acc),
        da_tokens: T.Tensor((NT, HV), acc),
        dA_log_tokens: T.Tensor((NT, HV), acc),
        dy_head: T.Tensor((W, C), acc),
    ):
        with T.Kernel(T.ceildiv(NT, BT), 2 * H + HV, threads=256) as (bt, slot):
            if blocks_per_sm > 1:  # (ptxas then keeps to 65536 / (256 x blocks_per_sm) registers)
                T.annotate_min_blocks_per_sm(blocks_per_sm)
            t0 = bt * BT
            m_s = T.alloc_shared((E, K), acc)
            n_s = T.alloc_shared((BT, K), acc)
            rs_f = T.alloc_fragment((E,), acc)
            dot_f = T.alloc_fragment((E,), acc)
            xk_s = T.alloc_shared((E + WINDOW_ROWS, dk), dtype)
            wk_s = T.alloc_shared((K, dk), acc)
            dyk_s = T.alloc_shared((E, dk), acc)
            yk_f = T.alloc_fragment((E, dk), acc)
            dnk_f = T.alloc_fragment((E, dk), acc)
            redk_f = T.alloc_fragment((E, dk), acc)
            outk_f = T.alloc_fragment((BT, dk), acc)
            colk_f = T.alloc_fragment((dk,), acc)
            if dv == dk:  # (one set of buffers serves q, k and v heads)
                xv_s, wv_s, dyv_s, yv_f, dnv_f, outv_f, colv_f = xk_s, wk_s, dyk_s, yk_f, dnk_f, outk_f, colk_f
            else:
                xv_s = T.alloc_shared((E + WINDOW_ROWS, dv), dtype)
                wv_s = T.alloc_shared((K, dv), acc)
                dyv_s = T.alloc_shared((E, dv), acc)
                yv_f = T.alloc_fragment((E, dv), acc)
                dnv_f = T.alloc_fragment((E, dv), acc)
                outv_f = T.alloc_fragment((BT, dv), acc)
                colv_f = T.alloc_fragment((dv,), acc)
            if slot < H:
                conv_grad(P, history, weight, positions, grad_q, qk_parts, slot, t0, bt,
                          q_offset + slot * q_head_stride, slot * dk, dk, True, dP, dweight_part, dy_head,
                          xk_s, wk_s, m_s, n_s, dyk_s, yk_f, dnk_f, redk_f, rs_f, dot_f, outk_f, colk_f)
            elif slot < 2 * H:
                h = slot - H
                conv_grad(P, history, weight, positions, grad_k, qk_parts, h, t0, bt,
                          k_offset + h * k_head_stride, H * dk + h * dk, dk, True, dP, dweight_part, dy_head,
                          xk_s, wk_s, m_s, n_s, dyk_s, yk_f, dnk_f, redk_f, rs_f, dot_f, outk_f, colk_f)
            else:
                hv = slot - 2 * H
                h = hv // r
                j = hv % r
                conv_grad(P, history, weight, positions, grad_v, 0, hv, t0, bt, v_offset + h * v_head_stride + j * dv,
                          2 * H * dk + hv * dv, dv, False, dP, dweight_part, dy_head, xv_s, wv_s, m_s, n_s, dyv_s, yv_f,
                          dnv_f, None, None, None, outv_f, colv_f)
                for i, d in T.Parallel(BT, dv):
                    if t0 + i < NT:
                        dP[t0 + i, z_offset + h * z_head_stride + j * dv + d] = dz[t0 + i, hv, d]
                # gates: g = -exp(A_log) softplus(pre), pre = a + dt_bias; beta = beta_scale sigmoid(b)
                for i in T.Parallel(BT):
                    if t0 + i < NT:
                        t = t0 + i
                        pre = T.cast(P[t, a_offset + h * a_head_stride + j], acc) + dt_bias[hv]
                        softplus = T.if_then_else(pre > SOFTPLUS_LINEAR_ABOVE, pre, T.log1p(T.exp(pre)))
                        A = T.exp(A_log[hv])
                        da = -A * dg[t, hv] / (T.float32(1) + T.exp(-pre))
                        sb = T.float32(1) / (T.float32(1) + T.exp(-T.cast(P[t, b_offset + h * b_head_stride + j], acc)))
                        dP[t, a_offset + h * a_head_stride + j] = T.cast(da, dtype)
                        dP[t, b_offset + h * b_head_stride + j] = T.cast(
                            dbeta[t, hv] * beta_scale * sb * (T.float32(1) - sb), dtype)
                        da_tokens[t, hv] = da
                        dA_log_tokens[t, hv] = -A * softplus * dg[t, hv]

    return gdn_layer_inputs_bwd
