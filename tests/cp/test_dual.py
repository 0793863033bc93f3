"""Dual CP: intra-card partitions inside each of 2 / 3 gloo ranks, seeded by the inter-card scan."""

import pytest
import torch

from cp_harness import compare_case, lengths_for, run_workers

# 256 tokens (4 chunks) per rank, so every rank really splits its long pieces
DUAL_CASES = [
    dict(kind="one_long", intra_cp=3, intra_exact=True),  # pass-through ranks for world >= 3
    dict(kind="mixed", intra_cp=2, intra_exact=True),
    dict(kind="mixed", intra_cp=4, intra_exact=True, dtype=torch.float32),
    dict(kind="one_long", intra_cp="auto", intra_exact=True, with_h0=False),
    # every head decays strongly: the warm-up shortcut replaces the carried state
    dict(kind="one_long", intra_cp=4, gates=dict(strong_decay_heads=4, zero_gate_heads=0), tol=1e-8),
]


def _dual_worker(rank, world):
    out = []
    for i, case in enumerate(DUAL_CASES):
        case = dict(case)
        case.pop("tol", None)
        out.append(compare_case(rank, world, lengths_for(world, case.pop("kind"), 256), seed=10 + i, **case))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_dual_cp_matches_single_process(world):
    for rank, res in enumerate(run_workers(world, _dual_worker)):
        for case, errs in zip(DUAL_CASES, res):
            tol = case.get("tol", 1e-5 if case.get("dtype") == torch.float32 else 1e-10)
            bad = {k: v for k, v in errs.items() if not v < tol}
            assert not bad, f"world={world} rank={rank} case={case}: {bad}"


def test_local_engine_splits_inside_the_kernels_on_tilelang(monkeypatch):
    """Under CP the TileLang backend gets the split as the op's intra_cp (exact, in-kernel);
    the torch backend keeps the parallel.intra engine around the op."""
    from flash_qla_cp.parallel import CPContext, dual
    from flash_qla_cp.parallel.inter import OpEngine
    from flash_qla_cp.parallel.intra import IntraEngine

    cu = torch.tensor([0, 512])
    q, v = torch.zeros(1, 512, 2, 16), torch.zeros(1, 512, 4, 16)
    cp = CPContext.single(cu, intra_cp=4)
    eng = dual.local_engine(cp, "auto", q, v)
    assert isinstance(eng, IntraEngine) and isinstance(eng.base, OpEngine)
    monkeypatch.setattr(dual, "choose_backend", lambda backend, q, v: "tilelang")
    eng = dual.local_engine(cp, "auto", q, v)
    assert isinstance(eng, OpEngine) and eng.intra_cp == 4
    off = dual.local_engine(CPContext.single(cu, intra_cp="off"), "auto", q, v)
    assert isinstance(off, OpEngine) and off.intra_cp == "off"


def test_cp_forward_keeps_states_only_for_a_backward(save_states_requests):
    """Under CP, as in the plain op, each rank's forward keeps its chunk states (TileLang's
    save_states) only when a backward will run; the results do not depend on it."""
    from flash_qla_cp.parallel import CPContext
    from flash_qla_cp.parallel.dual import cp_chunk_gated_delta_rule
    from flash_qla_cp.testing import make_gdn_inputs

    asked = save_states_requests
    x = make_gdn_inputs(seq_len=100, num_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                        generator=torch.Generator().manual_seed(3))
    cp = CPContext.single(torch.tensor([0, 40, 100]), intra_cp="off")
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, _ = cp_chunk_gated_delta_rule(**leaves, cp_context=cp)
    assert asked and all(asked)
    asked.clear()
    with torch.no_grad():
        o2, _ = cp_chunk_gated_delta_rule(**x, cp_context=cp)
    assert asked and not any(asked)
    assert torch.equal(o.detach(), o2)
