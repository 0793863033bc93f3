"""Sum of the fused backward walk's per-v-head dq or dk parts over each qk-head's v-heads (GVA).

The fused walk (`bwd_fused.py`) runs one block per v-head, so with HV = group x H
it writes dq and dk once per v-head: parts [T, H, group, K]. This kernel sums one of them into a
contiguous [T, H, K] tensor, reading each token's parts as one contiguous run of group x K
elements (torch.add of the two strided halves took 0.18 ms per tensor at TP1 1 x 32k on the H200:
its generic, unvectorised elementwise kernel). One launch per tensor, so that the backward frees
dq's parts before it allocates dk's sum (`kernels/backward.py`); a contiguous result is what
autograd stores as the gradient without a copy (strided sums cost two 0.17 ms copies on an H100).

Same arithmetic as `reference.kernel_steps.sum_v_head_parts` (the CPU path and the reference): the
parts are added in fp32 in v-head order and rounded once, so the results are bitwise equal.
"""

from .common import import_tilelang, tl_dtype


def build_v_head_sum_kernel(H: int, group: int, K: int, dtype: str, tokens_per_block: int = 0):
    """PrimFunc `gdn_v_head_sum(parts, out)`: parts [T, H, group, K], out [T, H, K], both of
    `dtype`; grid ceil(T / tokens_per_block), 256 threads."""
    _, T = import_tilelang()
    dtype = tl_dtype(dtype)
    acc = "float32"
    # ~4K output elements per block (16 per thread): whole tokens, at least one
    BT = tokens_per_block or max(1, 4096 // (H * K))
    Ttot = T.dynamic("num_tokens")

    @T.prim_func
    def gdn_v_head_sum(
        parts: T.Tensor((Ttot, H, group, K), dtype),
        out: T.Tensor((Ttot, H, K), dtype),
    ):
        with T.Kernel(T.ceildiv(Ttot, BT), threads=256) as bt:
            total = T.alloc_fragment((BT, H, K), acc)
            for i, h, d in T.Parallel(BT, H, K):
                t = T.min(bt * BT + i, Ttot - 1)  # rows past the end repeat the last (not stored)
                total[i, h, d] = T.cast(parts[t, h, 0, d], acc)
            for j in T.serial(1, group):
                for i, h, d in T.Parallel(BT, H, K):
                    t = T.min(bt * BT + i, Ttot - 1)
                    total[i, h, d] = total[i, h, d] + T.cast(parts[t, h, j, d], acc)
            for i, h, d in T.Parallel(BT, H, K):
                if bt * BT + i < Ttot:
                    out[bt * BT + i, h, d] = T.cast(total[i, h, d], dtype)

    return gdn_v_head_sum
