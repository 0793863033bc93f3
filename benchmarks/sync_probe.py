"""Does a call wait for the GPU? A call that synchronises with the device (a read-back, a copy from
pageable host memory) cannot run ahead of the GPU: its host time then hides nothing behind
earlier work, which is what eager timings at small per-GPU shapes are made of.

    python benchmarks/sync_probe.py --shapes tp8_1x32k --libs ours,flashqla

Per library and pass: host ms of one call issued while the GPU is busy with a ~`--busy-ms` sleep
kernel, next to the host ms of the same call on an idle GPU. A call that waits shows about
busy-ms more. torch's own synchronising ops are also reported (torch.cuda.set_sync_debug_mode
"warn", with the line that called the op). Writes sync_probe.json under --out.
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import each_call  # noqa: E402


def host_ms(fn, busy_cycles, reps=5):
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def torch_syncs(fn):
    """Where torch reports a synchronising op during one call (message @ file:line)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        # a warning raised in torch's C++ is attributed to the Python line that called the op
        return [f"{str(w.message)[:100]} @ {w.filename}:{w.lineno}" for w in caught]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp8_1x32k")
    ap.add_argument("--libs", default="ours,flashqla")
    ap.add_argument("--busy-ms", type=float, default=3.0)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    # cycles of the sleep kernel for busy-ms (clock rate in kHz)
    busy_cycles = int(args.busy_ms * torch.cuda.get_device_properties(0).clock_rate)
    rows = []
    for sname, lib, name, fn in each_call(args.shapes.split(","), args.libs.split(",")):
        fn()
        fn()
        row = {"shape": sname, "lib": lib, "pass": name, "idle_host_ms": round(host_ms(fn, 0), 3),
               "busy_host_ms": round(host_ms(fn, busy_cycles), 3), "busy_ms": args.busy_ms,
               "torch_syncs": torch_syncs(fn)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sync_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
