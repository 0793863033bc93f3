"""The fused layer (`modules/fused_mixer.py` with the torch forms of `reference/layer_steps.py`)
against the layer's step-by-step path (torch autograd through conv, l2 norm, gates and norm), in
float64: outputs and every gradient."""

import collections
from unittest import mock

import pytest
import torch

from flash_qla_cp import GatedDeltaNet
from flash_qla_cp.reference import layer_steps as torch_steps
from flash_qla_cp.reference.layer_steps import ProjectionLayout, token_positions
from flash_qla_cp.testing import random_cu_seqlens, rel_err

D = 24


def _layer(layout, neg, dk=8, dv=16, seed=0):
    torch.manual_seed(seed)
    m = GatedDeltaNet(D, 2, 4, dk, dv, proj_layout=layout, allow_neg_eigval=neg, backend="torch",
                      dtype=torch.float64)
    with torch.no_grad():  # every part of the layer should matter
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def _outputs_and_grads(m, x, h0, **kw):
    x = x.detach().clone().requires_grad_(True)
    h0 = h0.detach().clone().requires_grad_(True)
    m.zero_grad()
    out = m(x, initial_state=h0, **kw)
    (out.square().sum() + out.sum()).backward()  # per-token terms: a sequence's part does not depend on packing
    return {"out": out.detach(), "dx": x.grad, "dh0": h0.grad, **{n: p.grad for n, p in m.named_parameters()}}


def _steps_path(m, x, h0):
    """The same call forced onto the step-by-step path."""
    m._fused_backend = lambda *args: None
    try:
        return _outputs_and_grads(m, x, h0)
    finally:
        del m._fused_backend


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("neg", [False, True])
def test_fused_layer_matches_the_step_path(layout, neg):
    m = _layer(layout, neg)
    x = torch.randn(2, 70, D, dtype=torch.float64)
    h0 = torch.randn(2, 4, 8, 16, dtype=torch.float64)
    got, want = _outputs_and_grads(m, x, h0), _steps_path(m, x, h0)
    assert got.keys() == want.keys()
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-12, name


def test_fused_layer_on_packed_sequences_matches_each_sequence_alone():
    """Zero-length, one-token and odd lengths: no conv tap and no state crosses a boundary."""
    m = _layer("qwen3_next", False)
    lengths = [3, 0, 17, 1, 2, 66]
    x = torch.randn(1, sum(lengths), D, dtype=torch.float64)
    h0 = torch.randn(len(lengths), 4, 8, 16, dtype=torch.float64)
    got = _outputs_and_grads(m, x, h0, cu_seqlens=random_cu_seqlens(lengths))
    start = 0
    for i, n in enumerate(lengths):
        if n:
            alone = _steps_path(m, x[:, start:start + n], h0[i:i + 1])
            assert rel_err(got["out"][:, start:start + n], alone["out"]) < 1e-12
            assert rel_err(got["dx"][:, start:start + n], alone["dx"]) < 1e-12
            assert rel_err(got["dh0"][i:i + 1], alone["dh0"]) < 1e-12
        else:  # the state of an empty sequence passes through: its gradient is the final one's, 0 here
            assert got["dh0"][i].abs().max() == 0
        start += n


@pytest.mark.parametrize("make", [ProjectionLayout.qwen3_next, ProjectionLayout.qwen3_5])
def test_layout_columns_cover_each_projection_column_once(make):
    """The backward fills dP from torch.empty: its steps must write every column exactly once."""
    lay = make(2, 6, 16, 8)
    cols = torch.cat([lay.conv_columns(), lay.z_columns(), lay.b_columns(), lay.a_columns()])
    assert sorted(cols.tolist()) == list(range(lay.width))


