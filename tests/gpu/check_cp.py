"""GPU check of the CP paths on one Hopper card (TileLang kernels inside).

A: intra-card CP (exact and shortcut) vs the plain op and a float64 reference.
B: inter-card CP with 2 processes sharing the GPU over gloo (multi-GPU NCCL runs need a
   bigger machine), TileLang as the local engine, vs the single-process op.
Every float64 reference runs on the inputs rounded as the bf16 runs see them; each result must
be finite and within the limits (o and final state 5e-3, gradients 1e-2). Prints one JSON line
per check with its verdict and exits non-zero on a failure.
"""

import datetime
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from flash_qla_cp import chunk_gated_delta_rule  # noqa: E402
from flash_qla_cp.parallel import CPContext  # noqa: E402
from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens, rel_err  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")
LIMITS = {"o": 5e-3, "final": 5e-3}  # gradients: 1e-2
FAILED = []


def within_limits(name, errs):
    """errs {output: rel err} (NaN for non-finite results); records a failure under `name`."""
    ok = all(e == e and e <= LIMITS.get(k, 1e-2) for k, e in errs.items())
    if not ok:
        FAILED.append(name)
    return ok


def errors(got, want):
    return {k: (round(rel_err(got[k].cpu(), want[k].cpu()), 6) if torch.isfinite(got[k]).all() else float("nan"))
            for k in want}


