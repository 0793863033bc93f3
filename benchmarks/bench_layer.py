"""The Gated DeltaNet layer side by side: ours (`flash_qla_cp.GatedDeltaNet`) against FLA's
(`fla.layers.GatedDeltaNet`, flash-linear-attention, its default backend dispatch, which each FLA
row records as FLA logs it), in one process on the same input; `ours_steps` is our layer forced onto its
step-by-step path (torch conv, l2 norm, gates and norm around the op), the layer before fusion;
`ours_recompute` is the fused layer with save_states=False (the op's backward recomputes the
chunk states instead of keeping them: less memory, one more walk).

    python benchmarks/bench_layer.py [--shapes qwen3_next_1x32k,...] [--libs ours,ours_steps,fla] [--no-compile]

For each shape: forward (no grad) and forward+backward (input and parameter gradients) median
milliseconds, eager and under torch.compile, the peak memory of one fwd+bwd, and the error of our
bf16 layer (fused and step by step) against the same layer in float64 (torch backend, the shape cut to --check-tokens),
per output and parameter gradient. Writes bench_layer.json and bench_layer.md into --out
(default $OUT, else benchmarks/results). `--device cpu --shapes tiny --libs ours` runs on a CPU
(the torch backend) as a smoke test.
"""

import argparse
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from flash_qla_cp import GatedDeltaNet  # noqa: E402
from flash_qla_cp.testing import random_cu_seqlens, rel_err  # noqa: E402
from result_files import refuse_other_gpu, refuse_unknown_shapes, runs_with_rows  # noqa: E402

# name: (hidden, qk heads, v heads, head dim, batch, tokens per row, packed sequence lengths or None)
SHAPES = {
    "qwen3_next_1x32k": (2048, 16, 32, 128, 1, 32768, None),
    "qwen3_next_4x8k": (2048, 16, 32, 128, 4, 8192, None),
    "qwen3_next_varlen8_32k": (2048, 16, 32, 128, 1, 32768, (7000, 2100, 5300, 900, 6400, 3000, 4500, 3568)),
    "recipe_1x32k": (1024, 8, 16, 128, 1, 32768, None),
    "tiny": (64, 2, 4, 16, 2, 256, None),
}


def make_layer(lib, hidden, H, HV, D, device, dtype):
    torch.manual_seed(0)
    if lib in ("ours", "ours_steps", "ours_recompute"):
        layer = GatedDeltaNet(hidden, H, HV, D, D, save_states=lib != "ours_recompute").to(device=device, dtype=dtype)
        if lib == "ours_steps":  # the step-by-step path (torch conv, l2 norm, gates and norm around the op)
            layer._fused_backend = lambda *args: None
        return layer
    from fla.layers import GatedDeltaNet as FLAGatedDeltaNet

    return FLAGatedDeltaNet(hidden_size=hidden, expand_v=1.0, head_dim=D, num_heads=H, num_v_heads=HV,
                            mode="chunk").to(device=device, dtype=dtype)


def call(layer, lib, x, cu):
    if lib.startswith("ours"):
        return layer(x, cu_seqlens=cu)
    return layer(x, cu_seqlens=cu)[0]  # FLA's layer returns (o, attentions, cache)


