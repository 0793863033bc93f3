"""The op's inputs from the projection rows, one pass: causal short conv + SiLU over the q, k, v
channels, q and k l2-normalised per head, and the gates g = -exp(A_log) softplus(a + dt_bias),
beta = sigmoid(b) (x2 with allow_neg_eigval).

One block per (tiles x BT tokens, one q, k or v head) walks its tiles of BT tokens: a producer
warpgroup copies each tile's head columns of P, with the K - 1 rows before it (the conv window),
into shared memory (TMA; plain loads where P's row stride is not a multiple of 16 bytes) a few
tiles ahead of the 256 threads that compute, so that reading P overlaps the arithmetic. A q or k
head's whole vector is in the block for the l2 norm; a v-head block also forms that v-head's gates.
Same arithmetic as `reference.layer_steps.op_inputs_forward` (fp32, rounded once when stored).
The backward (`layer_inputs_bwd.py`) keeps one tile per block.

A tap t - s exists when positions[t] >= s (the token's index in its sequence): packed sequences
and batch rows never see each other. Taps before the first token read `history` [K - 1, C], the
conv inputs before it: under context parallelism the previous rank's last ones, reached by
counting the first sequence's positions from K - 1 (elsewhere positions start at 0 and the
history is never read).
"""

from .common import checks_own_bounds, import_tilelang, tl_dtype

L2NORM_EPS = 1e-6
SOFTPLUS_LINEAR_ABOVE = 20.0  # torch's softplus threshold: softplus(x) = x above it
WINDOW_ROWS = 16  # the backward's conv window ahead of a tile (conv_size - 1 <= 15), and the limit of both