@pytest.mark.parametrize("proj_layout", ["qwen3_next", "qwen3_5"])
def test_layout_matches_the_layer_parameters(proj_layout):
    """Rows of the merged projection weight in the layout's places give the step path's q, k, v, z, b, a."""
    m = _layer(proj_layout, False)
    x = torch.randn(1, 5, D, dtype=torch.float64)
    P = torch.nn.functional.linear(x, m._projection_weight())[0]
    mixed, z, b, a = m._project(x)
    lay = m.projection_layout
    assert rel_err(P[:, lay.conv_columns()], mixed[0]) < 1e-14
    assert rel_err(P[:, lay.z_columns()], z[0].reshape(5, -1)) < 1e-14
    assert rel_err(P[:, lay.b_columns()], b[0]) < 1e-14 and rel_err(P[:, lay.a_columns()], a[0]) < 1e-14


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_inputs_step_backward_takes_dq_dk_as_per_v_head_parts(layout):
    """The op's backward may leave dq, dk as per-v-head parts [NT, HV, dk] (GVA): the inputs step's
    backward sums each qk-head's parts, the same gradients as from dq, dk summed."""
    from flash_qla_cp.reference import layer_steps

    m = _layer(layout, False)
    lay = m.projection_layout
    NT, H, HV = 37, lay.num_heads, lay.num_v_heads
    gen = torch.Generator().manual_seed(1)
    P = torch.randn(NT, lay.width, dtype=torch.float64, generator=gen)
    dq_parts, dk_parts = (torch.randn(NT, HV, lay.head_k_dim, dtype=torch.float64, generator=gen) for _ in range(2))
    rest = [torch.randn(NT, HV, lay.head_v_dim, dtype=torch.float64, generator=gen),
            *(torch.randn(NT, HV, dtype=torch.float64, generator=gen) for _ in range(2)),
            torch.randn(NT, HV, lay.head_v_dim, dtype=torch.float64, generator=gen)]
    positions = token_positions(1, NT, torch.tensor([0, 20, NT]), P.device)
    weights = (m.conv1d.weight, m.A_log, m.dt_bias)
    results = []
    for dq, dk in ((dq_parts, dk_parts), (dq_parts.view(NT, H, -1, lay.head_k_dim).sum(2),
                                          dk_parts.view(NT, H, -1, lay.head_k_dim).sum(2))):
        dP = torch.zeros_like(P)
        grads = layer_steps.op_inputs_backward(dq, dk, *rest, P, lay, *weights, positions, False, dP)
        results.append((dP, *grads[:3]))
    for got, want in zip(*results):
        assert rel_err(got, want) < 1e-13


def test_token_positions():
    assert token_positions(2, 3, None, "cpu").tolist() == [0, 1, 2, 0, 1, 2]
    cu = random_cu_seqlens([2, 0, 1, 3])
    assert token_positions(1, 6, cu, "cpu").tolist() == [0, 1, 0, 0, 1, 2]


def test_shared_token_positions_are_built_once_per_layout(monkeypatch):
    """The fused layer's token positions: the same values as `token_positions`, built once per
    layout (from the host offsets) and handed to later calls with that layout, the last
    KEPT_LAYOUTS layouts kept; offsets only on the device: formed there each call."""
    from flash_qla_cp.modules import shared_positions
    from flash_qla_cp.modules.shared_positions import shared_token_positions

    monkeypatch.setattr(shared_positions, "_kept", type(shared_positions._kept)())
    cu = random_cu_seqlens([5, 0, 130, 1])
    packed = shared_token_positions(1, 136, cu, cu.clone(), "cpu")
    assert torch.equal(packed, token_positions(1, 136, cu, "cpu"))
    assert shared_token_positions(1, 136, cu, cu.clone(), "cpu") is packed
    dense = shared_token_positions(3, 7, None, None, "cpu")
    assert torch.equal(dense, token_positions(3, 7, None, "cpu"))
    assert shared_token_positions(1, 136, cu, None, "cpu") is not packed  # (no host copy: formed anew)
    for T in range(1, shared_positions.KEPT_LAYOUTS + 1):  # pushes the packed layout out
        shared_token_positions(1, T, None, None, "cpu")
    assert len(shared_positions._kept) == shared_positions.KEPT_LAYOUTS
    again = shared_token_positions(1, 136, cu, cu.clone(), "cpu")
    assert again is not packed and torch.equal(again, packed)


