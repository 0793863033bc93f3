"""Single kernels on the GPU against their torch forms, and the backward's own prepare."""

import torch

from flash_qla_cp.constants import CHUNK, WARMUP_LOG_DECAY
from flash_qla_cp.kernels import runtime, split
from flash_qla_cp.kernels.backward import tilelang_backward
from flash_qla_cp.kernels.forward import run_prepare, tilelang_forward
from flash_qla_cp.kernels.hopper.prepare import build_prepare_kernel
from flash_qla_cp.kernels.hopper.split_decay_tables import build_decay_tables_kernel
from flash_qla_cp.kernels.hopper.v_head_sum import build_v_head_sum_kernel
from flash_qla_cp.reference.kernel_steps import dh_warmup_chunks, sum_v_head_parts, torch_prepare, warmup_starts
from flash_qla_cp.testing import chunk_local_cumsum, make_gdn_inputs, random_cu_seqlens, rel_err


def test_prepare_kernel_is_its_torch_form():
    """G and Ag of every chunk (odd lengths, a 1-token sequence, GVA) within bf16 rounding of
    the float64 torch form."""
    lengths = [1, 63, 64, 65, 200, 517]
    x = make_gdn_inputs(seq_len=sum(lengths), num_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128,
                        dtype=torch.bfloat16, device="cuda", generator=torch.Generator().manual_seed(2))
    cu = random_cu_seqlens(lengths, device="cuda")
    spec = runtime.KernelSpec.of(build_prepare_kernel, H=2, HV=4, K=128, dtype="bfloat16", is_varlen=True)
    G, Ag, _ = run_prepare(spec, x["k"], x["g"], x["beta"], cu_seqlens=cu)
    G_ref, Ag_ref = torch_prepare(x["k"], x["g"], x["beta"], cu)
    assert rel_err(G, G_ref) < 1e-6 and rel_err(Ag, Ag_ref) < 5e-3


def test_v_head_sum_is_its_torch_form_bitwise():
    for T, H, group, K, dtype in ((20101, 16, 2, 128, torch.bfloat16), (3, 16, 2, 128, torch.bfloat16),
                                  (777, 2, 4, 64, torch.float16)):
        parts = (4 * torch.randn(T, H, group, K, device="cuda")).to(dtype)
        got = torch.full((T, H, K), float("nan"), device="cuda", dtype=dtype)
        spec = runtime.KernelSpec.of(build_v_head_sum_kernel, H=H, group=group, K=K,
                                     dtype="bfloat16" if dtype == torch.bfloat16 else "float16")
        runtime.compile_kernel(spec)(parts, got)
        want = torch.empty(T, H, K, device="cuda", dtype=dtype)
        sum_v_head_parts(parts, want)
        assert torch.equal(got, want), (T, H, group, K, dtype)


def test_decay_tables_are_their_torch_forms():
    """Slow, fast and g = 0 heads over 40 v-heads (two thread blocks per partition), an empty
    sequence and partitions of 1 to 100 chunks."""
    HV = 40
    cu = [0, 64 * 37 + 5, 64 * 37 + 5, 64 * 37 + 5 + 64 * 200 + 63, 64 * 37 + 5 + 64 * 200 + 63 + 17]
    gen = torch.Generator().manual_seed(11)
    rates = torch.tensor([0.003, 0.03, 1.0, 0.0] * (HV // 4), dtype=torch.float64)
    g = -rates * torch.nn.functional.softplus(torch.randn(1, cu[-1], HV, generator=gen, dtype=torch.float64))
    gcum = chunk_local_cumsum(g, cu).float().cuda()
    spec = runtime.KernelSpec.of(build_decay_tables_kernel, HV=HV, threshold=WARMUP_LOG_DECAY)
    for parts in (3, 16):
        plan = split.plan_split(cu, HV=HV, V=128, parts=parts)
        starts, walk = split.decay_tables(spec, gcum, plan)
        assert torch.equal(starts, warmup_starts(gcum, plan)), parts
        assert torch.equal(walk, dh_warmup_chunks(gcum, plan)), parts


def test_backward_without_the_forwards_tables_runs_its_own_prepare():
    """`tilelang_backward` given nothing from the forward (saved=None) computes G and Ag itself:
    the same gradients as with the forward's, to the last bit."""
    lengths = [1, 63, 64, 65, 200, 517, 1033]
    x = make_gdn_inputs(seq_len=sum(lengths), num_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128,
                        dtype=torch.bfloat16, device="cuda", generator=torch.Generator().manual_seed(3))
    cu = random_cu_seqlens(lengths, device="cuda")
    do = torch.randn(1, sum(lengths), 4, 128, device="cuda").to(torch.bfloat16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5)
    _, _, saved = tilelang_forward(*args, None, False, cu)
    with_saved = tilelang_backward(do, None, *args, None, cu, saved)
    without = tilelang_backward(do, None, *args, None, cu, None)
    for a, b in zip(with_saved[:5], without[:5]):
        assert torch.equal(a, b)
    assert saved.Ag.shape[-1] == CHUNK and rel_err(with_saved[0], without[0]) == 0.0