@checks_own_bounds  # P's tile by TMA or TileLang's predicated copy; the rest clamped or guarded by row
def build_layer_inputs_kernel(H: int, HV: int, dk: int, dv: int, width: int, q_offset: int, q_head_stride: int,
                              k_offset: int, k_head_stride: int, v_offset: int, v_head_stride: int, b_offset: int,
                              b_head_stride: int, a_offset: int, a_head_stride: int, conv_size: int, dtype: str,
                              allow_neg_eigval: bool, block_tokens: int = 64, tiles: int = 8, stages: int = 3,
                              blocks_per_sm: int = 2):
    """PrimFunc `gdn_layer_inputs(P, history, weight, positions, A_log, dt_bias, q, k, v, g, beta)`:
    P [NT, width], history [conv_size - 1, C] dtype; weight [C, conv_size] fp32 (C = 2 H dk + HV dv,
    channels q, k, v); positions [NT] int32; A_log, dt_bias [HV] fp32 -> q, k [NT, H, dk], v [NT, HV, dv] dtype,
    g, beta [NT, HV] fp32. Grid (ceil(NT / (tiles x block_tokens)), 2 H + HV); 256 computing threads and
    the producer's 128; `stages` tiles in flight; registers capped for blocks_per_sm blocks per SM
    (`tools/tune_layer.py` times the settings)."""
    _, T = import_tilelang()
    assert 2 <= conv_size <= WINDOW_ROWS, conv_size
    dtype = tl_dtype(dtype)
    acc = "float32"
    r = HV // H
    K = conv_size
    W = conv_size - 1
    BT = block_tokens
    D = max(dk, dv)  # a tile's columns: a head of the narrower kind computes zeros past its own
    C = 2 * H * dk + HV * dv
    beta_scale = 2.0 if allow_neg_eigval else 1.0
    tma_rows = width * (2 if dtype in ("bfloat16", "float16") else 4) % 16 == 0  # TMA: 16-byte row strides
    NT = T.dynamic("num_tokens")

    @T.macro
    def store_normalised(out, head, t0, y_f, sq_f, ss_f):
        for e, d in T.Parallel(BT, D):
            sq_f[e, d] = y_f[e, d] * y_f[e, d]
        T.reduce_sum(sq_f, ss_f, dim=1)
        for e, d in T.Parallel(BT, D):
            if t0 + e < NT and d < dk:
                out[t0 + e, head, d] = T.cast(y_f[e, d] * T.rsqrt(ss_f[e] + L2NORM_EPS), dtype)

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
        with T.Kernel(T.ceildiv(NT, BT * tiles), 2 * H + HV, threads=256) as (bg, slot):
            # (no register reallocation between the warpgroups: the cap below holds for all threads)
            T.disable_warp_group_reg_alloc()
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            x_s = T.alloc_shared((W + BT, D), dtype)  # row W + e: token t0 + e
            w_s = T.alloc_shared((K, D), acc)
            m_s = T.alloc_shared((tiles * BT, K), acc)  # which taps exist, for every token of the block
            y_f = T.alloc_fragment((BT, D), acc)
            sq_f = T.alloc_fragment((BT, D), acc)
            ss_f = T.alloc_fragment((BT,), acc)
            hv = slot - 2 * H
            h = hv // r
            j = hv % r
            col = T.if_then_else(slot < H, q_offset + slot * q_head_stride,
                                 T.if_then_else(slot < 2 * H, k_offset + (slot - H) * k_head_stride,
                                                v_offset + h * v_head_stride + j * dv))
            chan = T.if_then_else(slot < 2 * H, slot * dk, 2 * H * dk + hv * dv)
            n = T.if_then_else(slot < 2 * H, dk, dv)  # the head's own columns
            first = bg * tiles * BT
            # the block's tiles that hold tokens (a decoding step: one); all of them where the copies
            # are plain loads, whose pipeline TileLang 0.1.15 cannot build for a count known late
            walked = T.min(tiles, T.ceildiv(NT - first, BT)) if tma_rows else tiles
            for jj, d in T.Parallel(K, D):
                w_s[jj, d] = T.if_then_else(d < n, weight[T.min(chan + d, C - 1), jj], T.float32(0))
            for e, jj in T.Parallel(tiles * BT, K):
                m_s[e, jj] = T.if_then_else(positions[T.min(first + e, NT - 1)] >= W - jj, T.float32(1), T.float32(0))
            for it in T.Pipelined(walked, num_stages=stages):
                t0 = first + it * BT
                T.copy(P[t0 - W:t0 + BT, col:col + D], x_s)  # rows before the first token read as zeros
                T.clear(y_f)
                for jj in T.unroll(K):
                    for e, d in T.Parallel(BT, D):
                        y_f[e, d] += T.cast(x_s[e + jj, d], acc) * w_s[jj, d] * m_s[it * BT + e, jj]
                if t0 == 0:  # taps before the first token: the conv history
                    for jj in T.unroll(K):
                        for e, d in T.Parallel(BT, D):
                            if e + jj < W and d < n:
                                y_f[e, d] += T.cast(history[e + jj, chan + d], acc) * w_s[jj, d] * m_s[e, jj]
                for e, d in T.Parallel(BT, D):
                    y_f[e, d] = y_f[e, d] / (T.float32(1) + T.exp(-y_f[e, d]))
                if slot < H:
                    store_normalised(q, slot, t0, y_f, sq_f, ss_f)
                elif slot < 2 * H:
                    store_normalised(k, slot - H, t0, y_f, sq_f, ss_f)
                else:
                    for e, d in T.Parallel(BT, D):
                        if t0 + e < NT and d < dv:
                            v[t0 + e, hv, d] = T.cast(y_f[e, d], dtype)
                    for e in T.Parallel(BT):
                        if t0 + e < NT:
                            pre = T.cast(P[t0 + e, a_offset + h * a_head_stride + j], acc) + dt_bias[hv]
                            softplus = T.if_then_else(pre > SOFTPLUS_LINEAR_ABOVE, pre, T.log1p(T.exp(pre)))
                            g[t0 + e, hv] = -T.exp(A_log[hv]) * softplus
                            b = T.cast(P[t0 + e, b_offset + h * b_head_stride + j], acc)
                            beta[t0 + e, hv] = beta_scale / (T.float32(1) + T.exp(-b))

    return gdn_layer_inputs
