"""Kernel specs of the fused backward walk that check_bwd, check_split and tune_split reach
(with FUSED_WALK on, or auto where the walks fill the GPU; for precompile_cache.py)."""


def specs(sms):
    from flash_qla_cp.kernels.tilelang_bwd_fused_ws import build_bwd_fused_ws_kernel

    configs = (  # H, HV, K, use_dht, store_dh0, dtype
        (2, 4, 128, True, True, "bfloat16"), (16, 32, 128, True, True, "bfloat16"),
        (16, 32, 128, False, False, "bfloat16"), (2, 8, 64, True, True, "bfloat16"),
        (2, 4, 128, False, False, "bfloat16"), (2, 4, 128, True, True, "float16"),
        (2, 4, 64, True, True, "bfloat16"), (4, 4, 128, False, False, "bfloat16"),
    )
    return [(build_bwd_fused_ws_kernel, dict(H=H, HV=HV, K=K, V=K, dtype=dt, scale=float(K**-0.5), use_dht=dht,
                                             store_dh0=dh0)) for H, HV, K, dht, dh0, dt in configs]
