"""Which kernel and tiles the TileLang entry points choose (CPU: choices only, nothing runs)."""

import pytest
import torch


@pytest.mark.parametrize("n_seqs,HV,V,K", [(1, 32, 128, 128), (4, 32, 128, 128), (1, 4, 128, 128), (8, 4, 64, 64),
                                          (1, 4, 256, 256), (32, 4, 128, 128)])
def test_default_tiles_fit_the_head_and_choose_a_kernel(n_seqs, HV, V, K):
    from flash_qla_cp.kernels.tilelang_fwd import default_fused_config, fwd_kernel_specs
    from flash_qla_cp.kernels.tilelang_fwd_ws import build_fused_fwd_ws_kernel
    from flash_qla_cp.kernels.tilelang_fwd_ws4 import build_fused_fwd_ws4_kernel

    cfg = default_fused_config(n_seqs, HV, V, 132, K=K)
    assert V % cfg["block_v"] == 0 and cfg["block_v"] % 16 == 0  # wgmma N tiles
    factory, params = fwd_kernel_specs(2, HV, K, V, torch.bfloat16, K**-0.5, True, True, True, **cfg)[1]
    # the warp-specialised kernels hold 64 x K q/k tiles in a two-stage ring: K <= 128 only
    assert (factory in (build_fused_fwd_ws_kernel, build_fused_fwd_ws4_kernel)) == (K <= 128)
    assert params["block_v"] == cfg["block_v"]



def test_four_warpgroup_forward_is_chosen_only_when_switched_on_and_its_grid_fills_the_gpu():
    from flash_qla_cp.kernels import tilelang_fwd
    from flash_qla_cp.kernels.tilelang_fwd_ws4 import build_fused_fwd_ws4_kernel

    with tilelang_fwd.switches(FOUR_WARPGROUPS=False):
        assert "four_warpgroups" not in tilelang_fwd.default_fused_config(4, 32, 128, 132)
    with tilelang_fwd.switches(FOUR_WARPGROUPS=True):
        cfg = tilelang_fwd.default_fused_config(4, 32, 128, 132)  # 128 blocks of 128-wide states
        small = tilelang_fwd.default_fused_config(1, 32, 128, 132)  # 32 blocks: narrower tiles
        k64 = tilelang_fwd.default_fused_config(4, 32, 64, 132, K=64)
    assert cfg == {"warp_specialized": True, "four_warpgroups": True, "block_v": 128, "o_tma": tilelang_fwd.O_TMA}
    assert "four_warpgroups" not in small and "four_warpgroups" not in k64
    factory, params = tilelang_fwd.fwd_kernel_specs(16, 32, 128, 128, torch.bfloat16, 0.1, True, True, True, **cfg,
                                                    store_states=True)[1]
    assert factory is build_fused_fwd_ws4_kernel and params["block_v"] == 128 and params["store_states"]
    assert params.get("o_tma", False) == tilelang_fwd.O_TMA


def test_o_tma_is_an_option_of_the_four_warpgroup_forward_only():
    from flash_qla_cp.kernels import tilelang_fwd

    with tilelang_fwd.switches(O_TMA=False):
        assert "o_tma" not in tilelang_fwd.default_fused_config(4, 32, 128, 132)
    with tilelang_fwd.switches(O_TMA=True):
        assert tilelang_fwd.default_fused_config(4, 32, 128, 132)["o_tma"] is True
        assert "o_tma" not in tilelang_fwd.default_fused_config(1, 32, 128, 132)  # three warpgroups
    with pytest.raises(ValueError, match="o_tma"):
        tilelang_fwd.fwd_kernel_specs(16, 32, 128, 128, torch.bfloat16, 0.1, True, True, True,
                                      warp_specialized=True, block_v=64, o_tma=True)


def test_backward_walk_choice():
    from flash_qla_cp.kernels.tilelang_bwd_dh_ws import build_bwd_dh_ws_kernel
    from flash_qla_cp.kernels.tilelang_bwd_h_ws import build_bwd_h_ws_kernel
    from flash_qla_cp.kernels.tilelang_bwd_impl import bwd_kernel_specs, build_bwd_dh_kernel, build_bwd_h_kernel

    h, dh, _ = bwd_kernel_specs(2, 4, 128, 128, "bfloat16", 0.1, True, True, dh_kernel="ws", h_kernel="ws")
    assert h[0] is build_bwd_h_ws_kernel and dh[0] is build_bwd_dh_ws_kernel
    h, dh, _ = bwd_kernel_specs(2, 4, 128, 128, "bfloat16", 0.1, True, True, dh_kernel="serial", h_kernel="serial")
    assert h[0] is build_bwd_h_kernel and dh[0] is build_bwd_dh_kernel
    # K = 256: the warp-specialised walks' q/k ring would not fit, the serial ones run
    h, dh, _ = bwd_kernel_specs(2, 4, 256, 256, "bfloat16", 0.1, True, True, dh_kernel="ws", h_kernel="ws")
    assert h[0] is build_bwd_h_kernel and dh[0] is build_bwd_dh_kernel
    with pytest.raises(ValueError, match="dh_kernel"):
        bwd_kernel_specs(2, 4, 128, 128, "bfloat16", 0.1, True, True, dh_kernel="fast")


@pytest.mark.parametrize("n_walks,K,sms,mode,want", [
    (128, 128, 132, "auto", True),    # TP1 1x32k: 4 partitions x 32 v-heads about fill an H200
    (256, 128, 132, "auto", True),    # 8 documents x 32 v-heads
    (64, 128, 132, "auto", False),    # TP8 1x128k: 16 partitions x 4 v-heads leave half the SMs idle
    (16, 128, 132, "on", True),
    (256, 128, 132, "off", False),
    (256, 256, 132, "on", False),     # K = 256: dS would not fit in one warpgroup's registers
])
def test_fused_walk_choice(n_walks, K, sms, mode, want):
    from flash_qla_cp.kernels.tilelang_bwd_impl import fused_walk_wanted, switches

    assert fused_walk_wanted(n_walks, K, K, sms, mode) is want
    with switches(FUSED_WALK=mode):  # the module switch is what the backward reads
        assert fused_walk_wanted(n_walks, K, K, sms) is want


def test_fused_walk_rejects_unknown_mode():
    from flash_qla_cp.kernels.tilelang_bwd_impl import fused_walk_wanted

    with pytest.raises(ValueError, match="FUSED_WALK"):
        fused_walk_wanted(128, 128, 128, 132, mode=True)


@pytest.mark.parametrize("V,num_seqs,HV,sms,want", [
    (128, 1, 4, 132, 16),    # TP8 1x128k: 32 blocks at 16 columns
    (128, 1, 32, 132, 32),   # TP1 1x32k: 256 blocks at 16 would queue on 132 SMs
    (128, 8, 4, 132, 32),    # eight split documents at TP8
    (64, 2, 4, 132, 16),
    (48, 1, 4, 132, 48),     # V not a multiple of 32: one tile of the whole row
])
def test_partition_scan_tile(V, num_seqs, HV, sms, want):
    from flash_qla_cp.kernels.tilelang_split import scan_block_v

    assert scan_block_v(V, num_seqs, HV, sms) == want
