"""Our host path timed on a CPU machine: the public op on meta tensors with every TileLang launch
stubbed out (as tests/test_host_path.py records them), so the Python between launches can be
trimmed without a GPU. Prints the median timeline of one call, in microseconds from its start
to each launch and to its end, and optionally a cProfile of the calls.

    python benchmarks/host_path_cpu.py --shape tp8_1x32k [--pass fwd|fwdbwd] [--profile]

Meta tensors make torch's own ops slower than on a GPU host (their shape functions run in
Python) and the device checks are stubbed, so read the gaps between launches as relative:
benchmarks/host_timeline.py is the same timeline on the GPU.
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import SHAPES  # noqa: E402

from flash_qla_cp import backends  # noqa: E402
from flash_qla_cp.kernels import tilelang_bwd_impl, tilelang_common, tilelang_fwd, tilelang_split  # noqa: E402
from flash_qla_cp.ops import chunk_gated_delta_rule  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tp8_1x32k")
    ap.add_argument("--pass", dest="which", default="fwd", choices=("fwd", "fwdbwd"))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    B, T, H, HV, K, V, nseq = SHAPES[args.shape]
    if nseq is not None:
        raise SystemExit("dense shapes only (varlen needs cu_seqlens on a device)")

    marks = []

    def compile_stub(factory, **params):
        return lambda *launch_args: marks.append(time.perf_counter())

    meta = dict(device="meta")
    q = torch.empty(B, T, H, K, dtype=torch.bfloat16, **meta)
    k = torch.empty_like(q)
    v = torch.empty(B, T, HV, V, dtype=torch.bfloat16, **meta)
    g = torch.empty(B, T, HV, **meta)
    beta = torch.empty(B, T, HV, **meta)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    do = torch.empty_like(v)

    def fwd():
        with torch.no_grad():
            return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, backend="tilelang",
                                          intra_cp="auto")

    def fwdbwd():
        o, _ = chunk_gated_delta_rule(*ins, output_final_state=False, backend="tilelang", intra_cp="auto")
        for t in ins:
            t.grad = None
        o.backward(do)

    fn = fwd if args.which == "fwd" else fwdbwd
    with mock.patch.object(backends, "tilelang_unsupported_reason", lambda q, v: None), \
            mock.patch.object(tilelang_fwd, "compile_kernel", compile_stub), \
            mock.patch.object(tilelang_bwd_impl, "compile_kernel", compile_stub), \
            mock.patch.object(tilelang_split, "compile_kernel", compile_stub), \
            mock.patch.object(tilelang_common, "sm_count", lambda device: 132):
        for _ in range(20):
            fn()
        timelines = []
        for _ in range(args.calls):
            marks.clear()
            start = time.perf_counter()
            fn()
            end = time.perf_counter()
            timelines.append([round((m - start) * 1e6, 1) for m in marks] + [round((end - start) * 1e6, 1)])
        ends = [t[-1] for t in timelines]
        median = timelines[ends.index(sorted(ends)[len(ends) // 2])]
        print(f"{args.shape} {args.which}: launches at {median[:-1]} us, end {median[-1]} us "
              f"(median of {args.calls}; mean end {statistics.mean(ends):.1f})")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
