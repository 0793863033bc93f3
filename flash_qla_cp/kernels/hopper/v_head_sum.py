"""Sum of the fused backward walk's per-v-head dq / dk parts over each qk-head's v-heads (GVA).

The fused walk (`bwd_fused.py`) runs one block per v-head, so with HV = group x H
it writes dq and dk once per v-head: parts [T, H, group, K]. This kernel forms both sums in one
launch, in place: each qk-head's sum replaces its first part, so dq and dk are views of the parts
(`kernels/backward.py`) and no further [T, H, K] buffers are allocated while the backward's other
buffers are alive. It reads each token's parts as one contiguous run of group x K elements (torch.add
of the two strided halves took 0.18 ms per tensor at TP1 1 x 32k on the H200: its generic,
unvectorised elementwise kernel).

Same arithmetic as `reference.kernel_steps.sum_v_head_parts` (the CPU path and the reference): the
parts are added in fp32 in v-head order and rounded once, so the results are bitwise equal.
"""

from .common import import_tilelang, tl_dtype


def build_v_head_sum_kernel(H: int, group: int, K: int, dtype: str, tokens_per_block: int = 0):
    """PrimFunc `gdn_v_head_sum(dq_part, dk_part)`: parts [T, H, group, K] of `dtype`; writes each
    sum over the group into part 0 ([:, :, 0, :]); grid ceil(T / tokens_per_block), 256 threads."""
    _, T = import_tilelang()
    dtype = tl_dtype(dtype)
    acc = "float32"
    # ~4K output elements per block (8 per thread): whole tokens, at least one
    BT = tokens_per_block or max(1, 4096 // (H * K))
    Ttot = T.dynamic("num_tokens")

    @T.prim_func
    def gdn_v_head_sum(
        dq_part: T.Tensor((Ttot, H, group, K), dtype),
        dk_part: T.Tensor((Ttot, H, group, K), dtype),
    ):
        with T.Kernel(T.ceildiv(Ttot, BT), threads=256) as bt:
            q_acc = T.alloc_fragment((BT, H, K), acc)
            k_acc = T.alloc_fragment((BT, H, K), acc)
            # every part is read before any sum is stored: a thread stores only the elements it
            # read itself (the same fragment elements), and rows past the end (which repeat the
            # last token) are never stored
            for i, h, d in T.Parallel(BT, H, K):
                t = T.min(bt * BT + i, Ttot - 1)
                q_acc[i, h, d] = T.cast(dq_part[t, h, 0, d], acc)
                k_acc[i, h, d] = T.cast(dk_part[t, h, 0, d], acc)
            for j in T.serial(1, group):
                for i, h, d in T.Parallel(BT, H, K):
                    t = T.min(bt * BT + i, Ttot - 1)
                    q_acc[i, h, d] = q_acc[i, h, d] + T.cast(dq_part[t, h, j, d], acc)
                    k_acc[i, h, d] = k_acc[i, h, d] + T.cast(dk_part[t, h, j, d], acc)
            for i, h, d in T.Parallel(BT, H, K):
                if bt * BT + i < Ttot:
                    dq_part[bt * BT + i, h, 0, d] = T.cast(q_acc[i, h, d], dtype)
                    dk_part[bt * BT + i, h, 0, d] = T.cast(k_acc[i, h, d], dtype)

    return gdn_v_head_sum
