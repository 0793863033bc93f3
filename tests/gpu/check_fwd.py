"""GPU check of the TileLang forward kernels against the float64 references.

Run on a Hopper GPU:  python tests/gpu/check_fwd.py [--out DIR] [--quick]
Writes check_fwd.json into DIR (default $OUT, else tests/gpu/results) and exits non-zero on
any failure. Each case: fresh random inputs (q, k l2-normalised, g = -exp(A) softplus(x) with
strong-decay heads and g = 0 heads, beta = sigmoid), outputs poisoned with NaN beforehand
(the caching allocator hands back NaN-filled memory), relative L2 error of o and of the final
state against float64, no NaN, and two runs bit-identical.
"""

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from flash_qla_cp.kernels.tilelang_common import precompile  # noqa: E402
from flash_qla_cp.kernels.tilelang_fwd import (  # noqa: E402
    default_fused_config,
    fwd_kernel_specs,
    tilelang_chunk_gated_delta_rule_fwd,
)

TOL = {torch.bfloat16: 5e-3, torch.float16: 5e-3}


def make_inputs(B, T, H, HV, K, V, dtype, seed, with_h0, N=None, sdims_v_first=False, device="cuda"):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(rnd(B, T, H, K), dim=-1)
    k = F.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, HV, V)
    # per-head decay rate: a few strong-decay heads, a few heads with g == 0, the rest mild
    a = torch.linspace(-4.0, 1.5, HV)
    a[0] = 2.5  # strong decay: g ~ -12 per token at times
    rate = torch.exp(a)
    if HV >= 4:
        rate[1] = 0.0  # g == 0 head: no decay at all
    x = rnd(B, T, HV) + 0.5
    g = -rate * F.softplus(x)
    beta = torch.sigmoid(rnd(B, T, HV))
    n_states = N if N is not None else B
    h0 = None
    if with_h0:
        h0 = 0.5 * rnd(n_states, HV, K, V)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return (to(q), to(k), to(v), g.to(device), beta.to(device), h0.to(device) if h0 is not None else None)


def poison(nbytes=1 << 28):
    """Fill the allocator's free blocks with NaN so that fresh torch.empty outputs start as NaN."""
    x = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del x


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_case(name, B, T, H, HV, K, V, dtype, cu=None, with_h0=True, final=True, state_v_first=False, ref="chunked", seed=0,
             cfg=None):
    from flash_qla_cp.kernels.reference_chunked import chunk_gated_delta_rule_torch
    from flash_qla_cp.kernels.reference_recurrent import naive_recurrent_gated_delta_rule

    N = len(cu) - 1 if cu is not None else B
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, K, V, dtype, seed, with_h0, N=N)
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda") if cu is not None else None
    scale = K**-0.5
    h0_in = None
    if h0 is not None:
        h0_in = h0.transpose(-1, -2).contiguous() if state_v_first else h0.contiguous()

    outs = []
    for _ in range(2):
        poison()
        torch.cuda.synchronize()
        o, ht, saved = tilelang_chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, scale=scale, initial_state=h0_in, output_final_state=final,
            cu_seqlens=cu_t, state_v_first=state_v_first, fused_config=cfg,
        )
        torch.cuda.synchronize()
        outs.append((o.clone(), None if ht is None else ht.clone()))
    (o, ht), (o2, ht2) = outs
    if ht is not None and state_v_first:
        ht = ht.transpose(-1, -2)
        ht2 = ht2.transpose(-1, -2)

    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    fn = naive_recurrent_gated_delta_rule if ref == "recurrent" else chunk_gated_delta_rule_torch
    ro, rht = fn(
        f64(q), f64(k), f64(v), f64(g), f64(beta), scale=scale, initial_state=f64(h0),
        output_final_state=final, cu_seqlens=None if cu is None else cu_t.long(),
    )
    res = {
        "name": name, "B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V, "dtype": str(dtype),
        "cu_seqlens": cu, "initial_state": with_h0, "state_v_first": state_v_first, "reference": ref,
        "fused_config": cfg,
        "o_rel_err": rel(o, ro),
        "o_nan": bool(torch.isnan(o).any().item()),
        "deterministic": bool(torch.equal(o, o2) and (ht is None or torch.equal(ht, ht2))),
    }
    if final:
        res["ht_rel_err"] = rel(ht, rht)
        res["ht_nan"] = bool(torch.isnan(ht).any().item())
    tol = TOL[dtype]
    res["tol"] = tol
    res["pass"] = (
        res["o_rel_err"] <= tol and not res["o_nan"] and res["deterministic"]
        and (not final or (res["ht_rel_err"] <= tol and not res["ht_nan"]))
    )
    if cfg and cfg.get("four_warpgroups"):  # same arithmetic as the three-warpgroup kernel: recorded
        three = {key: val for key, val in cfg.items() if key not in ("four_warpgroups", "o_tma")}
        o3, ht3, _ = tilelang_chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, scale=scale, initial_state=h0_in, output_final_state=final,
            cu_seqlens=cu_t, state_v_first=state_v_first, fused_config=three,
        )
        if ht3 is not None and state_v_first:
            ht3 = ht3.transpose(-1, -2)
        res["bitwise_vs_three_warpgroups"] = bool(torch.equal(o, o3) and (ht is None or torch.equal(ht, ht3)))
    return res


