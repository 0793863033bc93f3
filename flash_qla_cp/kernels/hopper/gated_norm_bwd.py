"""Backward of `gated_norm.py`: from dy to do, dz (by v-head, not in P's layout: the layer
allocates dP only after the op's backward, see `modules/fused_mixer.py`) and the weight
gradient's per-block partial sums ([blocks, HV, dv] fp32, summed on the host in a fixed order).

With n = o r, r = rsqrt(mean(o^2) + eps), gate = silu(z): dz = dy n weight silu'(z);
dn = dy gate weight; do = r (dn - n mean(dn n)); d weight = sum over tokens of dy gate n.
One block per (BT tokens, one v-head). Same arithmetic as `reference.layer_steps.gated_norm_backward`.
"""

from .common import import_tilelang, tl_dtype


def build_gated_norm_bwd_kernel(H: int, HV: int, dv: int, width: int, z_offset: int, z_head_stride: int, eps: float,
                                dtype: str, block_tokens: int = 32, blocks_per_sm: int = 1):
    """PrimFunc `gdn_gated_norm_bwd(dy, o, P, weight, do, dz, dweight_part)`: dy, o [NT, HV, dv],
    P [NT, width] dtype, weight [dv] fp32 -> do, dz [NT, HV, dv] (dtype),
    dweight_part [ceil(NT / block_tokens), HV, dv] fp32. Grid (ceil(NT / block_tokens), HV), 128 threads
    (blocks_per_sm > 1: registers capped so that that many blocks fit an SM; `tools/tune_layer.py`
    times it)."""
    _, T = import_tilelang()
    dtype = tl_dtype(dtype)
    acc = "float32"
    r = HV // H
    BT = block_tokens
    NT = T.dynamic("num_tokens")
    NB = T.dynamic("num_blocks")

    @T.prim_func
    def gdn_gated_norm_bwd(
        dy: T.Tensor((NT, HV, dv), dtype),
        o: T.Tensor((NT, HV, dv), dtype),
        P: T.Tensor((NT, width), dtype),
        weight: T.Tensor((dv,), acc),
        do: T.Tensor((NT, HV, dv), dtype),
        dz: T.Tensor((NT, HV, dv), dtype),
        dweight_part: T.Tensor((NB, HV, dv), acc),
    ):
        with T.Kernel(T.ceildiv(NT, BT), HV, threads=128) as (bt, hv):
            if blocks_per_sm > 1:
                T.annotate_min_blocks_per_sm(blocks_per_sm)
            t0 = bt * BT
            col = z_offset + (hv // r) * z_head_stride + (hv % r) * dv
            n_f = T.alloc_fragment((BT, dv), acc)
            dn_f = T.alloc_fragment((BT, dv), acc)
            x_f = T.alloc_fragment((BT, dv), acc)
            rs_f = T.alloc_fragment((BT,), acc)
            dot_f = T.alloc_fragment((BT,), acc)
            dw_f = T.alloc_fragment((dv,), acc)
            for i, d in T.Parallel(BT, dv):
                n_f[i, d] = T.cast(o[T.min(t0 + i, NT - 1), hv, d], acc)
                x_f[i, d] = n_f[i, d] * n_f[i, d]
            T.reduce_sum(x_f, rs_f, dim=1)
            for i in T.Parallel(BT):
                rs_f[i] = T.rsqrt(rs_f[i] / dv + eps)
            for i, d in T.Parallel(BT, dv):
                live = t0 + i < NT
                t = T.min(t0 + i, NT - 1)
                z = T.cast(P[t, col + d], acc)
                sig = T.float32(1) / (T.float32(1) + T.exp(-z))
                g = T.if_then_else(live, T.cast(dy[t, hv, d], acc), T.float32(0))
                n_f[i, d] = n_f[i, d] * rs_f[i]
                if live:
                    dz[t, hv, d] = T.cast(g * n_f[i, d] * weight[d] * sig * (T.float32(1) + z * (T.float32(1) - sig)),
                                            dtype)
                x_f[i, d] = g * z * sig * n_f[i, d]  # the weight gradient's terms
                dn_f[i, d] = g * z * sig * weight[d]
            T.reduce_sum(x_f, dw_f, dim=0)
            for d in T.Parallel(dv):
                dweight_part[bt, hv, d] = dw_f[d]
            for i, d in T.Parallel(BT, dv):
                x_f[i, d] = dn_f[i, d] * n_f[i, d]
            T.reduce_sum(x_f, dot_f, dim=1)
            for i, d in T.Parallel(BT, dv):
                if t0 + i < NT:
                    do[t0 + i, hv, d] = T.cast(rs_f[i] * (dn_f[i, d] - n_f[i, d] * dot_f[i] / dv), dtype)

    return gdn_gated_norm_bwd
