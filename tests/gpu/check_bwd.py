"""GPU check of the TileLang backward kernels against float64 autograd.

Run on a Hopper GPU:  python tests/gpu/check_bwd.py [--out DIR] [--quick] [--no-bench]
Writes check_bwd.json into DIR (default $OUT, else tests/gpu/results); exits non-zero on a
failure. Each case draws fresh inputs with `flash_qla_cp.testing.make_gdn_inputs` (q, k
l2-normalised, strong-decay and g = 0 heads), a random output gradient and final-state
gradient, runs the backward twice with every buffer it allocates poisoned with NaN, and
compares dq, dk, dv, dg, dbeta, dh0 with float64 autograd through
`chunk_gated_delta_rule_torch` (relative L2 error, no NaN, both runs bitwise equal).
Then it times forward + backward at 1 x 32k tokens, H = 16, HV = 32 (ours and, if it is
importable, FlashQLA's).
"""

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from flash_qla_cp.kernels import tilelang_bwd_impl as bwd  # noqa: E402
from flash_qla_cp.kernels.reference_chunked import chunk_gated_delta_rule_torch  # noqa: E402
from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens, rel_err  # noqa: E402

TOL = 1e-2
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def case_inputs(B, T, H, HV, K, V, dtype, lengths, with_h0, with_dht, seed):
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device="cuda", strong_decay_heads=1, zero_gate_heads=1,
                        generator=gen)
    cu = random_cu_seqlens(lengths, device="cuda") if lengths is not None else None
    N = len(lengths) if lengths is not None else B
    h0 = (0.5 * torch.randn(N, HV, K, V, generator=gen)).cuda() if with_h0 else None
    dht = torch.randn(N, HV, K, V, generator=gen).cuda() if with_dht else None
    do = torch.randn(B, T, HV, V, generator=gen).to(dtype).cuda()
    return x, cu, h0, dht, do


