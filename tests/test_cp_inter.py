"""Inter-card CP on CPU: 2, 3 and 4 gloo processes against the single-process op.

One process group per world size runs every case (spawning is the slow part). Each rank
computes the global reference itself, runs its slice under CP and sends back the worst
relative errors; the parent asserts. Every process has a deadline, so a hang fails the
test instead of stalling the suite.
"""

import datetime
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_qla_cp import chunk_gated_delta_rule
from flash_qla_cp.parallel import CPContext, CPError, exchange_conv_halo
from flash_qla_cp.parallel.inter import InterCP, OpEngine
from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens, rel_err

TIMEOUT_S = 150
NAMES = ("q", "k", "v", "g", "beta")


# ---------------------------------------------------------------- process-group harness
def _entry(rank, world, init_file, fn, queue):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        queue.put((rank, "ok", fn(rank, world)))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(world, fn, timeout=TIMEOUT_S):
    """Run fn(rank, world) in `world` gloo processes; return the results by rank."""
    # forkserver: torch is imported once by the server, each worker forks from it (spawn would
    # re-import torch per process, seconds each); the server never ran a thread pool
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "flash_qla_cp.parallel", __name__])
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg")
        procs = [ctx.Process(target=_entry, args=(r, world, init_file, fn, queue), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(world):
                rank, status, payload = queue.get(timeout=timeout)
                if status != "ok":
                    raise AssertionError(f"rank {rank} failed:\n{payload}")
                results[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]


# ---------------------------------------------------------------- one CP case vs reference
def _loss_grads(x, h0, cu, dtype_out, cp, do, dfinal, rank_uses_final, **options):
    xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    h = h0.detach().clone().requires_grad_(True) if h0 is not None else None
    o, final = chunk_gated_delta_rule(**xs, initial_state=h, output_final_state=dfinal is not None,
                                      cu_seqlens=cu if cp is None else None, cp_context=cp, **options)
    loss = (o * do).sum()
    if dfinal is not None and rank_uses_final:
        loss = loss + (final * dfinal).sum()
    loss.backward()
    grads = {n: xs[n].grad for n in NAMES}
    grads["h0"] = h.grad if h is not None else None
    return o, final, grads


def compare_case(rank, world, lengths, dtype=torch.float64, with_h0=True, with_final=True, seed=0,
                 intra="off", intra_exact=False, gates=None, **options):
    """Worst relative error of o, final state and every gradient (rank-local view)."""
    cu = random_cu_seqlens(lengths)
    T = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(seq_len=T, num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, dtype=dtype,
                        generator=gen, **(gates or {}))
    N = len(lengths)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    h0 = torch.randn(N, 4, 16, 16, generator=gen, dtype=torch.float64).to(sdt) if with_h0 else None
    do = torch.randn(1, T, 4, 16, generator=gen, dtype=torch.float64).to(dtype)
    dfinal = torch.randn(N, 4, 16, 16, generator=gen, dtype=torch.float64).to(sdt) if with_final else None

    o_ref, f_ref, g_ref = _loss_grads(x, h0, cu, dtype, None, do, dfinal, True, **options)
    cp = CPContext.build(cu, intra=intra, intra_exact=intra_exact)
    local = {n: cp.local_slice(t) for n, t in x.items()}
    o, f, grads = _loss_grads(local, h0, cu, dtype, cp, cp.local_slice(do), dfinal, rank == 0, **options)

    errs = {"o": rel_err(o, cp.local_slice(o_ref))}
    if with_final:
        errs["final"] = rel_err(f, f_ref)
    for n in NAMES:
        errs["d" + n] = rel_err(grads[n], cp.local_slice(g_ref[n]))
    if with_h0:
        dh0 = grads["h0"].clone()
        dist.all_reduce(dh0)  # each rank holds the rows of sequences starting on it
        errs["dh0"] = rel_err(dh0, g_ref["h0"])
    return errs


def lengths_for(world, kind, per_rank=96):
    L = per_rank * world  # global tokens
    if kind == "one_long":
        return [L]
    if kind == "mixed":  # crossing, inside, empty and length-1 sequences
        head = [37, 0, 130, 1, 20]
        return head + [L - sum(head)]
    if kind == "short":
        out, t = [], 0
        while t < L:
            n = min(1 + (len(out) * 7) % 11, L - t)
            out.append(n)
            t += n
        return out
    raise ValueError(kind)


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
    return {"halo_ok": torch.equal(halo.detach(), want), "grad_ok": torch.equal(xl.grad, grad_want)}


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
        assert halo == {"halo_ok": True, "grad_ok": True}, f"world={world} rank={rank}: {halo}"
        for case, errs in zip(INTER_CASES, cases):
            tol = _tolerance(case)
            bad = {k: v for k, v in errs.items() if not v < tol}
            assert not bad, f"world={world} rank={rank} case={case}: {bad}"
        assert errors["alive"]
        assert "multiple of the CP world size" in errors["indivisible"]
        assert "differs across ranks" in errors["mismatch"]
        assert f"rank(s) [{world - 1}]" in errors["bad_on_one_rank"]
        assert "failed on rank(s) [1]" in errors["local_failure"]


def test_wrong_local_length_is_a_clear_error():
    cp = CPContext.single(random_cu_seqlens([64, 64]), intra="off")
    x = make_gdn_inputs(seq_len=100)
    with pytest.raises(CPError, match="holds 128 tokens"):
        chunk_gated_delta_rule(**x, cp_context=cp)
