"""Which kernels and tiles the forward and backward plans choose (CPU: choices only, nothing runs)."""

import pytest
import torch

from flash_qla_cp import KernelOptions
from flash_qla_cp.kernels.backward import fused_walk_wanted, plan_backward
from flash_qla_cp.kernels.forward import fused_walk_kernel, plan_forward
from flash_qla_cp.kernels.hopper.bwd_dh import build_bwd_dh_kernel
from flash_qla_cp.kernels.hopper.bwd_dh_ws import build_bwd_dh_ws_kernel
from flash_qla_cp.kernels.hopper.bwd_h import build_bwd_h_kernel
from flash_qla_cp.kernels.hopper.bwd_h_ws import build_bwd_h_ws_kernel
from flash_qla_cp.kernels.hopper.fwd_fused import build_fused_fwd_kernel
from flash_qla_cp.kernels.hopper.fwd_fused_ws import build_fused_fwd_ws_kernel
from flash_qla_cp.kernels.hopper.fwd_fused_ws4 import build_fused_fwd_ws4_kernel
from flash_qla_cp.kernels.split import scan_block_v

SMS = 132


@pytest.mark.parametrize("walks,HV,V,K", [(1, 32, 128, 128), (4, 32, 128, 128), (1, 4, 128, 128), (8, 4, 64, 64),
                                          (1, 4, 256, 256), (32, 4, 128, 128)])
def test_forward_tiles_fit_the_head_and_choose_a_kernel(walks, HV, V, K):
    factory, block_v = fused_walk_kernel(walks, HV, K, V, SMS, KernelOptions())
    assert V % block_v == 0 and block_v % 16 == 0  # wgmma N tiles
    # the warp-specialised kernels hold 64 x K q/k tiles in a two-stage ring: K <= 128 only
    assert (factory in (build_fused_fwd_ws_kernel, build_fused_fwd_ws4_kernel)) == (K <= 128)
    fused = plan_forward(2, HV, K, V, "bfloat16", K**-0.5, True, True, True, False, walks, SMS).fused
    assert fused.factory is factory and fused.kwargs["block_v"] == block_v


def test_four_warpgroup_forward_only_when_on_and_its_grid_fills_the_gpu():
    on, off = KernelOptions(), KernelOptions(four_warpgroups=False)
    assert fused_walk_kernel(4, 32, 128, 128, SMS, on) == (build_fused_fwd_ws4_kernel, 128)  # 128 blocks of 128
    assert fused_walk_kernel(4, 32, 128, 128, SMS, off)[0] is build_fused_fwd_ws_kernel
    assert fused_walk_kernel(1, 32, 128, 128, SMS, on) == (build_fused_fwd_ws_kernel, 32)  # 32 blocks: narrower
    assert fused_walk_kernel(4, 32, 64, 64, SMS, on)[0] is build_fused_fwd_ws_kernel  # V = 64: no 128-wide block
    fused = plan_forward(16, 32, 128, 128, "bfloat16", 0.1, True, True, True, False, 4, SMS, save_states=True).fused
    assert fused.factory is build_fused_fwd_ws4_kernel and fused.kwargs["store_states"]


def test_kept_states_need_a_warp_specialised_forward():
    wide = plan_forward(2, 4, 256, 256, "bfloat16", 0.1, True, True, True, False, 1, SMS, save_states=True).fused
    assert wide.factory is build_fused_fwd_kernel and "store_states" not in wide.kwargs


def test_split_forward_plan():
    """A split call: decay tables, summaries and the scan (entering at zero without an initial
    state) before the walk, which runs over packed partitions in [K, V] layout."""
    plan = plan_forward(2, 4, 128, 128, "bfloat16", 0.1, False, False, True, True, 16, SMS, split_seqs=1)
    assert [s.name for s in plan.specs()] == ["build_prepare_kernel", "build_decay_tables_kernel",
                                              "build_state_summary_kernel", "build_partition_scan_kernel",
                                              plan.fused.name]
    assert plan.split.scan.kwargs["use_s0"] is False and not plan.split.scan.kwargs["reverse"]
    f = plan.fused.kwargs
    assert f["use_initial_state"] and not f["state_v_first"]
    with_h0 = plan_forward(2, 4, 128, 128, "bfloat16", 0.1, False, True, True, True, 16, SMS, split_seqs=1)
    assert "use_s0" not in with_h0.split.scan.kwargs


def test_backward_walk_choice():
    few = plan_backward(2, 4, 128, 128, "bfloat16", 0.1, True, True, 1, SMS)
    assert few.h_walk.factory is build_bwd_h_ws_kernel and few.dh_walk.factory is build_bwd_dh_ws_kernel
    assert few.grad.name == "build_bwd_grad_group_kernel" and few.fused_walk is None and few.v_head_sum is None
    # the split backward keeps the serial h walk (many short partitions), the ws dh walk
    split = plan_backward(2, 4, 128, 128, "bfloat16", 0.1, False, False, 8, SMS, split_seqs=1)
    assert split.h_walk.factory is build_bwd_h_kernel and split.dh_walk.factory is build_bwd_dh_ws_kernel
    assert split.dh_warmup.kwargs["limit_chunks"] and not split.dh_warmup.kwargs["use_dht"]
    assert split.exit_scan.kwargs["reverse"] and split.exit_scan.kwargs["use_s0"] is False
    # K = 256: the warp-specialised walks' q/k ring would not fit, the serial ones run at block_v 32
    wide = plan_backward(2, 4, 256, 256, "bfloat16", 0.1, True, True, 1000, SMS)
    assert wide.h_walk.factory is build_bwd_h_kernel and wide.dh_walk.factory is build_bwd_dh_kernel
    assert wide.h_walk.kwargs["block_v"] == wide.dh_walk.kwargs["block_v"] == 32
    assert wide.grad.name == "build_bwd_grad_wide_kernel" and wide.v_head_sum is not None
    # kept states: no h walk
    assert plan_backward(2, 4, 128, 128, "bfloat16", 0.1, True, True, 1, SMS, states_saved=True).h_walk is None