def reference_grads(x, cu, h0, dht, do, scale):
    ins = [x[n].double().detach().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    h0r = h0.double().detach().requires_grad_(True) if h0 is not None else None
    o, ht = chunk_gated_delta_rule_torch(*ins, scale=scale, initial_state=h0r, output_final_state=dht is not None,
                                         cu_seqlens=None if cu is None else cu.long())
    outs, gr = [o], [do.double()]
    if dht is not None:
        outs.append(ht)
        gr.append(dht.double())
    wrt = ins + ([h0r] if h0r is not None else [])
    got = torch.autograd.grad(outs, wrt, gr, allow_unused=True)
    got = [torch.zeros_like(w) if d is None else d for d, w in zip(got, wrt)]
    return got[:5] + [got[5] if h0r is not None else None]


def run_case(name, B, T, H, HV, K, V, dtype, lengths=None, with_h0=True, with_dht=True, state_v_first=False,
             use_fwd_saved=False, seed=0, ref=True, block_v=None, save_states=False, fwd_cfg=None):
    x, cu, h0, dht, do = case_inputs(B, T, H, HV, K, V, dtype, lengths, with_h0, with_dht, seed)
    scale = K**-0.5
    h0_in = h0.transpose(-1, -2).contiguous() if (h0 is not None and state_v_first) else h0
    dht_in = dht.transpose(-1, -2).contiguous() if (dht is not None and state_v_first) else dht
    saved = None
    if use_fwd_saved:
        from flash_qla_cp.kernels.tilelang_fwd import tilelang_chunk_gated_delta_rule_fwd

        if save_states:  # the states the forward keeps must all be written: free memory is NaN
            torch.full(((1 << 30) // 4,), float("nan"), device="cuda")
        _, _, saved = tilelang_chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, h0_in,
                                                           True, cu, state_v_first=state_v_first,
                                                           save_states=save_states, fused_config=fwd_cfg)
        if save_states:
            assert "h_states" in saved and "vres" in saved, "the forward did not keep its states"
    runs = []
    for _ in range(2):
        bwd.POISON_BUFFERS = True
        out = bwd.tilelang_chunk_gated_delta_rule_bwd(do, dht_in, x["q"], x["k"], x["v"], x["g"], x["beta"], scale,
                                                     h0_in, cu, saved, state_v_first=state_v_first,
                                                     block_v=block_v)
        bwd.POISON_BUFFERS = False
        torch.cuda.synchronize()
        runs.append([None if t is None else t.clone() for t in out])
    got, again = runs
    res = {"name": name, "B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V, "dtype": str(dtype),
           "lengths": lengths, "initial_state": with_h0, "dht": with_dht, "state_v_first": state_v_first,
           "fwd_saved": use_fwd_saved, "block_v": block_v, "save_states": save_states}
    res["deterministic"] = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, again))
    res["nondeterministic_outputs"] = [n for n, a, b in zip(NAMES, got, again)
                                       if not ((a is None and b is None) or torch.equal(a, b))]
    if got[5] is not None and state_v_first:
        got[5] = got[5].transpose(-1, -2)
    res["nan"] = any(t is not None and not torch.isfinite(t.float()).all().item() for t in got)
    dtypes_ok = (got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == dtype
                 and got[3].dtype == x["g"].dtype and got[4].dtype == x["beta"].dtype)
    res["dtypes_ok"] = bool(dtypes_ok)
    ok = res["deterministic"] and not res["nan"] and dtypes_ok
    if ref:
        want = reference_grads(x, cu, h0, dht, do, scale)
        errs = {}
        for n, a, e in zip(NAMES, got, want):
            if e is None:
                errs[n] = None if a is None else "unexpected"
                continue
            errs[n] = rel_err(a, e)
        res["rel_err"] = errs
        ok = ok and all(v is None or (isinstance(v, float) and v <= TOL) for v in errs.values())
        if not ok and T <= 4096:
            # diagnose: same backward with G / Ag from torch instead of the forward's prepare kernel
            try:
                Ttot = B * T
                cu_f = cu if cu is not None else torch.arange(B + 1, device="cuda", dtype=torch.int32) * T
                gq, agq = bwd.torch_prepare(x["k"].reshape(1, Ttot, H, K), x["g"].reshape(1, Ttot, HV),
                                            x["beta"].reshape(1, Ttot, HV), cu_f)
                out2 = bwd.tilelang_chunk_gated_delta_rule_bwd(
                    do, dht_in, x["q"], x["k"], x["v"], x["g"], x["beta"], scale, h0_in, cu,
                    {"g_cumsum": gq, "Ag": agq}, state_v_first=state_v_first, block_v=block_v)
                out2 = list(out2)
                if out2[5] is not None and state_v_first:
                    out2[5] = out2[5].transpose(-1, -2)
                res["rel_err_torch_prepare"] = {n: (None if e is None else rel_err(a, e))
                                                for n, a, e in zip(NAMES, out2, want)}
            except Exception as exc:  # pragma: no cover - diagnostics only
                res["diag_error"] = repr(exc)
    res["tol"] = TOL
    res["pass"] = bool(ok)
    return res


