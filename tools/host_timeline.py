"""Where the host time of one call goes, launch by launch, for a call timed alone and for calls
issued back to back. The eager time of a host-bound call depends on the host time before its last
launch; this prints, per TileLang launch of ours, the host microseconds since the call began.

    python tools/host_timeline.py --shape tp8_1x32k --pass fwd

Prints one JSON line per setting: "alone" (one call after a device sync, median of --reps) and
"loop" (the k-th of --calls calls issued back to back), with the launch offsets, the call's end,
and do_bench's eager median for the same call. Writes host_timeline.json under --out.
--profile adds a cProfile of --profile-calls calls (`profile_top`: the functions with
the most own time, totals over the calls; torch's C++ entry points show up as builtins) to the
JSON as "profile". A CUDA backward runs on autograd's
device thread, out of the profiler's sight (it shows as run_backward's own time) and after a
thread hand-off: --same-thread-backward runs it on the calling thread instead
(torch.autograd.set_multithreading_enabled(False)), for the profile and for a timing without
the hand-off.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_kernels import build_fns, shape_inputs  # noqa: E402


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


def timeline(fn, marks):
    """(launch offsets in us, end in us) of one call of fn; marks collects perf_counter stamps."""
    marks.clear()
    start = time.perf_counter()
    fn()
    end = time.perf_counter()
    return [round((m - start) * 1e6, 1) for m in marks], round((end - start) * 1e6, 1)


def main():
    import triton.testing

    from flash_qla_cp.kernels import runtime

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tp8_1x32k")
    ap.add_argument("--pass", dest="which", default="fwd", choices=("fwd", "fwdbwd"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-calls", type=int, default=500)
    ap.add_argument("--same-thread-backward", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args()

    marks = []
    launch = runtime.DirectLaunch.__call__

    def stamped(self, *a):
        marks.append(time.perf_counter())
        return launch(self, *a)

    if args.same_thread_backward:
        torch.autograd.set_multithreading_enabled(False)
    q, k, v, g, beta, cu = shape_inputs(args.shape)
    fwd, fwdbwd = build_fns("ours", q, k, v, g, beta, cu, q.shape[-1] ** -0.5)
    fn = fwd if args.which == "fwd" else fwdbwd
    fn()
    torch.cuda.synchronize()
    rows = {"shape": args.shape, "pass": args.which, "same_thread_backward": args.same_thread_backward,
            "do_bench_eager_ms": round(triton.testing.do_bench(fn, return_mode="median"), 4)}
    runtime.DirectLaunch.__call__ = stamped
    try:
        alone = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            alone.append(timeline(fn, marks))
        ends = [e for _, e in alone]
        rows["alone"] = alone[ends.index(statistics.median(ends))]
        torch.cuda.synchronize()
        loop = [timeline(fn, marks) for _ in range(args.calls)]
        torch.cuda.synchronize()
        rows["loop_last"] = loop[-1]
        rows["loop_median_end_us"] = statistics.median(e for _, e in loop)
    finally:
        runtime.DirectLaunch.__call__ = launch
    if args.profile:
        rows["profile"] = profile_top(fn, args.profile_calls, "tottime", n=40, sync_every=20)
    print(json.dumps({k: v for k, v in rows.items() if k != "profile"}), flush=True)
    for line in rows.get("profile", []):
        print(line)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_timeline.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
