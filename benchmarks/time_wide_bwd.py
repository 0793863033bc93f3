"""Forward + backward time at head dims past 128 (K = V = 256), the two backward paths side by side:
the TileLang one (the two walks in TileLang, the per-chunk gradients in torch: the default) and
the torch backward (FLASH_QLA_CP_TILELANG_BWD=0), after the same TileLang forward. Same inputs,
same call, the public op; triton.testing.do_bench medians. Optionally FlashQLA on the same inputs
(0.1.3 refuses K = 256).

    python benchmarks/time_wide_bwd.py --out DIR [--lengths 16384,16384] [--peers]

The configuration (bf16, H = 2, HV = 4, varlen with an initial and a final state) is check_split's
wide_k256_auto case, so the kernels precompiled for that check serve here too.
"""

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import make_inputs  # noqa: E402

from flash_qla_cp import chunk_gated_delta_rule  # noqa: E402
from flash_qla_cp.kernels import tilelang_bwd_impl  # noqa: E402
from flash_qla_cp.ops import TILELANG_BWD_ENV  # noqa: E402


def inputs(lengths, H, HV, D, seed=0):
    """bench_kernels' inputs for the packed sequences, an initial state per sequence, cu_seqlens."""
    q, k, v, g, beta = make_inputs(1, sum(lengths), H, HV, D, D, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    h0 = torch.randn(len(lengths), HV, D, D, device="cuda", generator=gen) * 0.1
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return dict(q=q, k=k, v=v, g=g, beta=beta), h0, cu


def fwd_bwd_fn(x, h0, do, dht, call):
    def step():
        ins = {n: t.detach().requires_grad_(True) for n, t in x.items()}
        h = h0.detach().requires_grad_(True)
        o, final = call(ins, h)
        torch.autograd.backward((o, final), (do, dht))
        return [ins[n].grad for n in ins] + [h.grad]

    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="16384,16384")
    ap.add_argument("--heads", default="2,4", help="H,HV")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--peers", action="store_true", help="also FlashQLA (compiles its kernels; may refuse)")
    ap.add_argument("--profile", action="store_true", help="print the TileLang path's GPU time per kernel")
    ap.add_argument("--wide-kernel", action="store_true",
                    help="also the V-sliced grad kernel in place of the torch per-chunk gradients")
    args = ap.parse_args()
    import triton
    import triton.testing as tt

    lengths = [int(n) for n in args.lengths.split(",")]
    H, HV = (int(n) for n in args.heads.split(","))
    x, h0, cu = inputs(lengths, H, HV, args.dim)
    cu_dev = cu.cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(x["v"].shape, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(h0.shape, device="cuda", generator=gen) * 0.1

    def ours(ins, h):
        return chunk_gated_delta_rule(**ins, initial_state=h, output_final_state=True, cu_seqlens=cu_dev,
                                      cu_seqlens_cpu=cu, backend="tilelang")

    rows, grads = {}, {}
    paths = [("torch_bwd", "0", "torch"), ("tilelang_walks", "1", "torch")]
    if args.wide_kernel:
        paths.append(("tilelang_walks_grad_kernel", "1", "kernel"))
    for name, tilelang_bwd, wide_grads in paths:
        os.environ[TILELANG_BWD_ENV] = tilelang_bwd  # read at every backward call
        tilelang_bwd_impl.WIDE_GRADS = wide_grads
        step = fwd_bwd_fn(x, h0, do, dht, ours)
        grads[name] = [t.float() for t in step()]
        ms = tt.do_bench(step, warmup=50, rep=300, return_mode="median")
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        rows[name] = {"fwd_bwd_ms": round(ms, 3), "peak_gib": round(peak, 2)}
        print(json.dumps({"path": name, **rows[name]}), flush=True)
    os.environ[TILELANG_BWD_ENV] = "1"
    tilelang_bwd_impl.WIDE_GRADS = "kernel" if args.wide_kernel else "torch"
    if args.profile:  # where the TileLang path's time goes: walks, per-chunk torch ops, forward
        from torch.profiler import ProfilerActivity, profile

        step = fwd_bwd_fn(x, h0, do, dht, ours)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        print(table, flush=True)
        rows["profile_top"] = table
    # the two paths compute the same gradients (both against bf16 rounding of the same forward)
    diff = {f"{path} vs torch_bwd": {
        n: round(float((a - b).norm() / b.norm().clamp_min(1e-30)), 6)
        for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads[path], grads["torch_bwd"])}
        for path in grads if path != "torch_bwd"}
    print(json.dumps({"rel_diff_between_paths": diff}), flush=True)

    if args.peers:
        try:
            from flash_qla.ops.gated_delta_rule import chunk_gated_delta_rule as fq

            def peer(ins, h):
                return fq(**ins, initial_state=h, output_final_state=True, cu_seqlens=cu_dev.to(torch.int32))

            step = fwd_bwd_fn(x, h0, do, dht, peer)
            step()
            rows["flashqla"] = {"fwd_bwd_ms": round(tt.do_bench(step, warmup=50, rep=300, return_mode="median"), 3)}
        except Exception as exc:  # noqa: BLE001  (a refusal is a result: report it)
            rows["flashqla"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps({"path": "flashqla", **rows["flashqla"]}), flush=True)

    os.makedirs(args.out, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "lengths": lengths, "H": H, "HV": HV,
            "K": args.dim, "V": args.dim, "dtype": "bf16", "timing": "triton.testing.do_bench median, eager"}
    with open(os.path.join(args.out, "time_wide_bwd.json"), "w") as f:
        json.dump({**meta, "rows": rows, "rel_diff_between_paths": diff}, f, indent=1)


if __name__ == "__main__":
    main()