@pytest.mark.parametrize("H,HV,sum_v_heads,chain", [
    (2, 4, True, True),     # GVA, summed: the fused walk's v-head chain
    (2, 4, False, False),   # the layer takes per-v-head parts
    (4, 4, True, False),    # MHA: nothing to sum
    (1, 16, True, False),   # 16 v-heads a qk-head: past the largest cluster, parts and the sum kernel
])
def test_fused_walk_sums_v_heads_in_its_chain(H, HV, sum_v_heads, chain):
    plan = plan_backward(H, HV, 128, 128, "bfloat16", 0.1, True, True, 1000, SMS, sum_v_heads=sum_v_heads)
    assert plan.fused_walk.kwargs["chain_v_heads"] is chain
    parts = HV > H and not chain
    assert plan.v_head_parts is parts
    assert (plan.v_head_sum is not None) == (parts and sum_v_heads)


@pytest.mark.parametrize("walks,K,mode,want", [
    (128, 128, "auto", True),    # TP1 1x32k: 4 partitions x 32 v-heads about fill an H200
    (256, 128, "auto", True),    # 8 documents x 32 v-heads
    (64, 128, "auto", False),    # TP8 1x128k: 16 partitions x 4 v-heads leave half the SMs idle
    (16, 128, "on", True),
    (256, 128, "off", False),
    (256, 256, "on", False),     # K = 256: dS would not fit in one warpgroup's registers
])
def test_fused_walk_choice(walks, K, mode, want):
    assert fused_walk_wanted(walks, K, K, SMS, mode) is want
    plan = plan_backward(2, 4, K, K, "bfloat16", 0.1, True, True, walks // 4, SMS,
                         options=KernelOptions(fused_walk=mode))
    assert (plan.fused_walk is not None) is want and (plan.dh_walk is None) is want


def test_options_reject_unknown_values():
    with pytest.raises(ValueError, match="fused_walk"):
        KernelOptions(fused_walk=True)
    with pytest.raises(ValueError, match="four_warpgroups"):
        KernelOptions(four_warpgroups="yes")


@pytest.mark.parametrize("V,num_seqs,HV,want", [
    (128, 1, 4, 16),    # TP8 1x128k: 32 blocks at 16 columns
    (128, 1, 32, 32),   # TP1 1x32k: 256 blocks at 16 would queue on 132 SMs
    (128, 8, 4, 32),    # eight split documents at TP8
    (64, 2, 4, 16),
    (48, 1, 4, 48),     # V not a multiple of 32: one tile of the whole row
])
def test_partition_scan_tile(V, num_seqs, HV, want):
    assert scan_block_v(V, num_seqs, HV, SMS) == want


@pytest.mark.parametrize("H,group", [(2, 2), (3, 4)])
def test_v_head_sums_are_contiguous_and_free_the_parts(H, group, monkeypatch):
    """The op's backward sums dq's parts, then dk's (the kernel's torch form stands in for it
    here), into contiguous [1, T, H, K] tensors (what autograd keeps as a gradient without a
    copy); nothing but the caller's reference keeps a part alive."""
    import weakref

    from flash_qla_cp.kernels import backward, runtime
    from flash_qla_cp.reference.kernel_steps import sum_v_head_parts

    monkeypatch.setattr(runtime, "compile_kernel", lambda spec: sum_v_head_parts)
    T, K = 5, 8
    part = torch.randn(1, T, H * group, K)
    want = part.view(1, T, H, group, K).sum(3)
    alive = weakref.ref(part)
    got = backward._sum_v_heads(None, part, H)
    del part
    assert alive() is None
    assert got.shape == (1, T, H, K) and got.is_contiguous()
    assert torch.allclose(got, want)


def test_backward_reads_v_unless_the_tilelang_walks_have_the_kept_states():
    from dataclasses import replace

    from flash_qla_cp.kernels.forward import ForwardSaved
    from flash_qla_cp.ops import GDNContext, backward_reads_v

    kept = ForwardSaved(None, None, None, None, h_states=torch.zeros(1), vres=torch.zeros(1))
    ctx = GDNContext(*([None] * 7), 1.0, False, False, "tilelang", kernel_saved=kept)
    assert not backward_reads_v(ctx)
    assert backward_reads_v(GDNContext(*([None] * 7), 1.0, False, False, "tilelang",
                                       KernelOptions(tilelang_backward=False), kept))
    assert backward_reads_v(GDNContext(*([None] * 7), 1.0, False, False, "torch", kernel_saved=kept))
    assert backward_reads_v(GDNContext(*([None] * 7), 1.0, False, False, "tilelang",
                                       kernel_saved=ForwardSaved(None, None, None, None)))
    # a backward has used what the forward kept: seen through every copy of it
    copy = replace(kept)
    kept.spent.value = True
    assert backward_reads_v(GDNContext(*([None] * 7), 1.0, False, False, "tilelang", kernel_saved=copy))
