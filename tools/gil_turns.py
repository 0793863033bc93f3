"""How much a kernel's lowering depends on getting the GIL back: the fused backward walk (Qwen3-Next
heads) is lowered for sm_90a with or without a pure-Python thread spinning beside it, at a given
Python thread switch interval. No GPU needed.

    python tools/gil_turns.py [--interval 0.005] [--spinner]

The lowering runs in C++ with the GIL released, but takes the GIL back many times; a thread
that holds the GIL keeps it for a whole switch interval, so beside busy Python threads (another
kernel's Python phases in a compile round) the lowering stalls. `runtime._short_gil_turns`
shortens the interval while a process compiles. Prints one JSON line.
"""

import argparse
import json
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.005, help="sys.setswitchinterval, seconds (Python: 0.005)")
    ap.add_argument("--spinner", action="store_true", help="a pure-Python thread runs beside the lowering")
    args = ap.parse_args()
    os.environ["TILELANG_CACHE_DIR"] = tempfile.mkdtemp(prefix="gil_turns_")
    sys.path.insert(0, ROOT)
    from flash_qla_cp.kernels.hopper.bwd_fused import build_bwd_fused_ws_kernel
    from flash_qla_cp.kernels.hopper.common import pass_configs
    from flash_qla_cp.kernels.lowering import lower_for_cuda

    sys.setswitchinterval(args.interval)
    done = threading.Event()

    def spin():
        while not done.is_set():
            pass

    if args.spinner:
        threading.Thread(target=spin, daemon=True).start()
    start = time.perf_counter()
    prim_func = build_bwd_fused_ws_kernel(H=16, HV=32, K=128, V=128, dtype="bfloat16", scale=128 ** -0.5,
                                          use_dht=True, store_dh0=True)
    built = time.perf_counter()
    lower_for_cuda(prim_func, configs=pass_configs(build_bwd_fused_ws_kernel))
    lowered = time.perf_counter()
    done.set()
    print(json.dumps({"interval_s": args.interval, "spinner": args.spinner, "cores": os.cpu_count(),
                      "build_s": round(built - start, 2), "lowering_s": round(lowered - built, 2)}))


if __name__ == "__main__":
    main()