CASES = [
    ("dense_bf16_h2hv4_T300_fwdsaved", dict(B=2, T=300, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                            use_fwd_saved=True)),
    ("varlen_bf16_h2hv4_odd", dict(B=1, T=1943, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                   lengths=[1, 63, 64, 65, 200, 517, 1033])),
    ("varlen_bf16_h2hv4_odd_bv64", dict(B=1, T=1943, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                        lengths=[1, 63, 64, 65, 200, 517, 1033], block_v=64, seed=3)),
    ("varlen_bf16_h2hv4_vfirst", dict(B=1, T=333, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                      lengths=[63, 1, 129, 140], state_v_first=True)),
    # the backward reading the chunk states the forward kept (save_states)
    ("dense_bf16_h2hv4_T300_states", dict(B=2, T=300, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                          use_fwd_saved=True, save_states=True, seed=5)),
    ("varlen_bf16_h2hv4_odd_states", dict(B=1, T=1943, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                          lengths=[1, 63, 64, 65, 200, 517, 1033], use_fwd_saved=True,
                                          save_states=True, seed=6)),
    ("varlen_bf16_h2hv4_vfirst_states", dict(B=1, T=333, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                             lengths=[63, 1, 129, 140], state_v_first=True, use_fwd_saved=True,
                                             save_states=True, seed=7)),
    ("varlen_bf16_h16hv32_odd_states", dict(B=1, T=20101, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                            lengths=[5000, 3, 7001, 4000, 4097], with_h0=False, with_dht=False,
                                            use_fwd_saved=True, save_states=True, seed=8)),
    ("varlen_bf16_h2hv4_odd_states_ws4", dict(B=1, T=1943, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                                              lengths=[1, 63, 64, 65, 200, 517, 1033], use_fwd_saved=True,
                                              save_states=True, seed=9,
                                              fwd_cfg={"warp_specialized": True, "four_warpgroups": True,
                                                       "block_v": 128})),
    ("dense_fp16_h2hv4_T1000", dict(B=1, T=1000, H=2, HV=4, K=128, V=128, dtype=torch.float16)),
    ("dense_bf16_k64_T700", dict(B=2, T=700, H=2, HV=4, K=64, V=64, dtype=torch.bfloat16)),
    ("dense_bf16_mha_nostate", dict(B=1, T=777, H=4, HV=4, K=128, V=128, dtype=torch.bfloat16, with_h0=False,
                                    with_dht=False)),
    ("varlen_bf16_h16hv32_odd", dict(B=1, T=20101, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                     lengths=[5000, 3, 7001, 4000, 4097], with_h0=False, with_dht=False)),
    ("dense_bf16_h16hv32_T32k", dict(B=1, T=32768, H=16, HV=32, K=128, V=128, dtype=torch.bfloat16,
                                     with_h0=False, with_dht=False)),
    # K = V = 256: the walks at block_v 32, the per-chunk gradients in torch (chunk_grads_torch)
    ("dense_bf16_k256_T700", dict(B=2, T=700, H=2, HV=4, K=256, V=256, dtype=torch.bfloat16)),
    ("varlen_fp16_k256_odd_fwdsaved", dict(B=1, T=1943, H=2, HV=4, K=256, V=256, dtype=torch.float16,
                                           lengths=[1, 63, 64, 65, 200, 517, 1033], use_fwd_saved=True, seed=12)),
    # one head dim 256, the other 128: the same path (K = 128 takes the warp-specialised walks,
    # and its warp-specialised forward keeps the chunk states that the backward then reads)
    ("varlen_bf16_k128v256_odd_states", dict(B=1, T=1943, H=2, HV=4, K=128, V=256, dtype=torch.bfloat16,
                                             lengths=[1, 63, 64, 65, 200, 517, 1033], use_fwd_saved=True,
                                             save_states=True, seed=13)),
    ("dense_fp16_k256v128_T700", dict(B=2, T=700, H=2, HV=4, K=256, V=128, dtype=torch.float16, seed=14)),
    ("varlen_bf16_k64v256_odd_fwdsaved", dict(B=1, T=1943, H=2, HV=4, K=64, V=256, dtype=torch.bfloat16,
                                              lengths=[1, 63, 64, 65, 200, 517, 1033], use_fwd_saved=True,
                                              seed=15)),
]


