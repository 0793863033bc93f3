"""Kernel specs of the K = V = 256 cases of check_fwd.py (for precompile_cache.py). The backward has
no K = 256 kernels (backends.TILELANG_BWD_MAX_HEAD_DIM)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def specs(sms):
    import check_fwd

    from flash_qla_cp.kernels.tilelang_fwd import default_fused_config, fwd_kernel_specs

    out = []
    for name, kw in check_fwd.CASES:
        if "k256" not in name:
            continue
        n_seqs = len(kw["cu"]) - 1 if kw.get("cu") is not None else kw["B"]
        cfg = kw.get("cfg") or default_fused_config(n_seqs, kw["HV"], kw["V"], sms, K=kw["K"])
        out += fwd_kernel_specs(kw["H"], kw["HV"], kw["K"], kw["V"], kw["dtype"], kw["K"] ** -0.5,
                                kw.get("cu") is not None, kw.get("with_h0", True), True,
                                kw.get("state_v_first", False), **cfg)
    return out
