"""Inference with a cache, side by side: our GatedDeltaNet on its fused layer (`ours`: the cache's
conv state enters as rows in front of each sequence), ours on its step-by-step path (`ours_steps`:
torch conv, gates, a one-token recurrence and norm around the op), and FLA's `GatedDeltaNet` (its
default dispatch; under no_grad inputs of up to 64 tokens take its fused recurrent kernel), in one
process on the same input, Qwen3-Next's layer dims unless told otherwise.

    python benchmarks/bench_decode.py [--batches 1,8,64] [--prompt 2048] [--libs ours,ours_steps,fla] [--graphs]

For each batch size (sequences decoded together): the median ms of a prompt's prefill (--prompt
tokens per sequence, the cache out) and of one decoding step (one token per sequence, the cache in
and out), both under no_grad, with --graphs also of the step replayed from a CUDA graph (no host
launch cost; or why it cannot be captured), and our fused output's relative error against the
step path's over the prefill and a step. Writes bench_decode.json / .md into --out (default $OUT, else
benchmarks/results). `--device cpu --hidden 64 --heads 2 --v-heads 4 --head-dim 16 --batches 2
--prompt 32 --libs ours,ours_steps` runs on a CPU (the torch backend) as a smoke test.
"""

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))

from bench_layer import make_layer, median_ms, versions  # noqa: E402

from flash_qla_cp.testing import cuda_graph_replay, rel_err  # noqa: E402


class OneLayerCache:
    """What FLA's layer reads and writes of a cache (`past_key_values[i]`, `len`, `update`), without
    transformers, which FLA's own cache classes build on."""

    def __init__(self):
        self.layers = []

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, index):
        return self.layers[index]

    def update(self, layer_idx, offset=0, **state):
        if layer_idx == len(self.layers):
            self.layers.append({})
        self.layers[layer_idx].update(state)
        return self.layers[layer_idx]


def decode_row(lib, dims, batch, prompt_len, device, dtype, graphs=False):
    hidden, H, HV, D = dims
    layer = make_layer(lib, hidden, H, HV, D, device, dtype).eval()
    gen = torch.Generator(device=device).manual_seed(1)
    prompt = torch.randn(batch, prompt_len, hidden, device=device, dtype=dtype, generator=gen)
    token = torch.randn(batch, 1, hidden, device=device, dtype=dtype, generator=gen)
    if lib == "fla":
        layer.layer_idx = 0

        def prefill():
            cache = OneLayerCache()
            out = layer(prompt, past_key_values=cache, use_cache=True)[0]
            return out, cache

        def step(cache):
            return layer(token, past_key_values=cache, use_cache=True)[0]
    else:
        def prefill():
            return layer(prompt, use_cache=True)

        def step(cache):
            return layer(token, cache=cache, use_cache=True)[0]

    with torch.no_grad():
        out, cache = prefill()
        row = {"prefill_ms": round(median_ms(prefill, device), 3)}
        # FLA's cache moves on with each step; ours hands a new cache back (the same step each time)
        row["step_ms"] = round(median_ms(lambda: step(cache), device), 3)
        if graphs and device.type == "cuda":
            replay = cuda_graph_replay(lambda: step(cache))
            if isinstance(replay, str):
                row["step_graph_error"] = replay
            else:
                row["step_graph_ms"] = round(median_ms(replay, device), 3)
        _, cache = prefill()
        after = step(cache)
    return row, torch.cat([out[:, -8:], after], dim=1).float()


def to_markdown(meta, rows):
    lines = [f"# Decode benchmark — {meta['gpu']}, {meta['date']}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
             f"Command: `{meta['command']}`", "",
             f"Layer dims (hidden, qk heads, v heads, head dim): {meta['dims']}, {meta['dtype']}; a prompt of "
             f"{meta['prompt']} tokens per sequence. Median ms under no_grad (do_bench on a GPU): the prompt's "
             "prefill with the cache out, and one decoding step (a token per sequence, the cache in and out). "
             "`err vs steps`: our fused layer's output (the prompt's last 8 tokens and a step) against our step "
             "path's, relative L2.", "",
             "| batch | lib | prefill ms | step ms | step ms, CUDA graph | err vs steps | note |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        note = (r.get("error", "") or r.get("step_graph_error", ""))[:120]
        lines.append(f"| {r['batch']} | {r['lib']} | {r.get('prefill_ms', '-')} | {r.get('step_ms', '-')} | "
                     f"{r.get('step_graph_ms', '-')} | {r.get('err_vs_steps', '-')} | {note} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens per sequence")
    ap.add_argument("--libs", default="ours,ours_steps,fla")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--graphs", action="store_true", help="also time the decoding step replayed from a CUDA graph")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dims = (args.hidden, args.heads, args.v_heads, args.head_dim)
    meta = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join(["python", "benchmarks/bench_decode.py", *sys.argv[1:]]), "versions": versions(),
            "dims": dims, "dtype": str(dtype).replace("torch.", ""), "prompt": args.prompt}
    rows = []
    for batch in map(int, args.batches.split(",")):
        outputs = {}
        for lib in args.libs.split(","):
            row = {"batch": batch, "lib": lib}
            try:
                timing, outputs[lib] = decode_row(lib, dims, batch, args.prompt, device, dtype, args.graphs)
                row.update(timing)
            except Exception as exc:  # noqa: BLE001 - a library that fails is reported, the rest still run
                row["error"] = repr(exc)
                traceback.print_exc()
            rows.append(row)
        if "ours" in outputs and "ours_steps" in outputs:
            next(r for r in rows if r["batch"] == batch and r["lib"] == "ours")["err_vs_steps"] = \
                f"{rel_err(outputs['ours'], outputs['ours_steps']):.1e}"
        for r in rows:
            if r["batch"] == batch:
                print(json.dumps(r), flush=True)
        os.makedirs(args.out, exist_ok=True)  # after every batch size: a run cut short keeps its rows
        with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "bench_decode.md"), "w") as f:
            f.write(to_markdown(meta, rows))


if __name__ == "__main__":
    main()
