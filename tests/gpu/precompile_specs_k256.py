"""Kernel specs of the cases with a head dim of 256 in check_fwd.py, check_bwd.py and
check_split.py (for precompile_cache.py)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


def specs(sms):
    import check_bwd
    import check_fwd

    from flash_qla_cp.kernels.tilelang_bwd_impl import bwd_kernel_specs
    from flash_qla_cp.kernels.tilelang_fwd import default_fused_config, fwd_kernel_specs

    def wide(kw):
        return max(kw["K"], kw["V"]) > 128

    out = [s for _, kw in check_bwd.CASES if wide(kw) for s in check_bwd.specs_for(kw)]
    for _, kw in check_fwd.CASES:
        if not wide(kw):
            continue
        n_seqs = len(kw["cu"]) - 1 if kw.get("cu") is not None else kw["B"]
        cfg = kw.get("cfg") or default_fused_config(n_seqs, kw["HV"], kw["V"], sms, K=kw["K"])
        out += fwd_kernel_specs(kw["H"], kw["HV"], kw["K"], kw["V"], kw["dtype"], kw["K"] ** -0.5,
                                kw.get("cu") is not None, kw.get("with_h0", True), True,
                                kw.get("state_v_first", False), **cfg)
    # check_split.py's wide_k256_auto: two sequences, unsplit, with h0 and final states
    cfg = default_fused_config(2, 4, 256, sms, K=256)
    out += fwd_kernel_specs(2, 4, 256, 256, torch.bfloat16, 256**-0.5, True, True, True, False, **cfg)
    # ... and its backward (also benchmarks/time_wide_bwd.py's): the two walks at block_v 32,
    # no grad kernel
    out += bwd_kernel_specs(2, 4, 256, 256, torch.bfloat16, 256**-0.5, True, True, 32)[:2]
    return out
