"""Compile TileLang kernels for the device machine here, on a CPU machine, into the kernel cache
that device calls carry (`.device/tlcache.tar.xz`, see device_session.sh), so that a GPU call
does not spend its minutes compiling (30-60 s per kernel there).

    python tests/gpu/precompile_cache.py SPEC_FILE [--arch sm_90a] [--sms 132] [--tar .device/tlcache.tar.xz]

SPEC_FILE is a Python file defining `specs(sms) -> [(factory, params)]` (sms: the device's SM
count, for kernels whose grid depends on it), or a JSON-lines kernel log that a GPU run wrote
(device_session.sh sets FLASH_QLA_CP_KERNEL_LOG to $OUT/kernels.jsonl). TileLang's cache key is the kernel's script, the
target and the pass configs, none of which needs a GPU: with the arch pinned to the device's,
the keys are the device's (checked on the H200: the prepare kernels compiled here landed on the
cache entries the device had written). The shared libraries need only libc, so they load there.
Needs nvcc here (`pip install "tilelang[nvcc]"` or a CUDA toolkit).
"""

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def load_specs(spec_file, sms):
    """[(factory, params)] from a spec module or from a kernel log (one JSON object per line)."""
    if spec_file.endswith(".jsonl"):
        todo = []
        with open(spec_file) as f:
            for line in filter(str.strip, f):
                entry = json.loads(line)
                factory = getattr(importlib.import_module(entry["module"]), entry["factory"])
                todo.append((factory, entry["params"]))
        return todo
    spec = importlib.util.spec_from_file_location("precompile_specs", spec_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.specs(sms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec_file")
    ap.add_argument("--arch", default="sm_90a", help="the device's arch (H200: sm_90a)")
    ap.add_argument("--sms", type=int, default=132, help="the device's SM count (H200: 132)")
    ap.add_argument("--tar", default=".device/tlcache.tar.xz", help="cache archive to extend (created if absent)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="tlcache_")
    if os.path.exists(args.tar):
        subprocess.run(["tar", "-xJf", args.tar, "-C", work], check=True)
    os.environ["TILELANG_CACHE_DIR"] = os.path.join(work, "tlcache")  # before tilelang is imported

    import tilelang.cuda.target as cuda_target

    cuda_target._detect_torch_cuda_arch = lambda: args.arch  # what target="cuda" resolves to there
    from flash_qla_cp.kernels.tilelang_common import precompile

    todo = load_specs(args.spec_file, args.sms)
    start = time.time()
    done = 0
    for i in range(0, len(todo), args.workers):  # small batches: progress on long runs
        done += precompile(todo[i : i + args.workers], num_workers=args.workers)
        print(f"{min(i + args.workers, len(todo))} of {len(todo)} specs, {done} built or loaded from the cache, "
              f"{time.time() - start:.0f} s", flush=True)

    tmp_tar = os.path.join(work, "tlcache.tar.xz")
    subprocess.run(["tar", "-C", work, "-cJf", tmp_tar, "tlcache"], check=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.tar)), exist_ok=True)
    shutil.move(tmp_tar, args.tar)
    shutil.rmtree(work)
    print(f"{args.tar}: {os.path.getsize(args.tar) / 2**20:.1f} MiB")


if __name__ == "__main__":
    sys.exit(main())
