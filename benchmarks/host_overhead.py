"""Host (CPU) time per call of our forward and forward+backward, next to FlashQLA's, and where
ours goes (cProfile). At small per-GPU shapes (TP8) the GPU finishes before the host has issued
the next call, so host time is the wall time; this says which Python pieces to cut.

    python benchmarks/host_overhead.py --shapes tp8_1x32k --libs ours,flashqla

Per shape and library: wall ms (do_bench median) and host ms (calls issued back to back without
waiting). For ours also the cProfile top functions by own time and by cumulative time (the
TileLang launch wrapper shows there per kernel). Writes host_overhead.json under --out.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import each_call  # noqa: E402
from profile_kernels import host_ms  # noqa: E402


def profile_top(fn, iters, sort, n=25, sync_every=None):
    """The top n lines of a cProfile report (pstats totals) of `iters` calls of fn, sorted by
    `sort`; sync_every: wait for the GPU (outside the profile) every that many calls, so that a
    full launch queue does not show up as launch time."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for i in range(iters):
        if sync_every and i % sync_every == 0:
            torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats(sort).print_stats(n)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
    return lines[start:start + n + 1]


def main():
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp8_1x32k")
    ap.add_argument("--libs", default="ours,flashqla")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = []
    for sname, lib, name, fn in each_call(args.shapes.split(","), args.libs.split(",")):
        entry = {"shape": sname, "lib": lib, "pass": name,
                 "wall_ms": round(triton.testing.do_bench(fn, return_mode="median"), 4),
                 "host_ms": round(host_ms(fn, args.iters), 4)}
        if lib == "ours":
            entry["tottime"] = profile_top(fn, args.iters, "tottime")
            entry["cumtime"] = profile_top(fn, args.iters, "cumulative")
        result.append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k not in ("tottime", "cumtime")}), flush=True)
        for key in ("tottime", "cumtime"):
            for ln in entry.get(key, []):
                print(f"  {key[:3]} {ln[:200]}")
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