def test_fused_layer_forms_positions_once_for_repeated_calls(monkeypatch):
    """Repeated fwd+bwd calls of the fused layer with one packing form its token positions once."""
    from flash_qla_cp.modules import shared_positions

    formed = []
    monkeypatch.setattr(shared_positions, "_kept", type(shared_positions._kept)())
    monkeypatch.setattr(shared_positions, "token_positions", lambda *a: formed.append(a) or token_positions(*a))
    m = GatedDeltaNet(D, 2, 4, 8, 16, dtype=torch.float64)
    cu = random_cu_seqlens([5, 0, 130, 1, 64])
    x = torch.randn(1, 200, D, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        m(x, cu_seqlens=cu).sum().backward()
    assert len(formed) == 1


@pytest.mark.parametrize("save_states", [True, False])
def test_fused_layer_keeps_the_op_inputs_for_the_backward_only_with_save_states(save_states):
    """save_states (the default): q, k, g, beta (and v, which the torch backend's backward reads)
    are saved for the backward, the autograd way (activation checkpointing drops them), and the
    backward forms no op inputs; without it the saved tensors are P, o, the parameters, the initial
    state and the token positions, and the backward re-forms them from P. Gradients are equal."""
    m = _layer("qwen3_next", False)
    m.save_states = save_states
    x = torch.randn(1, 40, D, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = m(x)
    counts = collections.Counter(saved)
    # q and k [1, 40, 2, 8]; g and beta [1, 40, 4]; v beside o [1, 40, 4, 16]
    want = {(1, 40, 2, 8): 2, (1, 40, 4): 2, (1, 40, 4, 16): 2} if save_states else \
        {(1, 40, 2, 8): 0, (1, 40, 4): 0, (1, 40, 4, 16): 1}
    assert {shape: counts[shape] for shape in want} == want, saved
    formed = []
    real = torch_steps.op_inputs_forward
    with mock.patch.object(torch_steps, "op_inputs_forward", lambda *a, **kw: formed.append(1) or real(*a, **kw)):
        y.sum().backward()
    assert formed == ([] if save_states else [1])
    grad = x.grad.clone()
    x.grad = None
    m.save_states = not save_states
    m(x).sum().backward()
    assert torch.equal(x.grad, grad)


def test_inference_keeps_nothing_for_a_backward(monkeypatch):
    """Without gradients the fused layer runs its forward alone, and asks the op to keep no chunk
    states."""
    import flash_qla_cp.modules.fused_mixer as mixer_mod

    seen = []
    real = mixer_mod.chunk_gated_delta_rule_fwd
    monkeypatch.setattr(mixer_mod, "chunk_gated_delta_rule_fwd",
                        lambda *a, **kw: seen.append(kw["save_states"]) or real(*a, **kw))
    m = _layer("qwen3_next", False)
    x = torch.randn(1, 30, D, dtype=torch.float64)
    with torch.no_grad():
        y = m(x)
    assert y.grad_fn is None and seen == [False]
    m(x.requires_grad_(True)).sum().backward()
    assert seen == [False, True]


def test_fused_layer_keeps_less_than_half_the_step_paths_activations():
    """Bytes autograd holds between forward and backward (bf16 layer, the storages saved for the
    backward): P, o and the parameters against the step path's conv inputs and outputs, split
    projections, normalised q / k, gates and norm intermediates (measured: ~0.35x)."""
    torch.manual_seed(0)
    m = GatedDeltaNet(256, 2, 4, 64, 64, backend="torch").bfloat16()
    x = torch.randn(1, 2048, 256).bfloat16().requires_grad_(True)

    def saved_bytes():
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(x)
        return sum(storages.values())

    fused = saved_bytes()
    m._fused_backend = lambda *args: None
    steps = saved_bytes()
    assert fused < 0.5 * steps, (fused, steps)


def test_backend_is_chosen_for_the_projection_dtype_under_autocast():
    """fp32 residuals under bf16 autocast project to bf16: the backend (TileLang needs bf16 / fp16)
    is chosen for that dtype, not the residual's."""
    from flash_qla_cp.modules.gated_deltanet import _projection_dtype

    x = torch.randn(1, 4, D)
    assert _projection_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _projection_dtype(x) == torch.bfloat16
        m = _layer("qwen3_next", False).float()
        assert m(x).dtype == torch.bfloat16  # out_proj under autocast: the fused path ran it