def check_v_head_sum():
    """The GVA sum kernel against its torch form, bitwise (odd token counts, groups 2 and 4)."""
    from flash_qla_cp.kernels.tilelang_common import compile_kernel
    from flash_qla_cp.kernels.tilelang_v_head_sum import build_v_head_sum_kernel

    res = {"name": "v_head_sum_kernel_vs_torch", "cases": []}
    for T, H, group, K, dtype in ((20101, 16, 2, 128, torch.bfloat16), (3, 16, 2, 128, torch.bfloat16),
                                  (777, 2, 4, 64, torch.float16)):
        parts = [(4 * torch.randn(T, H, group, K, device="cuda")).to(dtype) for _ in range(2)]
        got = [torch.full((T, H, K), float("nan"), device="cuda", dtype=dtype) for _ in range(2)]
        kern = compile_kernel(build_v_head_sum_kernel, H=H, group=group, K=K, dtype=bwd.tl_dtype(dtype))
        kern(*parts, *got)
        want = [torch.empty_like(g) for g in got]
        for p_, w in zip(parts, want):
            bwd.sum_v_head_parts(p_, w)
        res["cases"].append({"T": T, "H": H, "group": group, "K": K, "dtype": str(dtype),
                             "bitwise": all(torch.equal(a, b) for a, b in zip(got, want))})
    res["pass"] = all(c["bitwise"] for c in res["cases"])
    return res


def specs_for(kw):
    K, V = kw["K"], kw["V"]
    wide = max(K, V) > 128  # the walks at block_v 32, no grad kernel (tilelang_bwd_impl)
    out = bwd.bwd_kernel_specs(kw["H"], kw["HV"], K, V, kw["dtype"], K**-0.5, kw.get("with_h0", True),
                               kw.get("with_dht", True), kw.get("block_v") or (32 if wide else None))
    # wide: the two walks, and the grad kernel sliced over V (--wide-grads kernel)
    out = out[:2] + bwd.wide_grad_kernel_specs(kw["H"], kw["HV"], K, V, kw["dtype"], K**-0.5) if wide else out
    from flash_qla_cp.kernels.tilelang_fwd import build_prepare_kernel, default_fused_config, fwd_kernel_specs

    if kw.get("use_fwd_saved"):  # the tiles the forward picks on an H200 (132 SMs)
        n_seqs = len(kw["lengths"]) if kw.get("lengths") else kw["B"]
        cfg = kw.get("fwd_cfg") or default_fused_config(n_seqs, kw["HV"], V, 132, K=K)
        out += fwd_kernel_specs(kw["H"], kw["HV"], K, V, kw["dtype"], K**-0.5, kw.get("lengths") is not None,
                                kw.get("with_h0", True), True, kw.get("state_v_first", False), **cfg,
                                store_states=kw.get("save_states", False))
    else:
        out.append((build_prepare_kernel, dict(H=kw["H"], HV=kw["HV"], K=K, dtype=bwd.tl_dtype(kw["dtype"]),
                                               is_varlen=True)))
    return out


