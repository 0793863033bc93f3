"""Compile TileLang kernels for the device machine here, on a CPU machine, into a kernel cache
archive that device calls carry, so that a GPU call does not spend its minutes compiling (30-60 s
per kernel there).

    python tools/precompile_cache.py --log kernels.jsonl [--tar .device/tlcache.tar.xz]
    python tools/precompile_cache.py --bench-shapes tp1_1x32k,tp8_1x32k

--log: the kernel log a GPU run wrote (FLASH_QLA_CP_KERNEL_LOG; tools/device_session.sh sets it).
--bench-shapes: the kernels our op launches for those shapes of benchmarks/bench_kernels.py
(forward with final states, and fwd+bwd with and without kept states), found by running the host
code on CPU tensors with every launch recorded instead of run (the plans decide, as on the GPU).
TileLang's cache key is the kernel's script, the target and the pass configs, none of which
needs a GPU: with the arch pinned to the device's, the keys are the device's. Needs nvcc here
(`pip install "tilelang[nvcc]"` or a CUDA toolkit).
"""

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def load_log(path):
    """[KernelSpec] of a kernel log (one JSON object per line: module, factory, params)."""
    from flash_qla_cp.kernels.runtime import KernelSpec

    specs = []
    with open(path) as f:
        for line in filter(str.strip, f):
            entry = json.loads(line)
            factory = getattr(importlib.import_module(entry["module"]), entry["factory"])
            specs.append(KernelSpec.of(factory, **entry["params"]))
    return specs


def bench_shape_specs(names, sms=132):
    """[KernelSpec] our op launches for the named bench shapes, each once, in first-use order."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_kernels import SHAPES, shape_cu

    from flash_qla_cp.kernels import runtime
    from flash_qla_cp.kernels.backward import tilelang_backward
    from flash_qla_cp.kernels.forward import tilelang_forward

    found = {}

    def record(spec):
        found.setdefault(spec, None)
        return lambda *args: None  # a launch that does nothing: outputs stay as allocated

    with mock.patch.object(runtime, "compile_kernel", record), mock.patch.object(runtime, "compile_plan", lambda p: None), \
            mock.patch.object(runtime, "sm_count", lambda d: sms):
        for name in names:
            B, T, H, HV, K, V, nseq = SHAPES[name]
            if nseq:
                B, T = 1, B * T
            q = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
            v = torch.zeros(B, T, HV, V, dtype=torch.bfloat16)
            g = beta = torch.zeros(B, T, HV)
            cu = shape_cu(name).to(torch.int32) if nseq else None
            cu_host = cu.tolist() if cu is not None else None
            for final, keep in ((True, False), (False, True), (False, False)):
                o, _, saved = tilelang_forward(q, q, v, g, beta, K**-0.5, None, final, cu, intra_cp="auto",
                                               cu_seqlens_host=cu_host, save_states=keep)
                if not final:  # the bench's forward (final states) has no backward
                    tilelang_backward(torch.zeros_like(o), None, q, q, v, g, beta, K**-0.5, None, cu, saved)
    return list(found)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", help="a kernel log (JSON lines) a GPU run wrote")
    ap.add_argument("--bench-shapes", help="comma-separated shape names of benchmarks/bench_kernels.py")
    ap.add_argument("--arch", default="sm_90a", help="the device's arch (H200: sm_90a)")
    ap.add_argument("--sms", type=int, default=132, help="the device's SM count (H200: 132)")
    ap.add_argument("--tar", default=".device/tlcache.tar.xz", help="cache archive to extend (created if absent)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    if not (args.log or args.bench_shapes):
        ap.error("give --log and / or --bench-shapes")

    work = tempfile.mkdtemp(prefix="tlcache_")
    if os.path.exists(args.tar):
        subprocess.run(["tar", "-xJf", args.tar, "-C", work], check=True)
    os.environ["TILELANG_CACHE_DIR"] = os.path.join(work, "tlcache")  # before tilelang is imported

    import tilelang.cuda.target as cuda_target

    cuda_target._detect_torch_cuda_arch = lambda: args.arch  # what target="cuda" resolves to there
    from flash_qla_cp.kernels.runtime import precompile

    todo = load_log(args.log) if args.log else []
    if args.bench_shapes:
        todo += bench_shape_specs(args.bench_shapes.split(","), args.sms)
    todo = list(dict.fromkeys(todo))
    start = time.time()
    done = 0
    for i in range(0, len(todo), args.workers):  # small batches: progress on long runs
        done += precompile(todo[i : i + args.workers], num_workers=args.workers)
        print(f"{min(i + args.workers, len(todo))} of {len(todo)} kernels, {done} built or loaded from the cache, "
              f"{time.time() - start:.0f} s", flush=True)

    tmp_tar = os.path.join(work, "tlcache.tar.xz")
    subprocess.run(["tar", "-C", work, "-cJf", tmp_tar, "tlcache"], check=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.tar)), exist_ok=True)
    shutil.move(tmp_tar, args.tar)
    shutil.rmtree(work)
    print(f"{args.tar}: {os.path.getsize(args.tar) / 2**20:.1f} MiB")


if __name__ == "__main__":
    sys.exit(main())
