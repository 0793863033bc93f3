"""Intra-card CP in one process: partitions batched as extra sequences, exact and shortcut paths."""

import functools
import math

import pytest
import torch

from flash_qla_cp import chunk_gated_delta_rule
from flash_qla_cp.reference import chunk_gated_delta_rule_torch
from flash_qla_cp.parallel import CPContext, build_plan, plan_partitions, segment_transitions
from flash_qla_cp.parallel.inter import OpEngine
from flash_qla_cp.parallel.intra import EXACT, FIRST, WARM, IntraEngine
from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens, rel_err

NAMES = ("q", "k", "v", "g", "beta")
LENGTHS = [300, 0, 90, 400, 5, 200]


def _case(dtype=torch.float64, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    cu = random_cu_seqlens(LENGTHS)
    x = make_gdn_inputs(seq_len=sum(LENGTHS), num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                        dtype=dtype, generator=gen, **kw)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    h0 = torch.randn(len(LENGTHS), 4, 16, 16, generator=gen, dtype=torch.float64).to(sdt)
    return x, cu, h0


def _run(x, cu, h0, cp):
    """o, final and all gradients of <o, do> + <final, dfinal>."""
    xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    h = h0.clone().requires_grad_(True)
    o, f = chunk_gated_delta_rule(**xs, initial_state=h, output_final_state=True, cu_seqlens=cu, cp_context=cp)
    gen = torch.Generator().manual_seed(99)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    df = torch.randn(f.shape, generator=gen, dtype=torch.float64).to(f.dtype)
    ((o * do).sum() + (f * df).sum()).backward()
    return dict(o=o, final=f, **{"d" + n: xs[n].grad for n in NAMES}, dh0=h.grad)


def _errors(got, ref):
    return {name: rel_err(got[name], ref[name]) for name in ref}


@functools.lru_cache(maxsize=1)
def _shared_reference():
    x, cu, h0 = _case(seed=0)  # one strongly decaying head, one g = 0 head
    return x, cu, h0, _run(x, cu, h0, None)


@pytest.mark.parametrize("partitions", [2, 3, 7])
def test_exact_path_equals_reference_float64(partitions):
    x, cu, h0, ref = _shared_reference()
    cp = CPContext.single(cu, intra_cp=partitions, intra_exact=True)
    errs = _errors(_run(x, cu, h0, cp), ref)
    assert max(errs.values()) < 1e-10, errs


def test_exact_path_float32():
    x, cu, h0 = _case(dtype=torch.float32, seed=3)
    ref = _run(x, cu, h0, None)
    errs = _errors(_run(x, cu, h0, CPContext.single(cu, intra_cp=4, intra_exact=True)), ref)
    assert max(errs.values()) < 1e-5, errs


def test_zero_gate_head_keeps_every_partition_exact():
    x, cu, _ = _case(seed=1)  # head 3 has g = 0: no window can decay for all heads
    plan = build_plan(cu.tolist(), x["g"], 4, intra_cp=4, exact=False)
    assert {p.mode for p in plan.partitions} == {FIRST, EXACT}


def test_decay_shortcut_within_tolerance():
    """All heads decay strongly: partitions warm up from zero W chunks early instead of carrying M.

    The dropped term is M_window S with ||M_window|| <= exp(sum g over the window) <= exp(threshold)
    (unit k, beta in [0, 1]), so with threshold -10 the error is ~exp(-10) ~ 4.5e-5 of the state at most.
    """
    x, cu, h0 = _case(seed=5, strong_decay_heads=4, zero_gate_heads=0)
    x["g"] = x["g"] * 0.02  # weak enough that the window test matters, strong enough to pass it
    plan = build_plan(cu.tolist(), x["g"], 4, intra_cp=4, exact=False, threshold=-10.0, window=2)
    assert WARM in {p.mode for p in plan.partitions}
    ref = _run(x, cu, h0, None)
    errs = _errors(_run(x, cu, h0, CPContext.single(cu, intra_cp=4, intra_exact=False, intra_threshold=-10.0)), ref)
    assert max(errs.values()) < 10 * math.exp(-10.0), errs
    assert max(errs.values()) > 1e-14  # the shortcut really ran (the exact path would be ~1e-16)
    exact = _errors(_run(x, cu, h0, CPContext.single(cu, intra_cp=4, intra_exact=True)), ref)
    assert max(exact.values()) < 1e-10, exact


def test_exact_flag_disables_the_shortcut():
    x, cu, _ = _case(seed=5, strong_decay_heads=4, zero_gate_heads=0)
    modes = {p.mode for p in build_plan(cu.tolist(), x["g"], 4, intra_cp=4, exact=True).partitions}
    assert WARM not in modes and EXACT in modes


def test_partitions_are_chunk_aligned_and_cover_every_token():
    x, cu, _ = _case(seed=2)
    plan = build_plan(cu.tolist(), x["g"], 4, intra_cp=3)
    edges = cu.tolist()
    covered = []
    for p in plan.partitions:
        assert (p.start - edges[p.seq]) % 64 == 0
        covered += list(range(p.start, p.end))
    assert covered == list(range(edges[-1]))
    assert plan.empty_seqs == [1]


def test_backward_reuses_the_forward_plan():
    """The plan depends on g; the backward must not rebuild it (even if g changed in between)."""
    x, cu, h0 = _case(seed=5, strong_decay_heads=4, zero_gate_heads=0)
    engine = IntraEngine(OpEngine("torch"), intra_cp=4, exact=False, threshold=-10.0)
    o, fin, ctx = engine.fwd(*(x[n] for n in NAMES), 16**-0.5, h0, cu)
    assert ctx[0] == "split"
    plan = ctx[1]
    x["g"].zero_()  # would make every partition exact if the plan were rebuilt
    grads = engine.bwd(torch.ones_like(o), torch.zeros_like(fin), ctx)
    assert ctx[1] is plan and len(grads) == 6


def test_segment_transitions_match_the_reference_transition():
    x, cu, _ = _case(seed=4)
    _, s, M = chunk_gated_delta_rule_torch(**x, output_final_state=True, cu_seqlens=cu, return_transition=True)
    M2, h2 = segment_transitions(x["k"], x["v"], x["g"], x["beta"], cu, group=3)
    assert rel_err(M2, M) < 1e-12 and rel_err(h2, s) < 1e-12


def test_cost_model_decisions():
    # few heads, one long sequence: the chain dominates, so split
    d = plan_partitions([512], num_heads=4, sms=132)
    assert d.partitions[0] >= 8 and d.time_split < d.time_whole
    # enough (sequence, head) pairs to fill the SMs: no split
    assert plan_partitions([512] * 64, num_heads=32, sms=132).partitions == [1] * 64
    # short sequences never split below the minimum partition length
    assert plan_partitions([12], num_heads=1, sms=132).partitions == [1]
    # only the long sequence of a mixed batch splits
    mixed = plan_partitions([512, 8, 8], num_heads=8, sms=132).partitions
    assert mixed[0] > 1 and mixed[1:] == [1, 1]
    # user overrides
    assert plan_partitions([512], 4, 132, intra_cp="off").partitions == [1]
    assert plan_partitions([512, 2], 4, None, intra_cp=3).partitions == [3, 2]
    # forward and backward decide identically: the model is a pure function of its inputs
    assert plan_partitions([300, 77], 2, 132) == plan_partitions([300, 77], 2, 132)


def test_auto_plan_splits_for_a_gpu_and_runs_exact_under_the_op(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    cu = random_cu_seqlens([2100, 50])  # 33 chunks, 4 heads: the model splits the long one on 132 SMs
    x = make_gdn_inputs(seq_len=2150, num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, generator=gen)
    h0 = torch.randn(2, 4, 16, 16, generator=gen, dtype=torch.float64)
    plan = build_plan(cu.tolist(), x["g"], 4, intra_cp="auto", sms=132)
    assert not plan.is_trivial and len(plan.partitions) == 5
    # without a GPU 'auto' has no SMs to fill: every sequence stays whole
    assert build_plan(cu.tolist(), x["g"], 4, intra_cp="auto").is_trivial
    ref = _run(x, cu, h0, None)
    from flash_qla_cp.parallel import intra

    monkeypatch.setattr(intra, "sm_count", lambda device: 132)  # as on a GPU of 132 SMs
    cp = CPContext.single(cu, intra_cp="auto")  # exact by default: no decay shortcut
    errs = _errors(_run(x, cu, h0, cp), ref)
    assert max(errs.values()) < 1e-10, errs


# -- the op's own intra_cp switch (no CPContext in user code) ----------------------------------
def _run_op(x, cu, h0, **kw):
    xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    h = h0.clone().requires_grad_(True)
    o, f = chunk_gated_delta_rule(**xs, initial_state=h, output_final_state=True, cu_seqlens=cu, **kw)
    gen = torch.Generator().manual_seed(7)
    ((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
     + (f * torch.randn(f.shape, generator=gen, dtype=f.dtype)).sum()).backward()
    return dict(o=o, final=f, **{"d" + n: xs[n].grad for n in NAMES}, dh0=h.grad)


def test_op_intra_cp_forced_matches_unsplit_varlen():
    """intra_cp=4 on the torch backend: g = 0 heads keep every cut exact, so float64 agrees."""
    x, cu, h0 = _case()
    want = _run_op(x, cu, h0, intra_cp="off")
    got = _run_op(x, cu, h0, intra_cp=4)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-10, name


def test_op_intra_cp_dense_batch():
    """A dense [B, T] batch goes through the split as B packed sequences and comes back [B, T]."""
    gen = torch.Generator().manual_seed(3)
    x = make_gdn_inputs(batch=2, seq_len=256, num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                        generator=gen)
    h0 = torch.randn(2, 4, 16, 16, generator=gen, dtype=torch.float64)
    want = _run_op(x, None, h0, intra_cp="off")
    got = _run_op(x, None, h0, intra_cp=2)
    assert got["o"].shape == want["o"].shape == (2, 256, 4, 16)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-10, name


def test_op_intra_cp_auto_is_off_on_torch_backend():
    """'auto' only splits on the TileLang backend; the CPU torch path stays bit-identical."""
    x, cu, h0 = _case(seed=5)
    a = _run_op(x, cu, h0, intra_cp="auto")
    b = _run_op(x, cu, h0, intra_cp="off")
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("bad", [0, -2, "on", 1.5, True])
def test_op_intra_cp_bad_value(bad):
    x, cu, h0 = _case()
    with pytest.raises(ValueError, match="intra_cp"):
        chunk_gated_delta_rule(**x, initial_state=h0, cu_seqlens=cu, intra_cp=bad)
