"""Per-kernel GPU time of the GatedDeltaNet layer, forward and forward+backward (torch.profiler):
which pieces of ours cost more than their memory traffic, and where FLA's layer spends its time.

    python tools/profile_layer.py --shapes qwen3_next_1x32k --libs ours,fla [--compile]

Prints one JSON line per shape, library and pass: each CUDA kernel's time per call (summed over
--iters calls, divided by --iters), the kernel sum and the wall time per call, and writes
profile_layer.json under --out. Shapes and layers are those of benchmarks/bench_layer.py.
--compile profiles the calls under torch.compile instead (as bench_layer's compile rows run them).
Where wall and kernel sum differ, each line also says where: the host ms per call (calls issued
back to back), and for calls run back to back as the benchmark runs them, the GPU's idle time
per call between kernels, its largest gaps (microseconds, the kernels on either side) and the
runtime calls that wait for the GPU (the profiler's own final synchronize left out).
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, HERE)

from bench_layer import SHAPES, call, make_layer  # noqa: E402
from profile_kernels import WAITING_CALLS, host_ms, kernel_times  # noqa: E402

from flash_qla_cp.testing import random_cu_seqlens  # noqa: E402


def idle_gaps(fn, calls=5, top=6):
    """(GPU idle ms per call while `calls` warm calls of fn run back to back, as a benchmark runs
    them, the `top` largest gaps as (us, kernel before, kernel after), runtime calls in them that
    wait for the GPU). The calls start after a synchronize, so the first begins on an idle GPU:
    the host's time between its first launches can show as a gap there (weighing 1 / `calls` in
    the idle time, and named among the largest gaps), which the later calls hide."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    waits = sorted({e.name for e in prof.events() if e.name in WAITING_CALLS and e.name != "cudaDeviceSynchronize"})
    gaps = [(max(0.0, b.time_range.start - a.time_range.end), a.name[:40], b.name[:40])
            for a, b in zip(kernels, kernels[1:])]
    largest = [(round(us, 1), before, after) for us, before, after in sorted(gaps, reverse=True)[:top]]
    return round(sum(g[0] for g in gaps) / 1000 / calls, 4), largest, waits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3_next_1x32k")
    ap.add_argument("--libs", default="ours,fla")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=25, help="kernels listed per pass")
    ap.add_argument("--compile", action="store_true", help="the layers under torch.compile")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import triton.testing

    device = torch.device("cuda")
    result = []
    for sname in args.shapes.split(","):
        hidden, H, HV, D, B, T, lengths = SHAPES[sname]
        cu = random_cu_seqlens(lengths, device=device) if lengths else None
        x = torch.randn(B if cu is None else 1, T if cu is None else sum(lengths), hidden, device=device,
                        dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        for lib in args.libs.split(","):
            layer = make_layer(lib, hidden, H, HV, D, device, torch.bfloat16)
            xg = x.clone().requires_grad_(True)
            run = torch.compile(lambda x_, _layer=layer, _lib=lib: call(_layer, _lib, x_, cu)) if args.compile \
                else (lambda x_, _layer=layer, _lib=lib: call(_layer, _lib, x_, cu))

            def fwd():
                with torch.no_grad():
                    run(x)

            def fwdbwd():
                xg.grad = None
                layer.zero_grad(set_to_none=True)
                run(xg).backward(dy)

            for name, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                rows = kernel_times(fn, args.iters)
                idle, gaps, waits = idle_gaps(fn)
                entry = {"shape": sname, "lib": lib, "mode": "compile" if args.compile else "eager", "pass": name,
                         "total_ms": round(sum(r[1] for r in rows), 4),
                         "wall_ms": round(triton.testing.do_bench(fn, return_mode="median"), 4),
                         "host_ms": round(host_ms(fn, args.iters), 4), "idle_ms": idle, "largest_gaps_us": gaps,
                         "waiting_calls": waits, "kernels": rows[: args.top]}
                result.append(entry)
                print(json.dumps(entry), flush=True)
            del layer
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "profile_layer.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
