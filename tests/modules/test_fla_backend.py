"""Our op served through FLA's public API (runs where fla-core is installed)."""

import pytest
import torch

fla_gdr = pytest.importorskip("fla.ops.gated_delta_rule")

from flash_qla_cp.fla_backend import register_fla_backend  # noqa: E402
from flash_qla_cp.reference import naive_recurrent_gated_delta_rule  # noqa: E402
from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens, rel_err  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert register_fla_backend()


def test_fla_api_runs_our_op_varlen_with_states():
    cu = random_cu_seqlens([33, 70])
    x = make_gdn_inputs(seq_len=103, num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
    h0 = torch.randn(2, 4, 16, 16, dtype=torch.float64)
    o, s = fla_gdr.chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10


def test_fla_api_gradients_flow_through_our_backend():
    x = {n: t.requires_grad_(True) for n, t in make_gdn_inputs(seq_len=40, head_k_dim=8, head_v_dim=8).items()}
    o, _ = fla_gdr.chunk_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True)
    o.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in x.values())


def test_fla_only_options_are_declined():
    from flash_qla_cp.fla_backend import _split_fla_call

    x = make_gdn_inputs(seq_len=8, head_k_dim=8, head_v_dim=8)
    _, declined = _split_fla_call(**x, allow_neg_eigval=True, use_gate_in_kernel=True)
    assert declined == ["allow_neg_eigval", "use_gate_in_kernel"]
    _, declined = _split_fla_call(**x, chunk_indices=None)
    assert declined == []
