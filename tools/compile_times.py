"""Where a cold start's compile time goes: for each kernel of one fwd+bwd of our GatedDeltaNet at a
shape of benchmarks/bench_layer.py, the seconds TileLang's lowering takes (its slowest passes
named) and the seconds of the rest of the build (CUDA code generation, nvcc, the host wrapper),
on this machine: no GPU needed, nvcc is.

    python tools/compile_times.py [--shape qwen3_next_1x32k] [--passes 3] [--out DIR] [--only bwd_fused]
    python tools/compile_times.py --first-call [--shape qwen3_next_1x32k] [--cache DIR]

Kernels compile one after another into a fresh TileLang cache, so each time is one core's; the
first call of a new head configuration compiles them in parallel (`runtime.compile_plan`), so
its wall time is about the slowest kernel's. Prints a JSON line per kernel and writes
compile_times.json into --out when given. --first-call instead runs that first fwd+bwd as the
layer does (its rounds of parallel compilation into a fresh cache, on this machine's cores), the
launches skipped, and prints each round's kernels and seconds; with --cache, into that cache (a
warm start: the kernels load, their PrimFuncs come from the store beside it).
"""

import argparse
import collections
import json
import os
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


class PassClock:
    """Seconds per TVM pass while active, and the seconds of the outermost pass calls (nested
    passes counted once)."""

    def __init__(self):
        self.by_pass = collections.Counter()
        self.outermost = 0.0
        self._depth = 0

    def __enter__(self):
        from tilelang import tvm

        self._transform = tvm.ir.transform
        self._call = self._transform.Pass.__call__
        clock = self

        def timed(pass_, mod):
            clock._depth += 1
            start = time.perf_counter()
            try:
                return clock._call(pass_, mod)
            finally:
                spent = time.perf_counter() - start
                clock._depth -= 1
                clock.by_pass[pass_.info.name] += spent
                if clock._depth == 0:
                    clock.outermost += spent

        self._transform.Pass.__call__ = timed
        return self

    def __exit__(self, *exc):
        self._transform.Pass.__call__ = self._call


def first_call(shape_name):
    """The first fwd+bwd of our GatedDeltaNet at a bench_layer shape with every kernel compiled
    for real and no launch run (CPU tensors, matmuls skipped): (seconds, [{"kernels": n, "s":
    seconds}] per round of compilation)."""
    import contextlib
    from unittest import mock

    from precompile_cache import layer_shape_step, recording

    from flash_qla_cp.kernels import runtime

    compiling = {"compile_kernel": runtime.compile_kernel, "compile_plan": runtime.compile_plan,
                 "precompile": runtime.precompile}
    with contextlib.ExitStack() as stack:
        rounds = stack.enter_context(runtime.recorded_rounds())
        stack.enter_context(recording(132))  # the TileLang backend chosen; the compiles are put back below
        for name, value in compiling.items():
            stack.enter_context(mock.patch.object(runtime, name, value))
        stack.enter_context(mock.patch.object(runtime.DirectLaunch, "__call__", lambda self, *args: None))
        step = layer_shape_step(shape_name, inference=False)
        start = time.perf_counter()
        step()
        return round(time.perf_counter() - start, 1), rounds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3_next_1x32k", help="a shape of benchmarks/bench_layer.py")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--passes", type=int, default=3, help="slowest lowering passes listed per kernel")
    ap.add_argument("--out", help="folder for compile_times.json")
    ap.add_argument("--only", help="time only the kernels whose factory name contains this (e.g. bwd_fused: the "
                                   "backward walk alone, to compare with its time inside --first-call's round)")
    ap.add_argument("--first-call", action="store_true", help="time the layer's first fwd+bwd (see above)")
    ap.add_argument("--cache", help="with --first-call: this TileLang cache directory (a warm start) instead of a "
                                    "fresh one")
    args = ap.parse_args()
    # before tilelang is imported
    os.environ["TILELANG_CACHE_DIR"] = args.cache or tempfile.mkdtemp(prefix="compile_times_")
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import tilelang.cuda.target as cuda_target

    cuda_target._detect_torch_cuda_arch = lambda: args.arch  # what target="cuda" resolves to on the device
    from precompile_cache import layer_shape_specs

    from flash_qla_cp.kernels.runtime import compile_spec

    if args.first_call:
        seconds, rounds = first_call(args.shape)
        print(json.dumps({"shape": args.shape, "cores": os.cpu_count(), "first_fwd_bwd_s": seconds,
                          "rounds": rounds}))
        return
    specs = [s for s in layer_shape_specs([args.shape]) if not args.only or args.only in s.factory.__name__]
    if not specs:
        ap.error(f"--only {args.only!r}: no kernel of {args.shape} has it in its factory's name")
    rows = []
    for spec in specs:
        with PassClock() as clock:
            start = time.perf_counter()
            compile_spec(spec, spec.build())
            total = time.perf_counter() - start
        row = {"kernel": spec.factory.__name__, "params": dict(spec.kwargs), "total_s": round(total, 1),
               "lowering_s": round(clock.outermost, 1), "rest_s": round(total - clock.outermost, 1),
               "slowest_passes": {n: round(s, 1) for n, s in clock.by_pass.most_common(args.passes)}}
        print(json.dumps({k: v for k, v in row.items() if k != "params"}), flush=True)
        rows.append(row)
    summary = {"shape": args.shape, "arch": args.arch, "kernels": len(rows),
               "sum_s": round(sum(r["total_s"] for r in rows), 1), "slowest_s": max(r["total_s"] for r in rows)}
    print(json.dumps(summary))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compile_times.json"), "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
