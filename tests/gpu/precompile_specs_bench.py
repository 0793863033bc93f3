"""Kernel specs of the benchmark shapes (benchmarks/bench_kernels.py SHAPES), for precompile_cache.py:
the kernels ours uses for each shape's forward (no grad, final states) and fwd+bwd (kept states
and the recompute path), found by running our op on CPU tensors with every kernel launch
stubbed out and each requested kernel recorded. No GPU and no compilation happen here.

    python tests/gpu/precompile_cache.py tests/gpu/precompile_specs_bench.py

BENCH_SPEC_SHAPES (comma-separated shape names) narrows the shapes, BENCH_SPEC_NOSPLIT=1 adds
the unsplit forward (the bench's `ours_nosplit`); the kernel switches of the current checkout
apply, so run it on the branch whose kernels the device call needs.
"""

import os
import sys
from unittest import mock

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)


def _record_into(found):
    from flash_qla_cp.kernels.tilelang_common import _key  # compile_kernel's cache key

    def fake_compile(factory, **params):
        found.setdefault(_key(factory, params), (factory, params))
        return lambda *args: None  # a launch that does nothing: outputs stay as allocated

    return fake_compile


def _inputs(name):
    from bench_kernels import SHAPES, shape_cu

    B, T, H, HV, K, V, nseq = SHAPES[name]
    if nseq:
        B, T = 1, B * T
    q = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    k = torch.zeros_like(q)
    v = torch.zeros(B, T, HV, V, dtype=torch.bfloat16)
    g = torch.zeros(B, T, HV)
    beta = torch.zeros(B, T, HV)
    cu = shape_cu(name).to(torch.int32) if nseq else None
    return q, k, v, g, beta, cu


def shape_specs(name, sms, found):
    """Record into `found` (cache key -> (factory, params)) the kernels of one bench shape's
    forward and fwd+bwd."""
    from flash_qla_cp.kernels import tilelang_bwd_impl, tilelang_common, tilelang_fwd, tilelang_split

    fake = _record_into(found)
    q, k, v, g, beta, cu = _inputs(name)
    scale = q.shape[-1] ** -0.5
    cu_host = cu.tolist() if cu is not None else None
    with mock.patch.object(tilelang_fwd, "compile_kernel", fake), \
            mock.patch.object(tilelang_bwd_impl, "compile_kernel", fake), \
            mock.patch.object(tilelang_split, "compile_kernel", fake), \
            mock.patch.object(tilelang_common, "sm_count", lambda device: sms), \
            mock.patch("torch.cuda.get_device_properties",
                       lambda *a: type("P", (), {"multi_processor_count": sms})()):
        # (intra_cp, final states, keep states); the first three are the bench's ours
        runs = [("auto", True, False), ("auto", False, True), ("auto", False, False)]
        if os.environ.get("BENCH_SPEC_NOSPLIT") == "1":  # ours_nosplit
            runs.append(("off", True, False))
        for parts, final, keep in runs:
            o, ht, saved = tilelang_fwd.tilelang_chunk_gated_delta_rule_fwd(
                q, k, v, g, beta, scale, None, final, cu, partitions=parts, cu_seqlens_host=cu_host,
                save_states=keep)
            if not final:  # the bench's forward (final states) has no backward
                tilelang_bwd_impl.tilelang_chunk_gated_delta_rule_bwd(
                    torch.zeros_like(o), None, q, k, v, g, beta, scale, None, cu, saved)


def specs(sms):
    from bench_kernels import SHAPES

    names = os.environ.get("BENCH_SPEC_SHAPES")
    found = {}  # each kernel once, in the order first used
    for name in names.split(",") if names else SHAPES:
        shape_specs(name, sms, found)
    return list(found.values())


if __name__ == "__main__":
    for factory, params in specs(132):
        print(factory.__qualname__, params)
