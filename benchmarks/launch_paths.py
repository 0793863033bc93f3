"""Host microseconds per TileLang kernel launch, by call path, for the kernels one forward +
backward of a bench shape launches. Says where the ~30 us per launch of the default path goes:

- `jit`: JITKernel.__call__ (TileLang's tvm-ffi adapter, then the module's entry function);
- `main`: the module's entry function called directly (what `tilelang_common.DIRECT_LAUNCH` does);
- `main_ffi`: the same with the tensors converted to tvm_ffi tensors beforehand, i.e. without the
  per-call DLPack conversion of torch tensors.

    python benchmarks/launch_paths.py --shape tp8_1x32k

Each launch is issued `--calls` times back to back (few enough that the GPU's launch queue never
fills, so the host never waits), timed on the host clock; median of `--reps`. Writes
launch_paths.json under --out.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import build_fns, shape_inputs  # noqa: E402


def capture_launches(fn):
    """[(kernel, args)] of every TileLang launch in one call of fn."""
    from tilelang.jit.kernel import JITKernel

    seen = []
    original = JITKernel.__call__

    def recording(self, *args, **kwargs):
        seen.append((self, args))
        return original(self, *args, **kwargs)

    JITKernel.__call__ = recording
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        JITKernel.__call__ = original
    return seen


def host_us(call, calls, reps):
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def main():
    import tvm_ffi

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tp8_1x32k")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()

    info = {"torch": torch.__version__, "tvm_ffi": getattr(tvm_ffi, "__version__", "?"),
            "torch_has_dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__")}
    q, k, v, g, beta, cu = shape_inputs(args.shape)
    _, fwdbwd = build_fns("ours", q, k, v, g, beta, cu, q.shape[-1] ** -0.5)
    fwdbwd()
    launches = capture_launches(fwdbwd)
    rows = []
    for kern, kargs in launches:
        main_fn = kern.adapter._get_executable().main
        ffi_args = [tvm_ffi.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in kargs]
        row = {"kernel": kern.prim_func.attrs["global_symbol"], "args": len(kargs),
               "jit_us": host_us(lambda: kern(*kargs), args.calls, args.reps),
               "main_us": host_us(lambda: main_fn(*kargs), args.calls, args.reps),
               "main_ffi_us": host_us(lambda: main_fn(*ffi_args), args.calls, args.reps)}
        rows.append(row)
        print(json.dumps({k_: (round(v_, 2) if isinstance(v_, float) else v_) for k_, v_ in row.items()}), flush=True)
    total = {key: round(sum(r[key] for r in rows), 1) for key in ("jit_us", "main_us", "main_ffi_us")}
    print("per fwd+bwd:", json.dumps(total), json.dumps(info))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_paths.json"), "w") as f:
        json.dump({"shape": args.shape, "info": info, "launches": rows, "total": total}, f, indent=1)


if __name__ == "__main__":
    main()
