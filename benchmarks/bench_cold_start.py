"""Cold start: how long the first forward+backward of a new head configuration takes, with an empty
kernel cache and with the cache the first run filled, each in a fresh process.

    python benchmarks/bench_cold_start.py [--heads 16 --v-heads 32 --head-dim 128 --tokens 8192] [--out DIR]

Three fresh processes share one new TileLang cache directory (TILELANG_CACHE_DIR):
  cold       an empty cache: every kernel of the call is compiled (in parallel, per plan);
  warm       the cache the cold run filled: kernels are loaded, nothing compiled;
  precompiled  `python -m flash_qla_cp.precompile --layer qwen3_next` into a second empty cache
             (its time reported), then the first call.
Each child times, in wall seconds, a plain matmul's fwd+bwd (CUDA start: cuBLAS and autograd),
then its first `GatedDeltaNet` fwd+bwd (the fused layer: its own kernels and the op's), of that
the rounds of kernel building or loading (`runtime.precompile` calls, the first with TileLang's
import; the rest is the host work, the kernels' first launches and the GPU time), and reports
the steady-state ms of the next calls. Writes bench_cold_start.json / .md into --out (default
$OUT, else benchmarks/results). `--device cpu` runs the plumbing on the torch backend (nothing
to compile).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def child(args) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    from flash_qla_cp import GatedDeltaNet
    from flash_qla_cp.kernels import runtime

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layer = GatedDeltaNet(args.hidden, args.heads, args.v_heads, args.head_dim, args.head_dim).to(device, dtype)
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step():
        layer(x).float().square().mean().backward()
        sync()

    # a plain matmul's fwd+bwd first: loading cuBLAS and starting autograd (seconds on a machine
    # whose page cache has not seen the CUDA libraries yet) is any CUDA job's start, not this
    # head configuration's
    start = time.perf_counter()
    w = torch.randn(args.hidden, args.hidden, device=device, dtype=dtype, requires_grad=True)
    (x.detach() @ w).float().square().mean().backward()
    sync()
    libraries = time.perf_counter() - start
    with runtime.recorded_rounds() as rounds:
        start = time.perf_counter()
        step()
        first = time.perf_counter() - start
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"cuda_start_s": round(libraries, 2), "first_call_s": round(first, 2), "build_rounds": rounds,
            "steady_ms": round(1e3 * sorted(times)[2], 3)}


def run_child(args, cache_dir) -> dict:
    env = dict(os.environ, TILELANG_CACHE_DIR=cache_dir, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--child", "--device", args.device, "--heads", str(args.heads), "--v-heads",
           str(args.v_heads), "--head-dim", str(args.head_dim), "--hidden", str(args.hidden), "--tokens",
           str(args.tokens)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def precompile(args, cache_dir) -> float:
    env = dict(os.environ, TILELANG_CACHE_DIR=cache_dir, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "flash_qla_cp.precompile", "--heads", str(args.heads), "--v-heads",
                    str(args.v_heads), "--head-dim", str(args.head_dim), "--layer", "qwen3_next"], env=env, check=True,
                   capture_output=True)
    return round(time.perf_counter() - start, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-precompile", action="store_true", help="skip the precompiled case (it builds every plan)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    import torch

    versions = {"torch": torch.__version__}
    try:
        import tilelang

        versions["tilelang"] = tilelang.__version__
    except ImportError:
        versions["tilelang"] = "not installed"
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"command": " ".join(["python", "benchmarks/bench_cold_start.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": gpu,
              "cpu_cores": os.cpu_count(), "versions": versions, "config": vars(args)}
    with tempfile.TemporaryDirectory() as cache:
        result["cold"] = run_child(args, cache)
        print(json.dumps({"cold": result["cold"]}), flush=True)
        result["warm"] = run_child(args, cache)
        print(json.dumps({"warm": result["warm"]}), flush=True)
    if not args.no_precompile and args.device == "cuda":
        with tempfile.TemporaryDirectory() as cache:
            result["precompile_s"] = precompile(args, cache)
            result["precompiled"] = run_child(args, cache)
            print(json.dumps({"precompile_s": result["precompile_s"], "precompiled": result["precompiled"]}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_cold_start.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Cold start — {gpu} ({os.cpu_count()} CPU cores), {result['date']}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "", f"Command: `{result['command']}`", "",
             f"GatedDeltaNet (hidden {args.hidden}, H {args.heads}, HV {args.v_heads}, head dim {args.head_dim}), "
             f"1 x {args.tokens} tokens, first fwd+bwd of a fresh process, after a plain matmul's fwd+bwd "
             "(CUDA start s: cuBLAS loaded, autograd started, timed apart):", "",
             "| cache | CUDA start s | first call s | of that, kernel rounds (kernels: s) | rest s | steady ms |",
             "|---|---|---|---|---|---|"]
    for case in ("cold", "warm", "precompiled"):
        if case in result:
            r = result[case]
            rounds = ", ".join(f"{x['kernels']}: {x['s']}" for x in r["build_rounds"]) or "-"
            rest = round(r["first_call_s"] - sum(x["s"] for x in r["build_rounds"]), 2)
            lines.append(f"| {case} | {r['cuda_start_s']} | {r['first_call_s']} | {rounds} | {rest} | {r['steady_ms']} |")
    if "precompile_s" in result:
        lines += ["", f"`python -m flash_qla_cp.precompile ... --layer qwen3_next` took {result['precompile_s']} s."]
    with open(os.path.join(args.out, "bench_cold_start.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
