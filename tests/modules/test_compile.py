"""torch.compile(fullgraph=True) over the op and the layer, forward and backward, on the torch
backend: the op and the fused layer go through their torch.library custom ops (library_ops.py,
modules/fused_mixer.py), with no graph break, and give eager's results."""

import dataclasses

import pytest
import torch

from flash_qla_cp import GatedDeltaNet, chunk_gated_delta_rule, kept_states
from flash_qla_cp.library_ops import gdn_bwd, gdn_fwd
from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens, rel_err


def _op_loss(q, k, v, g, beta, h0, cu):
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True)
    return o.sin().sum() + s.cos().sum()


@pytest.mark.parametrize("packed", [True, False])
def test_compiled_op_matches_eager(packed):
    x = make_gdn_inputs(batch=1 if packed else 2, seq_len=130, num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    cu = random_cu_seqlens([50, 80]) if packed else None
    h0 = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    results = []
    for fn in (torch.compile(_op_loss, fullgraph=True), _op_loss):
        leaves = [t.clone().requires_grad_(True) for t in (*x.values(), h0)]
        loss = fn(*leaves, cu)
        loss.backward()
        results.append([loss, *(t.grad for t in leaves)])
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("inputs", ["dense", "packed", "padded"])
def test_compiled_layer_matches_eager(inputs):
    torch.manual_seed(0)
    m = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch").double()
    B = 1 if inputs == "packed" else 2
    kw = {"dense": {}, "packed": dict(cu_seqlens=random_cu_seqlens([30, 40])),
          "padded": dict(attention_mask=torch.tensor([[0] * 10 + [1] * 60, [1] * 70]))}[inputs]
    x = torch.randn(B, 70, 32, dtype=torch.float64)
    results = []
    for fn in (torch.compile(m, fullgraph=True), m):
        m.zero_grad()
        xl = x.clone().requires_grad_(True)
        y = fn(xl, **kw)
        y.square().sum().backward()
        results.append([y, xl.grad, *(p.grad.clone() for p in m.parameters())])
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-12


def test_custom_ops_pass_opcheck():
    """The registered ops' schemas, fake implementations and autograd agree with their real ones."""
    x = make_gdn_inputs(seq_len=70, num_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, dtype=torch.float32)
    cu = random_cu_seqlens([20, 50])
    h0 = torch.randn(2, 2, 8, 8)
    args = (*(t.requires_grad_(True) for t in x.values()), h0.requires_grad_(True), cu, 0.3, True, False, False,
            "torch", "off", "auto", True, True, True, True)
    torch.library.opcheck(gdn_fwd, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    do = torch.randn(1, 70, 2, 8)
    bwd_args = (do, torch.randn(2, 2, 8, 8), kept_states.nothing(), *(t.detach() for t in x.values()), h0.detach(),
                cu, 0.3, False, False,
                "torch", "off", "auto", True, True)
    torch.library.opcheck(gdn_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("inputs", ["dense", "packed"])
def test_compiled_layer_runs_the_fused_layer_op(inputs, monkeypatch):
    """Training-style calls of the compiled layer run the fused layer's custom op (forward and
    backward), not the step path."""
    from flash_qla_cp.modules import fused_mixer

    calls = []
    for name in ("_forward", "_backward"):
        real = getattr(fused_mixer, name)
        monkeypatch.setattr(fused_mixer, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    torch.manual_seed(0)
    m = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch").double()
    kw = {"packed": dict(cu_seqlens=random_cu_seqlens([30, 40]))}.get(inputs, {})
    x = torch.randn(1 if kw else 2, 70, 32, dtype=torch.float64, requires_grad=True)
    torch.compile(m, fullgraph=True)(x, **kw).square().sum().backward()
    assert calls == ["_forward", "_backward"]


def test_fused_layer_ops_pass_opcheck():
    from flash_qla_cp.modules import fused_mixer

    torch.manual_seed(0)
    m = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch")
    P = torch.randn(1, 50, m.projection_layout.width, requires_grad=True)
    h0 = torch.randn(2, 4, 8, 8, requires_grad=True)
    args = (P, m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight, h0, random_cu_seqlens([20, 30]),
            list(dataclasses.astuple(m.projection_layout)), False, 1e-6, 8**-0.5, "torch", "auto", True, True)
    torch.library.opcheck(fused_mixer.mixer_fwd, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_custom_ops_are_kept_out_of_captured_cuda_graphs():
    """The custom ops do host work on every call (kept chunk states filed and taken, offsets read
    back): tagged so that torch.compile's CUDA graphs (mode="reduce-overhead") leave them out."""
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("this torch has no cudagraph_unsafe tag")
    ops = torch.ops.flash_qla_cp
    for op in (ops.chunk_gated_delta_rule_fwd, ops.chunk_gated_delta_rule_bwd, ops.gdn_layer_mixer_fwd,
               ops.gdn_layer_mixer_bwd):
        assert torch.Tag.cudagraph_unsafe in op.default.tags, op


def test_compiled_layer_projects_in_an_op_of_its_own():
    """Under torch.compile the input projection runs inside `flash_qla_cp::projection_rows`, so that
    inductor cannot pad P's rows, which the fused op would then get as a contiguous copy
    (modules/projection_op.py)."""
    targets = []

    def recording_backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.manual_seed(0)
    m = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch")
    torch.compile(m, backend=recording_backend, fullgraph=True)(torch.randn(2, 70, 32))
    assert any("projection_rows" in t for t in targets), targets


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_projection_matches_eager_linear(autocast):
    """The projection op gives F.linear's rows and gradients, with autocast's casts where it is on."""
    torch.manual_seed(0)
    m = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch")
    x = torch.randn(2, 70, 32)
    results = []
    for fn in (torch.compile(m._projection_rows, fullgraph=True), m._projection_rows):
        m.zero_grad()
        xl = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            P = fn(xl)
        P.float().sin().sum().backward()
        results.append([P, xl.grad, m.in_proj_qkvz.weight.grad, m.in_proj_ba.weight.grad])
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        assert rel_err(a.double(), b.double()) < 1e-6  # the same casts and products (bf16 would differ by ~1e-3)


def test_projection_op_passes_opcheck():
    from flash_qla_cp.modules.projection_op import projection_rows

    args = (torch.randn(2, 5, 8, requires_grad=True), torch.randn(12, 8, requires_grad=True))
    torch.library.opcheck(projection_rows, args)