def peer_errors():
    """Gradient errors of FlashQLA against float64 on a small case with a g = 0 head (context for ours)."""
    from flash_qla.ops.gated_delta_rule import chunk_gated_delta_rule as fq

    out = {}
    for B, T, H, HV in ((1, 1024, 4, 4), (1, 2048, 2, 4)):
        x, cu, h0, dht, do = case_inputs(B, T, H, HV, 128, 128, torch.bfloat16, None, False, False, 11)
        scale = 128**-0.5
        want = reference_grads(x, cu, h0, dht, do, scale)
        ins = [x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        o, _ = fq(*ins, scale=scale)
        o.backward(do)
        theirs = {n: rel_err(t.grad, w) for n, t, w in zip(NAMES, ins, want)}
        ours_t = bwd.tilelang_chunk_gated_delta_rule_bwd(do, None, x["q"], x["k"], x["v"], x["g"], x["beta"], scale,
                                                         None, None, None)
        ours = {n: rel_err(a, w) for n, a, w in zip(NAMES[:5], ours_t[:5], want[:5])}
        out[f"B{B}_T{T}_H{H}_HV{HV}"] = {"flashqla": theirs, "ours": ours}
    return out


def bench(results, budget_s):
    import triton.testing as tt

    from flash_qla_cp.kernels.tilelang_fwd import tilelang_chunk_gated_delta_rule_fwd

    B, T, H, HV, K, V = 1, 32768, 16, 32, 128, 128
    dt = torch.bfloat16
    x, _, _, _, do = case_inputs(B, T, H, HV, K, V, dt, None, False, False, 1)
    scale = K**-0.5
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]

    def fwd():
        return tilelang_chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, False, None)

    o, _, saved = fwd()

    def bwd_only():
        return bwd.tilelang_chunk_gated_delta_rule_bwd(do, None, q, k, v, g, beta, scale, None, None, saved)

    def fwd_bwd():
        _, _, sv = fwd()
        return bwd.tilelang_chunk_gated_delta_rule_bwd(do, None, q, k, v, g, beta, scale, None, None, sv)

    out = {"shape": "B1 T32768 H16 HV32 K128 V128 bf16", "gpu": torch.cuda.get_device_name()}
    out["ours_fwd_ms"] = tt.do_bench(fwd, warmup=50, rep=300, return_mode="median")
    out["ours_bwd_ms"] = tt.do_bench(bwd_only, warmup=50, rep=300, return_mode="median")
    out["ours_fwd_bwd_ms"] = tt.do_bench(fwd_bwd, warmup=50, rep=300, return_mode="median")
    for walk in bwd.WALK_KERNELS:  # both walks serial, then both warp-specialised
        def variant(walk=walk):
            return bwd.tilelang_chunk_gated_delta_rule_bwd(do, None, q, k, v, g, beta, scale, None, None, saved,
                                                           dh_kernel=walk, h_kernel=walk)
        try:
            out[f"ours_bwd_ms_walks_{walk}"] = tt.do_bench(variant, warmup=30, rep=200, return_mode="median")
        except Exception as exc:
            out[f"ours_bwd_ms_walks_{walk}"] = repr(exc)
    # per-kernel split of the backward
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                bwd_only()
            torch.cuda.synchronize()
        per = {}
        for ev in prof.key_averages():
            if ev.device_type is not None and "CUDA" in str(ev.device_type):
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                per[ev.key[:60]] = round(t / 5 / 1000.0, 4)
        out["bwd_kernels_ms"] = dict(sorted(per.items(), key=lambda kv: -kv[1])[:12])
    except Exception as exc:
        out["profile_error"] = repr(exc)
    results["bench"] = out
    print(json.dumps(out), flush=True)
    if time.time() > budget_s:
        results["flashqla"] = "skipped (time)"
        return
    try:
        from flash_qla.ops.gated_delta_rule import chunk_gated_delta_rule as fq

        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        gg, bb = g.detach().clone().requires_grad_(True), beta.detach().clone().requires_grad_(True)

        def fq_fwd_bwd():
            o2, _ = fq(qq, kk, vv, gg, bb, scale=scale)
            o2.backward(do)

        def fq_fwd():
            with torch.no_grad():
                return fq(q, k, v, g, beta, scale=scale)

        fq_fwd_bwd()
        fqr = {"flashqla_fwd_ms": tt.do_bench(fq_fwd, warmup=50, rep=300, return_mode="median"),
               "flashqla_fwd_bwd_ms": tt.do_bench(fq_fwd_bwd, warmup=50, rep=300, return_mode="median")}
        # same-input agreement of the gradients (sanity); clear what the timing loop accumulated
        for t in (qq, kk, vv, gg, bb):
            t.grad = None
        fq_fwd_bwd()
        ref = bwd.tilelang_chunk_gated_delta_rule_bwd(do, None, q, k, v, g, beta, scale, None, None, saved)
        fqr["dq_rel_vs_flashqla"] = rel_err(ref[0], qq.grad)
        fqr["dg_rel_vs_flashqla"] = rel_err(ref[3], gg.grad)
        results["flashqla"] = fqr
        print(json.dumps(fqr), flush=True)
        results["peer_errors"] = peer_errors()
        print(json.dumps(results["peer_errors"]), flush=True)
    except Exception as exc:
        results["flashqla"] = {"error": repr(exc), "tb": traceback.format_exc()[-2000:]}
        print("flashqla failed:", repr(exc), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--quick", action="store_true", help="only the first three cases")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--bench-only", action="store_true", help="skip the correctness cases")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which optional parts are skipped")
    ap.add_argument("--dh-kernel", default=None, choices=bwd.WALK_KERNELS, help="the dh walk the checks use")
    ap.add_argument("--h-kernel", default=None, choices=bwd.WALK_KERNELS, help="the h walk the checks use")
    ap.add_argument("--fused-walk", default=None, choices=("auto", "on", "off"),
                    help="dh walk + grad kernel as one fused walk: where it fills the GPU, always, never")
    ap.add_argument("--wide-grads", default=None, choices=("torch", "kernel"),
                    help="per-chunk gradients of head dims past 128: torch ops or the V-sliced kernel")
    ap.add_argument("--cases", default=None, help="comma-separated case names: run only those")
    args = ap.parse_args()
    if args.wide_grads:
        bwd.WIDE_GRADS = args.wide_grads
    if args.dh_kernel:
        bwd.DEFAULT_DH_KERNEL = args.dh_kernel
    if args.h_kernel:
        bwd.DEFAULT_H_KERNEL = args.h_kernel
    if args.fused_walk:
        bwd.FUSED_WALK = args.fused_walk
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    cases = CASES[:3] if args.quick else CASES
    # --cases=a,b runs only those
    if args.cases:
        cases = [c for c in CASES if c[0] in args.cases.split(",")]
    if args.bench_only:
        cases = []

    from flash_qla_cp.kernels.tilelang_common import precompile

    specs = []
    for _, kw in cases:
        specs += specs_for(kw)
    if not args.no_bench:
        from flash_qla_cp.kernels.tilelang_fwd import fwd_kernel_specs

        specs += bwd.bwd_kernel_specs(16, 32, 128, 128, torch.bfloat16, 128**-0.5, False, False)
        for walk in bwd.WALK_KERNELS:
            specs += bwd.bwd_kernel_specs(16, 32, 128, 128, torch.bfloat16, 128**-0.5, False, False,
                                          dh_kernel=walk, h_kernel=walk)
        for hh, hv in ((4, 4), (2, 4)):
            specs += bwd.bwd_kernel_specs(hh, hv, 128, 128, torch.bfloat16, 128**-0.5, False, False)
            from flash_qla_cp.kernels.tilelang_fwd import build_prepare_kernel
            specs.append((build_prepare_kernel, dict(H=hh, HV=hv, K=128, dtype="bfloat16", is_varlen=True)))
        specs += fwd_kernel_specs(16, 32, 128, 128, torch.bfloat16, 128**-0.5, False, False, False)
    try:
        n = precompile(specs, num_workers=16)
        print(f"precompiled {n} kernels in {time.time() - start:.1f}s", flush=True)
    except Exception:
        traceback.print_exc()

    summary = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "results": []}

    def dump():
        with open(os.path.join(args.out, "bench_bwd.json" if args.bench_only else "check_bwd.json"), "w") as f:
            json.dump(summary, f, indent=1)

    if any(kw["HV"] > kw["H"] for _, kw in cases):
        summary["v_head_sum"] = check_v_head_sum()
        print(json.dumps(summary["v_head_sum"]), flush=True)
    for name, kw in cases:
        t1 = time.time()
        try:
            r = run_case(name, **kw)
        except Exception as exc:
            r = {"name": name, "pass": False, "error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
        r["seconds"] = round(time.time() - t1, 2)
        summary["results"].append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
        dump()
    summary["all_pass"] = (all(r["pass"] for r in summary["results"])
                           and summary.get("v_head_sum", {"pass": True})["pass"])
    dump()
    # timing is meaningful as long as the kernels write finite, deterministic results
    sane = all(r.get("deterministic") and not r.get("nan") for r in summary["results"])
    if not args.no_bench and sane:
        try:
            bench(summary, start + args.budget)
        except Exception as exc:
            summary["bench_error"] = repr(exc)
            traceback.print_exc()
        dump()
    print("ALL PASS" if summary["all_pass"] else "FAILURES", f"({time.time() - start:.0f}s)", flush=True)
    return 0 if summary["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