def median_ms(fn, device, reps=20):
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def fla_dispatch_log():
    """FLA's backend choices while active ('[FLA Backend] op -> backend', or why a backend was
    rejected), as FLA logs them once per choice: which kernels FLA's layer ran."""
    seen = []

    class Lines(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "[FLA Backend]" in message:
                seen.append(message.replace("[FLA Backend] ", "")[:200])

    logger = logging.getLogger("fla.backends")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def timings(lib, shape, device, dtype, compiled):
    hidden, H, HV, D, B, T, lengths = shape
    layer = make_layer(lib, hidden, H, HV, D, device, dtype)
    cu = random_cu_seqlens(lengths, device=device) if lengths else None
    x = torch.randn(B if cu is None else 1, T if cu is None else sum(lengths), hidden, device=device, dtype=dtype)
    run = torch.compile(lambda x_: call(layer, lib, x_, cu)) if compiled else (lambda x_: call(layer, lib, x_, cu))
    xg = x.clone().requires_grad_(True)
    dy = torch.randn_like(x)

    def fwd():
        with torch.no_grad():
            run(x)

    def fwdbwd():
        xg.grad = None
        layer.zero_grad(set_to_none=True)
        run(xg).backward(dy)

    with fla_dispatch_log() as dispatch:
        row = {"fwd_ms": round(median_ms(fwd, device), 3), "fwdbwd_ms": round(median_ms(fwdbwd, device), 3)}
    if dispatch:
        row["fla_dispatch"] = dispatch
    if device.type == "cuda":
        # one fwd+bwd from a clean state: what the timing loop left for the garbage collector
        # (autograd graphs in reference cycles) would otherwise count towards the peak
        xg.grad = None
        layer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwdbwd()
        torch.cuda.synchronize()
        row["fwdbwd_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["fwdbwd_peak_over_inputs_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
    return row


def accuracy(shape, device, dtype, tokens):
    """Our layer in `dtype`, fused and step by step, against the same layer (same weights) in float64
    on the torch backend, per output and parameter gradient, on the first `tokens` tokens of the shape."""
    hidden, H, HV, D, B, _, _ = shape
    ref = make_layer("ours", hidden, H, HV, D, device, torch.float64)
    ref.backend = "torch"
    x = torch.randn(1, tokens, hidden, device=device, dtype=torch.float64)
    dy = torch.randn_like(x)
    outs = {}
    for name in ("ours", "ours_steps", "ref"):
        layer = ref if name == "ref" else make_layer(name, hidden, H, HV, D, device, dtype)
        if name != "ref":
            ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
        xl = (x if name == "ref" else x.to(dtype)).clone().requires_grad_(True)
        y = layer(xl)
        y.backward(dy.to(y.dtype))
        outs[name] = {"y": y.detach(), "dx": xl.grad, **{"d" + n: p.grad for n, p in layer.named_parameters()}}
    return {lib: {k: f"{rel_err(outs[lib][k], outs['ref'][k]):.1e}" for k in outs["ref"]}
            for lib in ("ours", "ours_steps")}


def versions():
    out = {"torch": torch.__version__}
    for mod in ("triton", "tilelang", "fla"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out[mod] = f"not importable: {exc!r}"[:120]
    return out


def to_markdown(meta, rows):
    runs = meta.get("runs") or [{"date": meta["date"], "command": meta["command"]}]
    lines = [f"# Layer benchmark — {meta['gpu']}, {meta['date']}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
             "Commands (each row names the run that measured it):", "",
             *[f"- {run['date']}: `{run['command']}`" for run in runs], "",
             "Median ms (do_bench on a GPU), fwd without grad, fwd+bwd with input and parameter gradients. "
             "/ FLA: the row's value over FLA's layer's on the same shape and mode (< 1: less time or memory).", "",
             "| shape | lib | mode | fwd ms | / FLA | fwd+bwd ms | / FLA | fwd+bwd peak GiB | / FLA | over inputs GiB "
             "| measured | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fla = {(r["shape"], r["mode"]): r for r in rows if r["lib"] == "fla"}

    def over_fla(r, key):
        theirs = fla.get((r["shape"], r["mode"]), {}).get(key)
        return f"{r[key] / theirs:.2f}" if r.get(key) and theirs else "-"

    for r in rows:
        lines.append(f"| {r['shape']} | {r['lib']} | {r['mode']} | {r.get('fwd_ms', '-')} | {over_fla(r, 'fwd_ms')} "
                     f"| {r.get('fwdbwd_ms', '-')} | {over_fla(r, 'fwdbwd_ms')} | {r.get('fwdbwd_peak_gib', '-')} "
                     f"| {over_fla(r, 'fwdbwd_peak_gib')} | {r.get('fwdbwd_peak_over_inputs_gib', '-')} "
                     f"| {r.get('measured', meta['date'])} | {r.get('error', '')[:120]} |")
    dispatch = sorted({line for r in rows for line in r.get("fla_dispatch", ())})
    if dispatch:
        lines += ["", "FLA's backend dispatch, as FLA logged it: " + "; ".join(f"`{line}`" for line in dispatch)]
    if meta.get("accuracy"):
        lines += ["", f"Our layer in {meta['dtype']} against float64 (relative L2), per output and parameter gradient "
                      "(ours: fused; ours_steps: the step-by-step path):", ""]
        for shape, by_lib in meta["accuracy"].items():
            for lib, errs in by_lib.items():
                lines.append(f"- {shape}, {lib}: " + ", ".join(f"{k} {v}" for k, v in errs.items()))
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3_next_1x32k,qwen3_next_4x8k,qwen3_next_varlen8_32k,recipe_1x32k")
    ap.add_argument("--libs", default="ours,ours_steps,fla",
                    help="ours (the fused layer), ours_steps (its step-by-step path), ours_recompute (fused, "
                         "chunk states recomputed in the backward), fla")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--merge", default=None,
                    help="a bench_layer.json of an earlier run whose rows (other shapes, libs or modes) "
                         "the output keeps")
    ap.add_argument("--check-tokens", type=int, default=4096, help="tokens of the accuracy check (0: none)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    refuse_unknown_shapes(ap, args.shapes.split(","), SHAPES)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join(["python", "benchmarks/bench_layer.py", *sys.argv[1:]]), "versions": versions(),
            "dtype": str(dtype).replace("torch.", ""), "accuracy": {}}
    if args.merge:
        refuse_other_gpu(ap, args.merge, meta["gpu"])
    rows, checked = [], {}
    for name in args.shapes.split(","):
        for lib in args.libs.split(","):
            for mode in ("eager",) if args.no_compile else ("eager", "compile"):
                row = {"shape": name, "lib": lib, "mode": mode, "measured": meta["date"]}
                try:
                    row.update(timings(lib, SHAPES[name], device, dtype, mode == "compile"))
                except Exception as exc:  # noqa: BLE001 - a library that fails is reported, the rest still run
                    row["error"] = repr(exc)
                    traceback.print_exc()
                print(json.dumps(row), flush=True)
                rows.append(row)
        write_results(args.out, meta, rows, args.merge)  # a run cut short keeps its timed rows
        if args.check_tokens:
            # the check runs one packed row of the layer's dims: shapes of equal dims share it
            key = (SHAPES[name][:4], min(args.check_tokens, SHAPES[name][5]))
            if key not in checked:
                checked[key] = accuracy(SHAPES[name], device, dtype, key[1])
            meta["accuracy"][name] = checked[key]
            print(json.dumps({"shape": name, "accuracy": meta["accuracy"][name]}), flush=True)
            write_results(args.out, meta, rows, args.merge)  # and the shape's accuracy


def write_results(out_dir, meta, rows, merge=None):
    """bench_layer.json / .md in out_dir; merge: an earlier bench_layer.json whose rows for other
    (shape, lib, mode) the files keep (e.g. the compile rows of a run on fewer shapes)."""
    if merge:
        with open(merge) as f:
            earlier = json.load(f)
        done = {(r["shape"], r["lib"], r["mode"]) for r in rows}
        kept = [{"measured": earlier["meta"]["date"], **r} for r in earlier["rows"]
                if (r["shape"], r["lib"], r["mode"]) not in done]
        rows = sorted(rows + kept, key=lambda r: (list(SHAPES).index(r["shape"]), r["lib"], r["mode"]))
        meta = {**meta, "accuracy": {**earlier["meta"].get("accuracy", {}), **meta["accuracy"]},
                "runs": runs_with_rows(earlier["meta"], meta, rows, lambda m: {"date": m["date"],
                                                                                "command": m["command"]})}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_layer.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "bench_layer.md"), "w") as f:
        f.write(to_markdown(meta, rows))


if __name__ == "__main__":
    main()
