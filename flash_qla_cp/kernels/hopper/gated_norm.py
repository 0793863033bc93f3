"""Gated RMSNorm of the op's output, the input of the layer's out_proj:
y = o * rsqrt(mean(o^2) + eps) * weight * silu(z), per token and v-head over dv, with z read from
its columns of the projection rows P (no copy of z).

One block per (BT tokens, one v-head). Same arithmetic as `reference.layer_steps.gated_norm_forward`
(fp32, rounded once when stored).
"""

from .common import import_tilelang, tl_dtype


def build_gated_norm_kernel(H: int, HV: int, dv: int, width: int, z_offset: int, z_head_stride: int, eps: float,
                            dtype: str, block_tokens: int = 32):
    """PrimFunc `gdn_gated_norm(o, P, weight, y)`: o [NT, HV, dv], P [NT, width] dtype, weight [dv]
    fp32 -> y [NT, HV, dv] dtype. Grid (ceil(NT / block_tokens), HV), 128 threads."""
    _, T = import_tilelang()
    dtype = tl_dtype(dtype)
    acc = "float32"
    r = HV // H
    BT = block_tokens
    NT = T.dynamic("num_tokens")

    @T.prim_func
    def gdn_gated_norm(
        o: T.Tensor((NT, HV, dv), dtype),
        P: T.Tensor((NT, width), dtype),
        weight: T.Tensor((dv,), acc),
        y: T.Tensor((NT, HV, dv), dtype),
    ):
        with T.Kernel(T.ceildiv(NT, BT), HV, threads=128) as (bt, hv):
            t0 = bt * BT
            col = z_offset + (hv // r) * z_head_stride + (hv % r) * dv
            o_f = T.alloc_fragment((BT, dv), acc)
            sq_f = T.alloc_fragment((BT, dv), acc)
            ms_f = T.alloc_fragment((BT,), acc)
            for i, d in T.Parallel(BT, dv):
                o_f[i, d] = T.cast(o[T.min(t0 + i, NT - 1), hv, d], acc)
                sq_f[i, d] = o_f[i, d] * o_f[i, d]
            T.reduce_sum(sq_f, ms_f, dim=1)
            for i, d in T.Parallel(BT, dv):
                if t0 + i < NT:
                    z = T.cast(P[t0 + i, col + d], acc)
                    y[t0 + i, hv, d] = T.cast(
                        o_f[i, d] * T.rsqrt(ms_f[i] / dv + eps) * weight[d] * z / (T.float32(1) + T.exp(-z)), dtype)

    return gdn_gated_norm
