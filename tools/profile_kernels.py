"""Per-kernel GPU time of our forward, training forward (inputs needing grad: what it keeps for the
backward included) and forward+backward (torch.profiler), to see where time goes.

    python tools/profile_kernels.py --shapes tp8_1x32k --intra auto,off
    python tools/profile_kernels.py --shapes tp1_1x32k --lib flashqla   # the peer's kernels

Prints, per shape and intra setting, each CUDA kernel's total time over --iters iterations
divided by --iters (ms per call), and writes profile_kernels.json under --out. Next to the
kernel sum: the wall time per call (do_bench median), the host time per call (calls issued
back to back without waiting, so the GPU is not the limit while the launch queue has room),
the CUDA runtime calls that wait for the GPU, and the host ops that took the most time. Where
host_ms is near wall_ms and above total_ms, the launches are the cost, not the kernels.
"""

import argparse
import json
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_kernels import shape_inputs  # noqa: E402

from flash_qla_cp import chunk_gated_delta_rule  # noqa: E402


def kernel_times(fn, iters):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = ev.cuda_time_total
        if t > 0:
            rows.append((ev.key[:90], round(t / iters / 1000, 4), ev.count // iters))
    return sorted(rows, key=lambda r: -r[1])


WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def host_ms(fn, iters):
    """Host ms per call of `fn` (already warm), its calls issued back to back without waiting."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):  # ~40 launches a call: well inside the launch queue
        fn()
    host = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    return host


def host_times(fn, iters):
    """(wall ms per call, host ms per call, waiting runtime calls per call, top host ops)."""
    import triton.testing

    wall = triton.testing.do_bench(fn, return_mode="median")
    host = host_ms(fn, iters)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    waits = Counter(ev.name for ev in prof.events() if ev.name in WAITING_CALLS)
    top = sorted(prof.key_averages(), key=lambda ev: -ev.self_cpu_time_total)[:10]
    return (round(wall, 4), round(host, 4), dict(waits),
            [(ev.key[:60], round(ev.self_cpu_time_total / 1000, 4), ev.count) for ev in top])


def operation(lib, intra):
    """The public op of `lib` as f(q, k, v, g, beta, **kw)."""
    if lib == "flashqla":
        from flash_qla import chunk_gated_delta_rule as peer

        return peer
    return lambda *a, **kw: chunk_gated_delta_rule(*a, backend="tilelang", intra_cp=intra, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp8_1x32k")
    ap.add_argument("--intra", default="auto,off")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--lib", default="ours", choices=("ours", "flashqla"),
                    help="flashqla: profile FlashQLA's public op instead (--intra is ignored)")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = []
    for sname in args.shapes.split(","):
        q, k, v, g, beta, cu = shape_inputs(sname)
        cu = None if cu is None else cu.to("cuda", torch.int32)
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        do = torch.randn_like(v)
        for intra in (args.intra.split(",") if args.lib == "ours" else ["-"]):
            intra = intra if intra in ("auto", "off", "-") else int(intra)
            op = operation(args.lib, intra)

            def fwd():
                with torch.no_grad():
                    op(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)

            def fwd_train():  # the forward a backward will follow: what it keeps for the backward included
                op(*ins, cu_seqlens=cu)

            def fwdbwd():
                o, _ = op(*ins, cu_seqlens=cu)
                for t in ins:  # written, not accumulated (as bench_kernels.py)
                    t.grad = None
                o.backward(do)

            for name, fn in (("fwd", fwd), ("fwd_train", fwd_train), ("fwdbwd", fwdbwd)):
                rows = kernel_times(fn, args.iters)
                wall, host, waits, top = host_times(fn, args.iters)
                entry = {"shape": sname, "lib": args.lib, "intra": str(intra), "pass": name,
                         "total_ms": round(sum(r[1] for r in rows), 4), "wall_ms": wall, "host_ms": host,
                         "waiting_calls": waits, "kernels": rows[:12], "host_ops": top}
                result.append(entry)
                print(json.dumps(entry), flush=True)
    with open(os.path.join(args.out, "profile_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
