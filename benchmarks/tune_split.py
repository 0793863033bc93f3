"""Sweep the intra-card split (partitions per sequence) of the TileLang kernels on one GPU.

For each shape and P in --parts: forward time (kernels called directly) and forward+backward
time (the public op, TileLang backward), do_bench medians. P = 1 is the unsplit path; 'auto'
is what `kernels/tilelang_split.auto_partitions` picks. Writes tune_split.json under --out.

    python benchmarks/tune_split.py --shapes tp8_1x32k --parts 1,4,16,auto

--fwd-block-v 16,32,64 adds forward times with the warp-specialised fused kernel at each of
those V tiles (fwd_ms_bv<N>) next to the default tile's, to tune `default_fused_config` and
the split's grid rule together. --split-h-kernels serial,ws times forward+backward once per h
walk the split backward may take (fwdbwd_ms_h<kind>; `SPLIT_H_KERNEL` in tilelang_bwd_impl).
--graphs adds fwd_graph_ms / fwdbwd_graph_ms: the same calls replayed from a CUDA graph, i.e.
the GPU time without the host's launch cost (what a step pays when the host runs ahead).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import graphed, shape_inputs  # noqa: E402

from flash_qla_cp import chunk_gated_delta_rule  # noqa: E402
from flash_qla_cp.kernels import tilelang_bwd_impl as bwd_impl  # noqa: E402
from flash_qla_cp.kernels.tilelang_fwd import switches as fwd_switch  # noqa: E402
from flash_qla_cp.kernels.tilelang_fwd import tilelang_chunk_gated_delta_rule_fwd  # noqa: E402
from flash_qla_cp.ops import tilelang_backward_enabled  # noqa: E402


def time_replay(fn, rep):
    """do_bench median of `fn` replayed from a CUDA graph, or why it could not be captured."""
    import triton.testing

    replay = graphed(fn)
    return replay if isinstance(replay, str) else triton.testing.do_bench(replay, rep=rep, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tp8_1x32k,tp8_1x128k,tp1_1x8k,tp1_1x32k")
    ap.add_argument("--parts", default="1,2,4,8,16,32,auto")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--fwd-block-v", default="", help="comma list of ws block_v tiles to time the forward at")
    ap.add_argument("--fwd-ws4", action="store_true",
                    help="also time fwd and fwd+bwd with the four-warpgroup forward (FOUR_WARPGROUPS on)")
    ap.add_argument("--split-h-kernels", default="", help="comma list of h walks for the split backward")
    ap.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays of fwd and fwd+bwd")
    ap.add_argument("--fused-walk", action="store_true",
                    help="also time fwd+bwd with the fused dh + grad walk always on and always off "
                         "(fwdbwd_ms_walk_on / _off; fwdbwd_ms is FUSED_WALK's default, auto)")
    ap.add_argument("--rep", type=int, default=60)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    import triton.testing

    assert tilelang_backward_enabled() or args.no_bwd, "unset FLASH_QLA_CP_TILELANG_BWD=0 (or pass --no-bwd)"
    os.makedirs(args.out, exist_ok=True)
    rows = []
    meta = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "timing": "triton.testing.do_bench median"}
    for sname in args.shapes.split(","):
        q, k, v, g, beta, cu = shape_inputs(sname)
        cu = None if cu is None else cu.to("cuda", torch.int32)
        do = torch.randn_like(v)
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        for p in args.parts.split(","):
            parts = p if p == "auto" else int(p)
            row = {"shape": sname, "parts": p}
            try:
                def fwd():
                    return tilelang_chunk_gated_delta_rule_fwd(q, k, v, g, beta, None, None, True, cu,
                                                               partitions=parts)

                saved = fwd()[2]
                row["parts_used"] = saved["partitions"]
                row["backward_split"] = "split" in saved
                row["fwd_ms"] = triton.testing.do_bench(fwd, rep=args.rep, return_mode="median")
                if args.graphs:
                    row["fwd_graph_ms"] = time_replay(fwd, args.rep)
                for bv in filter(None, args.fwd_block_v.split(",")):
                    cfg = {"warp_specialized": True, "block_v": int(bv)}

                    def fwd_tile():
                        return tilelang_chunk_gated_delta_rule_fwd(q, k, v, g, beta, None, None, True, cu,
                                                                   partitions=parts, fused_config=cfg)

                    row[f"fwd_ms_bv{bv}"] = triton.testing.do_bench(fwd_tile, rep=args.rep, return_mode="median")
                if args.fwd_ws4:
                    with fwd_switch(FOUR_WARPGROUPS=True):
                        row["fwd_ms_ws4"] = triton.testing.do_bench(fwd, rep=args.rep, return_mode="median")
                if not args.no_bwd:
                    def fwdbwd():
                        o, _ = chunk_gated_delta_rule(*ins, cu_seqlens=cu, backend="tilelang", intra_cp=parts)
                        for t in ins:  # written, not accumulated (as bench_kernels.py)
                            t.grad = None
                        o.backward(do)

                    def bench(fn):
                        return triton.testing.do_bench(fn, rep=args.rep, return_mode="median")

                    row["fwdbwd_ms"] = bench(fwdbwd)
                    if args.graphs:
                        row["fwdbwd_graph_ms"] = time_replay(fwdbwd, args.rep)
                    if args.fwd_ws4:
                        with fwd_switch(FOUR_WARPGROUPS=True):
                            row["fwdbwd_ms_ws4"] = bench(fwdbwd)
                    for mode in ("on", "off") if args.fused_walk else ():
                        with bwd_impl.switches(FUSED_WALK=mode):
                            row[f"fwdbwd_ms_walk_{mode}"] = bench(fwdbwd)
                    for kind in filter(None, args.split_h_kernels.split(",")):
                        with bwd_impl.switches(SPLIT_H_KERNEL=kind):
                            row[f"fwdbwd_ms_h{kind}"] = bench(fwdbwd)
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:400]
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "tune_split.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        del q, k, v, g, beta, ins
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
