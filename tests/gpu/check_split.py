"""GPU check of the intra-card split inside the TileLang kernels (kernels/tilelang_split.py).

For each case: the public op with backend='tilelang' and intra_cp = P or 'auto', forward and
TileLang backward (the default; FLASH_QLA_CP_TILELANG_BWD must not be 0), against the float64 torch op and against the
same kernels without the split. Free GPU memory is filled with NaN first and the backward's
buffers start as NaN, so an element nobody writes fails the check; two runs must be bitwise
equal. Prints one JSON line per case and exits non-zero on a failure.

    python tests/gpu/check_split.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from flash_qla_cp import chunk_gated_delta_rule  # noqa: E402
from flash_qla_cp.kernels import tilelang_bwd_impl, tilelang_split  # noqa: E402
from flash_qla_cp.ops import tilelang_backward_enabled  # noqa: E402
from flash_qla_cp.testing import chunk_local_cumsum, make_gdn_inputs, random_cu_seqlens, rel_err  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")
LIMITS = {"o": 5e-3, "final": 5e-3}  # gradients: 1e-2


def poison(nbytes=1 << 30):
    x = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del x


def make_case(lengths, dense_batch, HV, H, D, seed):
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(seq_len=sum(lengths), num_heads=H, num_v_heads=HV, head_k_dim=D, head_v_dim=D,
                        dtype=torch.float64, generator=gen)
    # three slowly decaying heads (about -0.2, -0.6, -2 per chunk): warm-ups of many chunks
    x["g"][..., 1:4] *= torch.tensor([0.003, 0.01, 0.03], dtype=torch.float64)[: max(0, min(3, HV - 1))]
    n = len(lengths)
    h0 = torch.randn(n, HV, D, D, generator=gen, dtype=torch.float64) * 0.1
    do = torch.randn(1, sum(lengths), HV, D, generator=gen, dtype=torch.float64)
    df = torch.randn(n, HV, D, D, generator=gen, dtype=torch.float64) * 0.1
    cu = None if dense_batch else random_cu_seqlens(lengths)
    if dense_batch:  # equal lengths as a [B, T] batch
        T = lengths[0]
        x = {k: t.reshape(n, T, *t.shape[2:]) for k, t in x.items()}
        do = do.reshape(n, T, *do.shape[2:])
    return x, h0, do, df, cu


def run(case, dtype, backend, intra, state_v_first=False, with_h0=True):
    """dtype float64: the reference, on the inputs rounded as the bf16 run sees them."""
    x, h0, do, df, cu = case
    if dtype == torch.float64:
        xs = {n: (t.to(torch.bfloat16) if n in "qkv" else t.float()).double() for n, t in x.items()}
    else:
        xs = {n: (t.to(dtype) if n in "qkv" else t.float()) for n, t in x.items()}
    xs = {n: t.cuda().requires_grad_(True) for n, t in xs.items()}
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    h = h0.to("cuda", sd)
    dfin = df
    if state_v_first:
        h, dfin = h.transpose(-1, -2).contiguous(), df.transpose(-1, -2)
    h = h.requires_grad_(True) if with_h0 else None
    poison()
    o, f = chunk_gated_delta_rule(**xs, initial_state=h, output_final_state=True,
                                  cu_seqlens=None if cu is None else cu.cuda(), backend=backend, intra_cp=intra,
                                  state_v_first=state_v_first)
    loss = (o.double() * do.cuda()).sum() + (f.double() * dfin.cuda()).sum()
    loss.backward()
    out = dict(o=o.detach(), final=f.detach(), **{"d" + n: xs[n].grad for n in NAMES})
    if with_h0:
        out["dh0"] = h.grad
    return {k: v.float().cpu() for k, v in out.items()}


def check_decay_tables():
    """The warm-up tables kernel against its torch references, element for element: slow, fast
    and g = 0 heads over 40 v-heads (two thread blocks per partition), an empty sequence and
    partitions of 1 to 100 chunks."""
    from flash_qla_cp.kernels.tilelang_split import decay_tables, dh_warmup_chunks, plan_split, warmup_starts

    HV = 40
    cu = [0, 64 * 37 + 5, 64 * 37 + 5, 64 * 37 + 5 + 64 * 200 + 63, 64 * 37 + 5 + 64 * 200 + 63 + 17]
    gen = torch.Generator().manual_seed(11)
    rates = torch.tensor([0.003, 0.03, 1.0, 0.0] * (HV // 4), dtype=torch.float64)
    g = -rates * torch.nn.functional.softplus(torch.randn(1, cu[-1], HV, generator=gen, dtype=torch.float64))
    gcum = chunk_local_cumsum(g, cu).float().cuda()
    out = {}
    for parts in (3, 16):
        plan = plan_split(cu, HV=HV, V=128, parts=parts)
        starts, walk = decay_tables(gcum, plan)
        out[f"p{parts}"] = {"starts_equal": torch.equal(starts, warmup_starts(gcum, plan)),
                            "walk_equal": torch.equal(walk, dh_warmup_chunks(gcum, plan))}
    ok = all(all(r.values()) for r in out.values())
    print(json.dumps({"case": "decay_tables", "ok": ok, **out}), flush=True)
    return ok


def main():
    assert tilelang_backward_enabled(), "unset FLASH_QLA_CP_TILELANG_BWD=0: this checks the TileLang backward"
    tilelang_bwd_impl.POISON_BUFFERS = True
    for mode in ("on", "off"):  # --fused-walk-on / -off: the fused dh + grad walk always / never
        if f"--fused-walk-{mode}" in sys.argv[1:]:
            tilelang_bwd_impl.FUSED_WALK = mode
    failed = not check_decay_tables()
    cases = [
        # name, lengths, dense, HV, H, D, intra, state_v_first, with_h0
        ("varlen_odd_p8", [16384, 1000, 3001], False, 4, 2, 128, 8, False, True),
        ("varlen_auto", [20000, 77, 4096], False, 4, 2, 128, "auto", False, True),
        ("dense_b2_p4_vfirst", [8192, 8192], True, 4, 2, 128, 4, True, True),
        ("gva_d64_p16_noh0", [12345], False, 8, 2, 64, 16, False, False),
        # TP1-like (32 v-heads): 'auto' cuts 257 chunks in four, forward and backward
        ("tp1_auto", [16384 + 77], False, 32, 16, 128, "auto", False, True),
        # K = V = 256: 'auto' leaves the sequences whole (the split's scan would not fit) and the
        # backward runs the TileLang walks with the per-chunk gradients in torch; the op must
        # still be right end to end
        ("wide_k256_auto", [5000, 77], False, 4, 2, 256, "auto", False, True),
        # T = 128k (TP8-like): one dense sequence as in the benchmark, and packed odd lengths
        ("tp8_dense_128k_auto_noh0", [131072], True, 4, 2, 128, "auto", False, False),
        ("tp8_varlen_128k_odd_auto", [100003, 31068, 1], False, 4, 2, 128, "auto", False, True),
    ]
    # --cases a,b runs only those (a quick check of a change to the plan); seeds stay per case
    wanted = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--cases=")), None)
    for seed, (name, lengths, dense, HV, H, D, intra, vfirst, with_h0) in enumerate(cases):
        if wanted is not None and name not in wanted:
            continue
        case = make_case(lengths, dense, HV, H, D, seed=seed)
        ref = run(case, torch.float64, "torch", "off", vfirst, with_h0)
        plain = run(case, torch.bfloat16, "tilelang", "off", vfirst, with_h0)
        got = run(case, torch.bfloat16, "tilelang", intra, vfirst, with_h0)
        again = run(case, torch.bfloat16, "tilelang", intra, vfirst, with_h0)
        err = {k: rel_err(got[k], ref[k]) for k in ref}
        err_plain = {k: rel_err(plain[k], ref[k]) for k in ref}
        nan = [k for k in got if not torch.isfinite(got[k]).all()]
        same = all(torch.equal(got[k], again[k]) for k in got)
        ok = not nan and same and all(err[k] <= LIMITS.get(k, 1e-2) for k in err)
        failed |= not ok
        print(json.dumps({"case": name, "ok": ok, "nan": nan, "deterministic": same,
                          "split_vs_f64": {k: round(v, 6) for k, v in err.items()},
                          "plain_vs_f64": {k: round(v, 6) for k, v in err_plain.items()}}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
