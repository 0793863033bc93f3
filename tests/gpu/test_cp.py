"""Context parallelism on one Hopper GPU with the TileLang kernels inside: the torch split engine
around the op (CPContext with a world of 1), and inter-card / dual CP with two processes sharing
the GPU over gloo (multi-GPU NCCL runs need a machine with several GPUs). Float64 references on
the inputs as the bf16 runs see them; the limits of gdn_checks."""

import datetime
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_qla_cp import CPContext
from gdn_checks import NAMES, Case, check_case, make_inputs, over_limits, rel_err, run_op

CASE = Case((5000, 3000, 100, 8284), resets=True, seed=3)  # 16384 tokens: two ranks cut inside the first long
# sequence; g = -inf and gates to -1e30 scattered over two heads (resets on both sides of the cut)


@pytest.mark.parametrize("intra_cp,exact", [(8, True), ("auto", False)])
def test_single_process_context_within_limits(intra_cp, exact):
    cu = make_inputs(CASE).cu
    check_case(CASE, "cuda", "tilelang", cp_context=CPContext.single(cu, intra_cp=intra_cp, intra_exact=exact))


def _op_errors(rank):
    """The op under 2-rank inter-card and dual CP against float64: errors per output and gradient."""
    inputs = make_inputs(CASE)
    want = run_op(CASE, inputs, "cuda", "torch", reference=True)
    res = {}
    for name, intra in (("inter", "off"), ("dual", 4)):
        cp = CPContext.build(inputs.cu, intra_cp=intra, intra_exact=True)
        # the final states are replicated on every rank and their gradients add up over the ranks
        # (as for an all_gather): the loss's final-state term is counted once, on rank 0
        dfinal = inputs.dfinal if rank == 0 else torch.zeros_like(inputs.dfinal)
        local = type(inputs)({n: cp.local_slice(t) for n, t in inputs.x.items()}, inputs.h0,
                             cp.local_slice(inputs.do), dfinal, inputs.cu)
        got = run_op(CASE, local, "cuda", "tilelang", cp_context=cp)
        dh0 = got["dh0"].clone()
        dist.all_reduce(dh0)  # each rank holds the rows of the sequences that start on it
        errs = {}
        for k in want:
            full = dh0 if k == "dh0" else got[k]
            ref = want[k] if k in ("final", "dh0") else cp.local_slice(want[k])
            errs[k] = rel_err(full, ref)
        res[name] = errs
    return res


def _rank_main(body, rank, world, init_file, queue):
    """One spawned rank: joins the gloo group, puts (rank, body(rank)) on the queue, or its
    traceback when anything fails (reported to the parent, never a hang)."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        queue.put((rank, body(rank)))
    except Exception:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _two_processes(body) -> list:
    """[(rank, body(rank))] from two spawned processes sharing the GPU (`_rank_main`); a rank
    that failed returns its traceback (a string)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg")
        procs = [ctx.Process(target=_rank_main, args=(body, r, 2, init_file, queue)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            return [queue.get(timeout=600) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()


def test_two_processes_on_one_gpu_within_limits():
    for rank, res in _two_processes(_op_errors):
        assert isinstance(res, dict), f"rank {rank} failed:\n{res}"
        for name, errs in res.items():
            assert set(errs) == {"o", "final", "dh0", *("d" + n for n in NAMES)}
            assert not over_limits(errs), (rank, name, errs)


def _layer_errors(rank):
    """GatedDeltaNet (bf16, TileLang) under 2-rank CP against the same layer in one process."""
    import torch

    from flash_qla_cp import GatedDeltaNet
    from flash_qla_cp.testing import random_cu_seqlens

    torch.manual_seed(0)
    layer = GatedDeltaNet(512, 2, 4, 128, 128, device="cuda", dtype=torch.bfloat16)
    lengths = [5000, 3000, 2, 98, 8284]  # rank 1 starts inside the first sequence
    cu = random_cu_seqlens(lengths, device="cuda")
    x = torch.randn(1, sum(lengths), 512, generator=torch.Generator().manual_seed(1)).cuda().bfloat16()

    def run(xx, **kw):
        xx = xx.detach().clone().requires_grad_(True)
        layer.zero_grad()
        out = layer(xx, cu_seqlens=cu, **kw)
        out.float().square().sum().backward()
        return out.detach(), xx.grad, {n: p.grad.float().clone() for n, p in layer.named_parameters()}

    want_out, want_dx, want_grads = run(x)
    cp = CPContext.build(cu, intra_cp="auto")
    out, dx, grads = run(cp.local_slice(x), cp_context=cp)
    errs = {"out": rel_err(out, cp.local_slice(want_out)), "dx": rel_err(dx, cp.local_slice(want_dx))}
    for n, g in grads.items():
        dist.all_reduce(g)  # replicated parameters: the ranks' parts add up
        errs["d" + n] = rel_err(g, want_grads[n])
    return errs


def test_layer_under_two_process_cp_matches_one_process():
    """The fused layer's CP path (conv history from the other rank, its gradient sent back) with
    the TileLang kernels: bf16 results within the op's limits of the one-process layer."""
    for rank, errs in _two_processes(_layer_errors):
        assert isinstance(errs, dict), f"rank {rank} failed:\n{errs}"
        assert all(e < 1e-2 for e in errs.values()), (rank, errs)