CASES = [
    # name, kwargs
    ("dense_bf16_h2hv4_T300_recurrent", dict(B=2, T=300, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, ref="recurrent")),
    ("varlen_bf16_h16hv32_odd", dict(B=1, T=1000, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                      cu=[0, 1, 65, 200, 777, 1000])),
    ("varlen_bf16_h2hv4_vfirst_recurrent", dict(B=1, T=333, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                                 cu=[0, 63, 64, 129, 333], state_v_first=True, ref="recurrent")),
    ("dense_fp16_h2hv4_T256_noh0", dict(B=1, T=256, H=2, HV=4, K=128, V=128, dtype=torch.float16, with_h0=False)),
    ("dense_bf16_k64_h2hv4_T500", dict(B=2, T=500, H=2, HV=4, K=64, V=64, dtype=torch.bfloat16)),
    ("dense_bf16_h16hv32_T8192", dict(B=1, T=8192, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16)),
    ("varlen_fp16_h16hv32_long", dict(B=1, T=9000, H=16, HV=32, K=128, V=128, dtype=torch.float16,
                                       cu=[0, 4097, 4100, 9000])),
    # explicit tile variants of the fused kernel (the default picks one by occupancy)
    ("variant_bv16", dict(B=1, T=1000, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, cu=[0, 1, 65, 200, 777, 1000],
                          cfg={"block_v": 16})),
    ("variant_bv32_t256", dict(B=1, T=1000, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                               cu=[0, 1, 65, 200, 777, 1000], cfg={"block_v": 32, "threads": 256})),
    ("variant_bv64_t256", dict(B=1, T=1000, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                               cu=[0, 1, 65, 200, 777, 1000], cfg={"block_v": 64, "threads": 256})),
    ("variant_bv64_osmem_sync", dict(B=2, T=300, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                     cfg={"block_v": 64, "o_store_smem": True, "async_mma": False})),
    # the warp-specialised kernel (tilelang_fwd_ws.py)
    ("ws_bv64_varlen_odd", dict(B=1, T=1000, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                cu=[0, 1, 65, 200, 777, 1000], cfg={"warp_specialized": True, "block_v": 64})),
    ("ws_bv32_varlen_vfirst_recurrent", dict(B=1, T=333, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                             cu=[0, 63, 64, 129, 333], state_v_first=True, ref="recurrent",
                                             cfg={"warp_specialized": True, "block_v": 32})),
    ("ws_bv16_dense_fp16_noh0", dict(B=1, T=256, H=2, HV=4, K=128, V=128, dtype=torch.float16, with_h0=False,
                                     cfg={"warp_specialized": True, "block_v": 16})),
    ("ws_bv64_dense_k64", dict(B=2, T=500, H=2, HV=4, K=64, V=64, dtype=torch.bfloat16,
                               cfg={"warp_specialized": True, "block_v": 64})),
    ("ws_bv64_dense_T8192", dict(B=1, T=8192, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                 cfg={"warp_specialized": True, "block_v": 64})),
    ("ws_bv128_varlen_odd", dict(B=1, T=1000, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                 cu=[0, 1, 65, 200, 777, 1000],
                                 cfg={"warp_specialized": True, "block_v": 128})),
    # the four-warpgroup kernel (tilelang_fwd_ws4.py)
    ("ws4_bv128_varlen_odd", dict(B=1, T=1000, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                  cu=[0, 1, 65, 200, 777, 1000],
                                  cfg={"warp_specialized": True, "four_warpgroups": True, "block_v": 128})),
    ("ws4_bv128_varlen_vfirst_recurrent", dict(B=1, T=333, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                               cu=[0, 63, 64, 129, 333], state_v_first=True, ref="recurrent",
                                               cfg={"warp_specialized": True, "four_warpgroups": True,
                                                    "block_v": 128})),
    ("ws4_bv64_dense_fp16_noh0", dict(B=1, T=256, H=2, HV=4, K=128, V=128, dtype=torch.float16, with_h0=False,
                                      cfg={"warp_specialized": True, "four_warpgroups": True, "block_v": 64})),
    ("ws4_bv64_dense_k64", dict(B=2, T=500, H=2, HV=4, K=64, V=64, dtype=torch.bfloat16,
                                cfg={"warp_specialized": True, "four_warpgroups": True, "block_v": 64})),
    ("ws4_bv128_dense_T8192", dict(B=1, T=8192, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                   cfg={"warp_specialized": True, "four_warpgroups": True, "block_v": 128})),
    # ... with o stored through shared memory by TMA (whole chunks; a partial chunk by fragments)
    ("ws4otma_bv128_varlen_odd", dict(B=1, T=1000, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                      cu=[0, 1, 65, 200, 777, 1000],
                                      cfg={"warp_specialized": True, "four_warpgroups": True, "block_v": 128,
                                           "o_tma": True})),
    ("ws4otma_bv128_dense_T8192", dict(B=1, T=8192, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                       cfg={"warp_specialized": True, "four_warpgroups": True, "block_v": 128,
                                            "o_tma": True})),
    ("ws_bv64_stages3_varlen_odd", dict(B=1, T=1000, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                        cu=[0, 1, 65, 200, 777, 1000],
                                        cfg={"warp_specialized": True, "block_v": 64, "num_stages": 3})),
    # K = V = 256 (the single-warpgroup kernel: the warp-specialised ring does not fit); not in --quick
    ("dense_bf16_k256_h2hv4_T500", dict(B=2, T=500, H=2, HV=4, K=256, V=256, dtype=torch.bfloat16)),
    ("varlen_fp16_k256_h2hv4_odd", dict(B=1, T=1000, H=2, HV=4, K=256, V=256, dtype=torch.float16,
                                        cu=[0, 1, 65, 200, 777, 1000], state_v_first=True, ref="recurrent")),
    # one head dim 256, the other 128 (K <= 128: the warp-specialised kernels at V = 256)
    ("varlen_bf16_k128v256_h16hv32", dict(B=1, T=1000, H=16, HV=32, K=128, V=256, dtype=torch.bfloat16,
                                          cu=[0, 1, 65, 200, 777, 1000])),
    ("dense_bf16_k128v256_h2hv4", dict(B=1, T=700, H=2, HV=4, K=128, V=256, dtype=torch.bfloat16)),
    ("dense_bf16_k256v128_h2hv4", dict(B=2, T=300, H=2, HV=4, K=256, V=128, dtype=torch.bfloat16,
                                       ref="recurrent")),
    ("varlen_bf16_k64v256_h2hv4", dict(B=1, T=1000, H=2, HV=4, K=64, V=256, dtype=torch.bfloat16,
                                       cu=[0, 1, 65, 200, 777, 1000])),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--quick", action="store_true", help="only the short cases")
    ap.add_argument("--match", default=None, help="only the cases whose name contains this")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cases = [c for c in CASES[:3] + CASES[7:] if max(c[1]["K"], c[1]["V"]) <= 128] if args.quick else CASES
    if args.match:
        cases = [c for c in CASES if args.match in c[0]]

    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    specs = []
    for _, kw in cases:
        K, V = kw["K"], kw["V"]
        n_seqs = len(kw["cu"]) - 1 if kw.get("cu") is not None else kw["B"]
        cfg = kw.get("cfg") or default_fused_config(n_seqs, kw["HV"], V, sms, K=K)
        specs += fwd_kernel_specs(
            kw["H"], kw["HV"], K, V, kw["dtype"], K**-0.5, kw.get("cu") is not None, kw.get("with_h0", True),
            True, kw.get("state_v_first", False), **cfg,
        )
    try:
        n = precompile(specs)
        print(f"precompiled {n} kernels in {time.time() - t0:.1f}s", flush=True)
    except Exception:
        traceback.print_exc()
    results = []
    for name, kw in cases:
        t1 = time.time()
        try:
            r = run_case(name, **kw)
        except Exception as exc:
            r = {"name": name, "pass": False, "error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
        r["seconds"] = round(time.time() - t1, 2)
        results.append(r)
        print(json.dumps(r), flush=True)
    summary = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "all_pass": all(r["pass"] for r in results),
        "results": results,
    }
    with open(os.path.join(args.out, "check_fwd.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("ALL PASS" if summary["all_pass"] else "FAILURES", flush=True)
    return 0 if summary["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