def inputs(lengths, HV=4, H=2, D=128, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(seq_len=sum(lengths), num_heads=H, num_v_heads=HV, head_k_dim=D, head_v_dim=D,
                        dtype=torch.float64, generator=gen, **kw)
    h0 = torch.randn(len(lengths), HV, D, D, generator=gen, dtype=torch.float64) * 0.1
    do = torch.randn(1, sum(lengths), HV, D, generator=gen, dtype=torch.float64)
    df = torch.randn(len(lengths), HV, D, D, generator=gen, dtype=torch.float64) * 0.1
    return x, h0, do, df, random_cu_seqlens(lengths)


def run(x, h0, do, df, cu, cp, dtype, backend, device="cuda"):
    # the float64 reference sees q, k, v rounded to bf16 and g, beta to fp32, as the bf16 runs do
    cast = {n: (t.to(torch.bfloat16) if n in "qkv" else t.float()) for n, t in x.items()}
    if dtype == torch.float64:
        cast = {n: t.double() for n, t in cast.items()}
    xs = {n: t.to(device).requires_grad_(True) for n, t in cast.items()}
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    h = h0.to(device, sd).requires_grad_(True)
    if cp is not None and cp.world > 1:
        xs = {n: cp.local_slice(t.detach()).requires_grad_(True) for n, t in xs.items()}
        do = cp.local_slice(do)
    o, f = chunk_gated_delta_rule(**xs, initial_state=h, output_final_state=True, cu_seqlens=None if cp else cu.to(device),
                                  cp_context=cp, backend=backend, intra_cp="off")
    loss = (o.double() * do.to(device)).sum()
    if cp is None or cp.rank == 0:
        loss = loss + (f.double() * df.to(device)).sum()
    loss.backward()
    out = dict(o=o.detach(), final=f.detach(), **{"d" + n: xs[n].grad for n in NAMES}, dh0=h.grad)
    return out


def check_intra():
    lengths = [16384, 1000, 3000]
    x, h0, do, df, cu = inputs(lengths)
    ref = run(x, h0, do, df, cu, None, torch.float64, "torch")
    plain = run(x, h0, do, df, cu, None, torch.bfloat16, "tilelang")
    res = {"plain_vs_f64": errors(plain, ref)}
    ok = within_limits("intra plain", res["plain_vs_f64"])
    for name, cp in (("exact8", CPContext.single(cu, intra=8, intra_exact=True)),
                     ("auto", CPContext.single(cu, intra="auto"))):
        got = run(x, h0, do, df, cu, cp, torch.bfloat16, "tilelang")
        res[name + "_vs_f64"] = errors(got, ref)
        res[name + "_vs_plain"] = errors(got, plain)
        ok &= within_limits("intra " + name, res[name + "_vs_f64"])
    print(json.dumps({"check": "intra_tilelang_bf16", "ok": ok, **res}), flush=True)
    # the op's own intra_cp='auto' on inputs where every head decays (the warm-up shortcut applies)
    # (timings: benchmarks/bench_kernels.py, rows ours vs ours_cp)
    x, h0, do, df, cu = inputs([32768, 3000], zero_gate_heads=0, strong_decay_heads=0)
    ref = run(x, h0, do, df, cu, None, torch.float64, "torch")
    plain = run(x, h0, do, df, cu, None, torch.bfloat16, "tilelang")
    auto = run_op_auto(x, h0, do, df, cu)
    res = {"auto_vs_f64": errors(auto, ref), "plain_vs_f64": errors(plain, ref)}
    ok = within_limits("op auto", res["auto_vs_f64"]) & within_limits("op plain", res["plain_vs_f64"])
    print(json.dumps({"check": "op_intra_auto_decaying_bf16", "ok": ok, **res}), flush=True)


def run_op_auto(x, h0, do, df, cu, device="cuda"):
    """The public op with its default intra_cp='auto' (no CPContext)."""
    xs = {n: (t.to(torch.bfloat16) if n in "qkv" else t.float()).to(device).requires_grad_(True) for n, t in x.items()}
    h = h0.to(device, torch.float32).requires_grad_(True)
    o, f = chunk_gated_delta_rule(**xs, initial_state=h, output_final_state=True, cu_seqlens=cu.to(device),
                                  backend="tilelang")
    ((o.double() * do.to(device)).sum() + (f.double() * df.to(device)).sum()).backward()
    return dict(o=o.detach(), final=f.detach(), **{"d" + n: xs[n].grad for n in NAMES}, dh0=h.grad)


def _worker(rank, world, init_file, q):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        lengths = [5000, 3000, 100, 8284]  # 16384 tokens, crossing at 8192
        x, h0, do, df, cu = inputs(lengths, seed=3)
        single = run(x, h0, do, df, cu, None, torch.bfloat16, "tilelang")
        ref = run(x, h0, do, df, cu, None, torch.float64, "torch")
        res = {}
        for name, intra in (("inter", "off"), ("dual", 4)):
            cp = CPContext.build(cu, intra=intra, intra_exact=True)
            got = run(x, h0, do, df, cu, cp, torch.bfloat16, "tilelang")
            dh0 = got["dh0"].cpu()
            dist.all_reduce(dh0)
            errs = {}
            for k in ref:
                full = dh0 if k == "dh0" else got[k].cpu()
                want = ref[k].cpu() if k in ("final", "dh0") else cp.local_slice(ref[k].cpu())
                base = single[k].cpu() if k in ("final", "dh0") else cp.local_slice(single[k].cpu())
                err = round(rel_err(full, want), 6) if torch.isfinite(full).all() else float("nan")
                errs[k] = (err, round(rel_err(base, want), 6))
            res[name] = errs
        q.put((rank, res))
    except Exception as exc:  # noqa: BLE001
        import traceback

        q.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_inter():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, 2, os.path.join(tmp, "pg"), q)) for r in range(2)]
        for p in procs:
            p.start()
        for _ in procs:
            rank, res = q.get(timeout=400)
            ok = isinstance(res, dict) and all(
                within_limits(f"inter rank {rank} {name}", {k: e[0] for k, e in errs.items()})
                for name, errs in res.items())
            if not isinstance(res, dict):  # a worker's traceback
                FAILED.append(f"inter rank {rank}")
            print(json.dumps({"check": "inter_gloo_1gpu_bf16 (cp_err, single_err) vs f64", "rank": rank, "ok": ok,
                              "res": res}), flush=True)
        for p in procs:
            p.join(timeout=10)


if __name__ == "__main__":
    which = sys.argv[1:] or ["intra", "inter"]
    if "intra" in which:
        check_intra()
    if "inter" in which:
        check_inter()
    print("ALL PASS" if not FAILED else f"FAILED: {FAILED}", flush=True)
    sys.exit(1 if FAILED else 0)
