"""Kernel specs of the fused backward walk that check_bwd, check_split and tune_split reach
(with FUSED_WALK on, or auto where the walks fill the GPU; for precompile_cache.py)."""

import os
import sys


def specs(sms):
    from flash_qla_cp.kernels.tilelang_bwd_fused_ws import build_bwd_fused_ws_kernel

    configs = (  # H, HV, K, use_dht, store_dh0, dtype
        (2, 4, 128, True, True, "bfloat16"), (16, 32, 128, True, True, "bfloat16"),
        (16, 32, 128, False, False, "bfloat16"), (2, 8, 64, True, True, "bfloat16"),
        (2, 4, 128, False, False, "bfloat16"), (2, 4, 128, True, True, "float16"),
        (2, 4, 64, True, True, "bfloat16"), (4, 4, 128, False, False, "bfloat16"),
    )
    # and the walk with each option set the bench compares (ours_bwd_*), for the bf16 K = 128 configs
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from bench_kernels import FUSED_WALK_OPTION_LIBS

    out = []
    for H, HV, K, dht, dh0, dt in configs:
        variants = [{}] + (list(FUSED_WALK_OPTION_LIBS.values()) if (K, dt) == (128, "bfloat16") else [])
        for options in variants:
            out.append((build_bwd_fused_ws_kernel, dict(H=H, HV=HV, K=K, V=K, dtype=dt, scale=float(K**-0.5),
                                                         use_dht=dht, store_dh0=dh0, **options)))
    return out
