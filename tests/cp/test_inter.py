"""Inter-card CP on CPU: 2, 3 and 4 gloo processes against the single-process op (one process
group per world size runs every case: spawning is the slow part)."""

import time

import pytest
import torch
import torch.distributed as dist

from cp_harness import compare_case, lengths_for, run_workers
from flash_qla_cp import chunk_gated_delta_rule
from flash_qla_cp.parallel import CPContext, CPError, exchange_conv_halo
from flash_qla_cp.parallel.conv_halo import return_halo_grad
from flash_qla_cp.parallel.inter import InterCP, OpEngine
from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens


INTER_CASES = [
    dict(kind="one_long"),
    dict(kind="mixed"),
    dict(kind="short"),
    dict(kind="mixed", dtype=torch.float32),
    dict(kind="one_long", with_h0=False, with_final=False),
    dict(kind="mixed", state_v_first=True, use_qk_l2norm_in_kernel=True),
]


def _tolerance(case):
    return 1e-5 if case.get("dtype") == torch.float32 else 1e-10


def _inter_worker(rank, world):
    out = []
    for i, case in enumerate(INTER_CASES):
        case = dict(case)
        errs = compare_case(rank, world, lengths_for(world, case.pop("kind")), seed=i, **case)
        out.append(errs)
    out.append(_halo_case(rank, world))
    out.append(_error_cases(rank, world))
    return out


def _halo_case(rank, world, conv_size=4):
    """Halo values (zeros across a sequence start) and gradients sent back to the owner."""
    per_rank = 96
    # a sequence starting 2 tokens before each boundary: a halo row of the old sequence must be 0
    edges = sorted({0, world * per_rank} | {r * per_rank - 2 for r in range(1, world)})
    cu = torch.tensor(edges, dtype=torch.int32)
    cp = CPContext.build(cu)
    x = torch.arange(world * per_rank * 3, dtype=torch.float64).reshape(1, -1, 3) + 1
    xl = cp.local_slice(x).clone().requires_grad_(True)
    halo = exchange_conv_halo(xl, cp, conv_size)
    a = rank * per_rank
    want = torch.zeros(1, conv_size - 1, 3, dtype=torch.float64)
    if rank > 0:
        want[:, 1:] = x[:, a - 2 : a]  # rows before the sequence start stay zero
    weight = torch.arange(1, 1 + 3 * (conv_size - 1), dtype=torch.float64).reshape(1, conv_size - 1, 3)
    (halo * weight).sum().backward()
    grad_want = torch.zeros_like(xl)
    if rank < world - 1:
        grad_want[:, -2:] = weight[:, 1:]
    # a strided gradient (the TileLang conv step returns one) is sent as its dense copy would be
    dhalo = weight.transpose(1, 2).contiguous().transpose(1, 2)
    strided_ok = torch.equal(return_halo_grad(dhalo, cp), return_halo_grad(dhalo.contiguous(), cp))
    return {"halo_ok": torch.equal(halo.detach(), want), "grad_ok": torch.equal(xl.grad, grad_want),
            "strided_grad_ok": strided_ok}


def _error_cases(rank, world):
    """Bad batches must raise CPError on every rank (a hang would trip the harness deadline)."""
    msgs = {}
    for name, cu in (
        ("indivisible", torch.tensor([0, 5, 96 * world + 1], dtype=torch.int32)),
        ("mismatch", torch.tensor([0, 10 + rank, 96 * world], dtype=torch.int32)),
        ("bad_on_one_rank", torch.tensor([0, 10, 96 * world - (rank == world - 1)], dtype=torch.int32)),
    ):
        try:
            CPContext.build(cu)
            msgs[name] = None
        except CPError as exc:
            msgs[name] = str(exc)
    # a local failure before the exchange: the failing rank still joins, all ranks raise
    class Broken(OpEngine):
        def fwd(self, *args):
            if rank == 1:
                raise RuntimeError("simulated local failure")
            return super().fwd(*args)

    cp = CPContext.build(random_cu_seqlens(lengths_for(world, "mixed")))
    x = {n: cp.local_slice(t) for n, t in make_gdn_inputs(seq_len=96 * world, head_k_dim=8, head_v_dim=8).items()}
    try:
        InterCP.apply(*x.values(), None, cp, Broken("torch"), 0.3, False)
        msgs["local_failure"] = None
    except CPError as exc:
        msgs["local_failure"] = str(exc)
    # a bad input of this call on one rank (rank 1 stays alive after its own error): every rank
    # raises the same CPError at once, before the exchange, instead of waiting in it
    cu = random_cu_seqlens(lengths_for(world, "mixed"))
    cp = CPContext.build(cu)
    full = make_gdn_inputs(seq_len=96 * world, head_k_dim=8, head_v_dim=8)
    good = {n: cp.local_slice(t) for n, t in full.items()}
    h0 = torch.zeros(cp.num_seqs_global, 4, 8, 8, dtype=torch.float64)
    calls = {
        "short_slice": dict(good, q=good["q"][:, 1:], k=good["k"][:, 1:]) if rank == 1 else good,
        "mixed_dtype": dict(good, v=good["v"].float()) if rank == 1 else good,
        "h0_rows": dict(good, initial_state=h0[1:] if rank == 1 else h0),
    }
    for name, inputs in calls.items():
        start = time.monotonic()
        try:
            chunk_gated_delta_rule(**inputs, cp_context=cp)
            msgs[name] = (None, 0.0)
        except CPError as exc:
            msgs[name] = (str(exc), time.monotonic() - start)
    start = time.monotonic()
    try:  # a setting that must agree across ranks
        chunk_gated_delta_rule(**good, cp_context=cp, output_final_state=rank == 0)
        msgs["flags"] = (None, 0.0)
    except CPError as exc:
        msgs["flags"] = (str(exc), time.monotonic() - start)
    # the group still works after the errors
    t = torch.ones(1)
    dist.all_reduce(t)
    msgs["alive"] = t.item() == world
    return msgs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_inter_cp_matches_single_process(world):
    results = run_workers(world, _inter_worker)
    for rank, res in enumerate(results):
        *cases, halo, errors = res
        assert halo == {"halo_ok": True, "grad_ok": True, "strided_grad_ok": True}, f"world={world} rank={rank}: {halo}"
        for case, errs in zip(INTER_CASES, cases):
            tol = _tolerance(case)
            bad = {k: v for k, v in errs.items() if not v < tol}
            assert not bad, f"world={world} rank={rank} case={case}: {bad}"
        assert errors["alive"]
        assert "multiple of the CP world size" in errors["indivisible"]
        assert "differs across ranks" in errors["mismatch"]
        assert f"rank(s) [{world - 1}]" in errors["bad_on_one_rank"]
        assert "failed on rank(s) [1]" in errors["local_failure"]
        for name in ("short_slice", "mixed_dtype", "h0_rows"):
            msg, seconds = errors[name]
            assert msg and "invalid input on rank(s) [1]" in msg and seconds < 5, (name, msg, seconds)
        msg, seconds = errors["flags"]
        assert msg and "disagree" in msg and seconds < 5, (msg, seconds)


def test_wrong_local_length_is_a_clear_error():
    cp = CPContext.single(random_cu_seqlens([64, 64]), intra_cp="off")
    x = make_gdn_inputs(seq_len=100)
    with pytest.raises(CPError, match="holds 128 tokens"):
        chunk_gated_delta_rule(**x, cp_context=cp)
