"""What the CP tests share: gloo process groups on the CPU, and one CP case against the
single-process op (every rank computes the global reference itself and returns the worst
relative errors of its slice; the parent asserts). Every process has a deadline, so a hang fails
the test instead of stalling the suite."""

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_qla_cp import chunk_gated_delta_rule
from flash_qla_cp.parallel import CPContext
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
                 intra_cp="off", intra_exact=False, gates=None, **options):
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
    cp = CPContext.build(cu, intra_cp=intra_cp, intra_exact=intra_exact)
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
