"""The layer's Hopper kernels around the op (`kernels/layer.py`) against their torch forms
(`reference/layer_steps.py`), and the fused GatedDeltaNet layer against float64."""

import pytest
import torch

from flash_qla_cp import GatedDeltaNet, kept_states
from flash_qla_cp.modules import GDNCache
from flash_qla_cp.kernels import layer as kernel_steps
from flash_qla_cp.reference import layer_steps as torch_steps
from flash_qla_cp.reference.layer_steps import ProjectionLayout, continued_positions, token_positions
from flash_qla_cp.testing import random_cu_seqlens, rel_err

LENGTHS = [1, 0, 63, 64, 65, 2, 700, 1500]  # one block's tokens span several sequences
CONFIGS = [  # (layout, dtype, allow_neg_eigval)
    (ProjectionLayout.qwen3_next(2, 4, 128, 128), torch.bfloat16, False),
    (ProjectionLayout.qwen3_5(2, 4, 64, 128), torch.float16, True),
]


def _params(lay, gen):
    C = 2 * lay.num_heads * lay.head_k_dim + lay.num_v_heads * lay.head_v_dim
    conv = torch.randn(C, 1, 4, generator=gen) * 0.5
    A_log = torch.rand(lay.num_v_heads, generator=gen).mul(15).add(1).log()
    dt_bias = torch.randn(lay.num_v_heads, generator=gen)
    norm = 1 + 0.2 * torch.randn(lay.head_v_dim, generator=gen)
    return [t.cuda() for t in (conv, A_log, dt_bias, norm)]


@pytest.mark.parametrize("history", [False, True], ids=["", "cp_history"])
@pytest.mark.parametrize("lay,dtype,neg", CONFIGS, ids=["qwen3_next_bf16", "qwen3_5_fp16_neg"])
def test_layer_step_kernels_are_their_torch_forms(lay, dtype, neg, history):
    """Both steps, forward and backward; with `history`, the first sequence continues the conv
    inputs of a previous rank (context parallelism) and the history's gradient is compared too."""
    gen = torch.Generator().manual_seed(0)
    lengths = [2, *LENGTHS[1:]] if history else LENGTHS  # 2 continuing tokens: fewer than the history
    NT = sum(lengths)
    P = (torch.randn(NT, lay.width, generator=gen) * 2).to(dtype).cuda()
    P[:5, lay.a_columns()] = torch.tensor([30.0, -30.0, 0.0, 19.9, 20.1], dtype=dtype).cuda()[:, None]  # softplus ends
    P[5, lay.a_columns()] = P[5, lay.b_columns()] = float("-inf")  # g = beta = 0 (a cache's history rows)
    conv, A_log, dt_bias, norm = _params(lay, gen)
    positions = token_positions(1, NT, random_cu_seqlens(lengths), "cuda")
    hist = None
    if history:
        hist = torch.randn(3, conv.shape[0], generator=gen).to(dtype).cuda()
        positions = continued_positions(positions, lengths[0], 3)
    HV = lay.num_v_heads
    fwd = {}
    for name, steps in (("kernel", kernel_steps), ("torch", torch_steps)):
        fwd[name] = steps.op_inputs_forward(P, lay, conv, A_log, dt_bias, positions, neg, history=hist)
    for got, want in zip(fwd["kernel"], fwd["torch"]):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) < (1e-5 if got.dtype == torch.float32 else 2e-3)

    grads = [torch.randn(t.shape, generator=gen).to(t.dtype).cuda() for t in fwd["torch"]]
    o = torch.randn(NT, HV, lay.head_v_dim, generator=gen).to(dtype).cuda()
    dy = torch.randn(NT, HV * lay.head_v_dim, generator=gen).to(dtype).cuda()
    out = {}
    for name, steps in (("kernel", kernel_steps), ("torch", torch_steps)):
        dP = torch.full_like(P, float("nan"))
        y = steps.gated_norm_forward(o, P, lay, norm, 1e-6)
        do, dz, dnorm = steps.gated_norm_backward(dy, o, P, lay, norm, 1e-6)
        dconv, dA, ddt, dhist = steps.op_inputs_backward(*grads, dz, P, lay, conv, A_log, dt_bias, positions, neg,
                                                         dP, history=hist)
        out[name] = dict(y=y, do=do, dnorm=dnorm, dP=dP, dconv=dconv, dA=dA, ddt=ddt)
        if history:
            out[name]["dhistory"] = dhist
    for key, want in out["torch"].items():
        got = out["kernel"][key]
        assert got.shape == want.shape and got.dtype == want.dtype, key
        assert rel_err(got, want) < (1e-4 if got.dtype == torch.float32 else 3e-3), key


def _model(proj_layout, dtype, seed=0):
    torch.manual_seed(seed)
    m = GatedDeltaNet(512, 2, 4, 128, 128, proj_layout=proj_layout, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        m.norm.weight.add_(0.2 * torch.randn_like(m.norm.weight))
    return m.to(dtype)


def _layer_outputs(m, x, cu, run=None, **kw):
    """Output and gradients of one fwd+bwd of layer m (called through `run`, e.g. compiled, if given)."""
    x = x.detach().clone().requires_grad_(True)
    m.zero_grad()
    out = (m if run is None else run)(x, cu_seqlens=cu, **kw)
    (out.double().square().sum() + out.double().sum()).backward()
    return {"out": out.detach(), "dx": x.grad, **{n: p.grad for n, p in m.named_parameters()}}


@pytest.mark.parametrize("proj_layout", ["qwen3_next", "qwen3_5"])
def test_fused_layer_is_as_accurate_as_the_step_path_and_deterministic(proj_layout, monkeypatch):
    """The bf16 layer through the fused kernels and through the step path (torch conv and norms
    around the op), each against the float64 layer of the same weights: the fused one no worse
    (within 10%) on the output and every gradient, and bitwise repeatable."""
    m = _model(proj_layout, torch.bfloat16)
    cu = random_cu_seqlens(LENGTHS, device="cuda")
    x = torch.randn(1, sum(LENGTHS), 512, device="cuda").bfloat16()
    fused = [_layer_outputs(m, x, cu) for _ in range(2)]
    differ = [k for k in fused[0] if not torch.equal(fused[0][k], fused[1][k])]
    assert not differ, f"not deterministic: {differ}"
    reference = _model(proj_layout, torch.float64)
    reference.load_state_dict(m.state_dict())
    reference.backend = "torch"
    want = _layer_outputs(reference, x.double(), cu)
    with monkeypatch.context() as patch:
        patch.setattr(GatedDeltaNet, "_fused_backend", lambda self, *args: None)
        steps = _layer_outputs(m, x, cu)
    fused_errs = {k: rel_err(fused[0][k], want[k]) for k in want}
    step_errs = {k: rel_err(steps[k], want[k]) for k in want}
    worse = {k: (fused_errs[k], step_errs[k]) for k in want if not fused_errs[k] <= 1.1 * step_errs[k] + 1e-4}
    assert not worse, worse


@pytest.mark.parametrize("proj_layout", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed_split", "dense"])
def test_inference_walk_applies_the_gated_norm_within_limits(proj_layout, packed, monkeypatch):
    """Under no_grad, at shapes whose walk holds whole rows of o (four warpgroups: long packed
    sequences split into partitions, or enough dense rows), the op's walk applies the gated norm
    and no norm kernel runs: the output against the float64 layer no worse (within 10%) than the
    training forward's (o stored, then the norm kernel), within 1e-2 of it, finite, and repeatable
    bit for bit."""
    norm_calls = []
    real = kernel_steps.gated_norm_forward
    monkeypatch.setattr(kernel_steps, "gated_norm_forward", lambda *a, **kw: norm_calls.append(1) or real(*a, **kw))
    m = _model(proj_layout, torch.bfloat16)
    if packed:  # odd and zero lengths; partial last chunks; split into >= 30 partitions (x 4 v-heads:
        # the grid fills an H100 / H200, so the walk is the four-warpgroup one)
        cu = random_cu_seqlens([20000, 1, 0, 30000, 63, 16001], device="cuda")
        x = torch.randn(1, int(cu[-1]), 512, device="cuda").bfloat16()
    else:  # 40 rows x 4 v-heads: 160 walks; 333 tokens: a partial chunk per row
        cu = None
        x = torch.randn(40, 333, 512, device="cuda").bfloat16()
    with torch.no_grad():
        got = [m(x, cu_seqlens=cu) for _ in range(2)]
    assert not norm_calls, "the norm kernel ran: the walk did not apply the norm"
    assert torch.equal(got[0], got[1]) and torch.isfinite(got[0]).all()
    trained = m(x.clone().requires_grad_(True), cu_seqlens=cu).detach()
    assert norm_calls
    reference = _model(proj_layout, torch.float64)
    reference.load_state_dict(m.state_dict())
    reference.backend = "torch"
    with torch.no_grad():
        want = reference(x.double(), cu_seqlens=cu)
    walk_err, trained_err = rel_err(got[0], want), rel_err(trained, want)
    assert walk_err <= 1.1 * trained_err + 1e-4, (walk_err, trained_err)
    assert rel_err(got[0], trained) < 1e-2


def test_packed_fused_forward_makes_no_blocking_read_back():
    """A packed call of the fused layer reads cu_seqlens back without a blocking copy (into pinned
    memory behind an event, waited for after the projection is launched: `offsets_read_back.py`),
    and the op reads nothing back: under torch's sync debug mode ('error') a training forward and
    an inference forward run (after a first call that compiles) without a synchronising call, each
    given a new cu_seqlens tensor (the same tensor, unchanged, is not read back again)."""
    m = _model("qwen3_next", torch.bfloat16)
    cu = random_cu_seqlens(LENGTHS, device="cuda")
    x = torch.randn(1, sum(LENGTHS), 512, device="cuda").bfloat16().requires_grad_(True)
    m(x, cu_seqlens=cu).float().sum().backward()  # compiles, plans, warms the allocators
    with torch.no_grad():
        want = m(x, cu_seqlens=cu)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = m(x, cu_seqlens=cu.clone())
        with torch.no_grad():
            again = m(x, cu_seqlens=cu.clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # (the training forward runs the op's state-keeping kernel variant: equal up to rounding)
    assert torch.equal(again, want) and rel_err(out.detach(), want) < 1e-3


def test_a_packed_call_refuses_cuda_graph_capture_even_with_its_offsets_kept():
    """After a call has kept cu_seqlens' host copy, a capture of the same call would no longer
    fail on the read-back: the layer refuses it itself (a replay would keep the captured plan)."""
    m = _model("qwen3_next", torch.bfloat16)
    cu = random_cu_seqlens(LENGTHS, device="cuda")
    x = torch.randn(1, sum(LENGTHS), 512, device="cuda").bfloat16()
    with torch.no_grad():
        m(x, cu_seqlens=cu)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="cannot be captured in a CUDA graph"):
        with torch.no_grad(), torch.cuda.graph(graph):
            m(x, cu_seqlens=cu)


def test_training_shaped_layer_split_inside_packed_sequences_within_limits():
    """The training recipe's layer (hidden 1024, 8 / 16 heads) on two packed sequences long enough
    for the intra-card split ('auto'): the fused bf16 layer against the float64 layer, output and
    every gradient within 2e-2 (the layer's bf16 errors measured 6e-3 to 9e-3 at 4k tokens; a wrong
    split backward gives errors of order 1) and deterministic."""
    torch.manual_seed(0)
    m = GatedDeltaNet(1024, 8, 16, 128, 128, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    cu = torch.tensor([0, 40000, 65536], dtype=torch.int32, device="cuda")
    x = torch.randn(1, 65536, 1024, device="cuda").bfloat16()
    fused = [_layer_outputs(m, x, cu) for _ in range(2)]
    differ = [k for k in fused[0] if not torch.equal(fused[0][k], fused[1][k])]
    assert not differ, f"not deterministic: {differ}"
    reference = GatedDeltaNet(1024, 8, 16, 128, 128, device="cuda", dtype=torch.float64, backend="torch")
    reference.load_state_dict(m.state_dict())
    want = _layer_outputs(reference, x.double(), cu)
    errs = {k: rel_err(fused[0][k], want[k]) for k in want}
    assert all(e <= 2e-2 for e in errs.values()), errs


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dense"])
def test_compiled_layer_matches_the_eager_fused_layer(packed):
    """torch.compile(fullgraph=True) of the training recipe's layer on sequences long enough for the
    intra-card split: its custom ops run the eager layer's kernels, the backward on the chunk states
    the forward kept (handed over by handle), so output and gradients match the eager fused
    layer's (bf16 rounding of the compiled projections aside: within 2e-3), and no kept states are
    left behind."""
    torch.manual_seed(0)
    m = GatedDeltaNet(1024, 8, 16, 128, 128, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    cu = torch.tensor([0, 40000, 65536], dtype=torch.int32, device="cuda") if packed else None
    x = torch.randn(1, 65536, 1024, device="cuda").bfloat16()
    eager = _layer_outputs(m, x, cu)
    compiled = _layer_outputs(m, x, cu, run=torch.compile(m, fullgraph=True))
    errs = {k: rel_err(compiled[k], eager[k]) for k in eager}
    assert all(e <= 2e-3 for e in errs.values()), errs
    assert kept_states.filed() == 0


@pytest.mark.parametrize("proj_layout", ["qwen3_next", "qwen3_5"])
def test_prefill_with_use_cache_runs_fused_within_limits(proj_layout, monkeypatch):
    """A prompt's prefill (use_cache=True, no cache in, no_grad) on the fused kernels: output and
    recurrent state against the float64 layer no worse (within 10%) than the step path's; the conv
    state (the last K - 1 conv inputs per sequence) equal to the step path's within bf16 rounding;
    one decoding step on from it matches one from the step path's cache."""
    import flash_qla_cp.modules.gated_deltanet as gdn_mod

    fused_calls = []
    real = gdn_mod.fused_mixer_with_states
    monkeypatch.setattr(gdn_mod, "fused_mixer_with_states", lambda *a, **kw: fused_calls.append(1) or real(*a, **kw))
    m = _model(proj_layout, torch.bfloat16)
    cu = random_cu_seqlens(LENGTHS, device="cuda")
    x = torch.randn(1, sum(LENGTHS), 512, device="cuda").bfloat16()
    step = torch.randn(len(LENGTHS), 1, 512, device="cuda").bfloat16()
    reference = _model(proj_layout, torch.float64)
    reference.load_state_dict(m.state_dict())
    reference.backend = "torch"
    with torch.no_grad():
        out, cache = m(x, cu_seqlens=cu, use_cache=True)
        assert fused_calls == [1]
        after, _ = m(step, cache=cache, use_cache=True)
        want, want_cache = reference(x.double(), cu_seqlens=cu, use_cache=True)
        with monkeypatch.context() as patch:
            patch.setattr(GatedDeltaNet, "_fused_backend", lambda self, *args: None)
            steps, steps_cache = m(x, cu_seqlens=cu, use_cache=True)
            steps_after, _ = m(step, cache=steps_cache, use_cache=True)
    for got, alt, ref in ((out, steps, want), (cache.recurrent_state, steps_cache.recurrent_state,
                                                 want_cache.recurrent_state)):
        assert rel_err(got, ref) <= 1.1 * rel_err(alt, ref) + 1e-4, (rel_err(got, ref), rel_err(alt, ref))
    assert rel_err(cache.conv_state, steps_cache.conv_state) < 1e-2
    assert rel_err(after, steps_after) < 2e-2


@pytest.mark.parametrize("proj_layout", ["qwen3_next", "qwen3_5"])
def test_continuing_a_cache_runs_fused_within_limits(proj_layout, monkeypatch):
    """A cache in on the fused kernels (its conv state as rows in front of each sequence, gates
    there -inf): a prompt continued by a second piece (empty ones too), then one decoding step;
    outputs and states against the float64 layer no worse (within 10%) than the step path's or
    within 5e-3, and so with a backward (no states out) the gradients of the input, the cache and
    the parameters."""
    import flash_qla_cp.modules.gated_deltanet as gdn_mod

    fused_calls = []
    for name in ("fused_mixer", "fused_mixer_with_states"):
        real = getattr(gdn_mod, name)
        monkeypatch.setattr(gdn_mod, name, lambda *a, _real=real, **kw: fused_calls.append(1) or _real(*a, **kw))
    m = _model(proj_layout, torch.bfloat16)
    reference = _model(proj_layout, torch.float64)
    reference.load_state_dict(m.state_dict())
    reference.backend = "torch"
    gen = torch.Generator().manual_seed(1)
    N, C = len(LENGTHS), m.conv_dim
    cache = GDNCache(torch.randn(N, C, 3, generator=gen).bfloat16().cuda(),
                     (0.3 * torch.randn(N, 4, 128, 128, generator=gen)).cuda())
    cache64 = GDNCache(cache.conv_state.double(), cache.recurrent_state.double())
    pieces = [3, 0, 70, 1, 64, 0, 5, 130]
    cu = random_cu_seqlens(pieces, device="cuda")
    x = torch.randn(1, sum(pieces), 512, generator=gen).bfloat16().cuda()
    step = torch.randn(N, 1, 512, generator=gen).bfloat16().cuda()

    def run(model, dtype, cache):
        with torch.no_grad():
            out, mid = model(x.to(dtype), cu_seqlens=cu, cache=cache, use_cache=True)
            after, end = model(step.to(dtype), cache=mid, use_cache=True)
        return {"out": out, "state": mid.recurrent_state, "after": after, "end_state": end.recurrent_state,
                "conv_state": end.conv_state}

    def grads(model, dtype, cache):
        xs = x.to(dtype).detach().clone().requires_grad_(True)
        conv = cache.conv_state.clone().requires_grad_(True)
        state = cache.recurrent_state.clone().requires_grad_(True)
        model.zero_grad()
        out = model(xs, cu_seqlens=cu, cache=GDNCache(conv, state))
        (out.double().square().sum() + out.double().sum()).backward()
        return {"dx": xs.grad, "dconv_state": conv.grad, "dstate": state.grad,
                **{n: p.grad for n, p in model.named_parameters()}}

    got = {**run(m, torch.bfloat16, cache), **grads(m, torch.bfloat16, cache)}
    assert len(fused_calls) == 3
    with monkeypatch.context() as patch:
        patch.setattr(GatedDeltaNet, "_fused_backend", lambda self, *args: None)
        steps = {**run(m, torch.bfloat16, cache), **grads(m, torch.bfloat16, cache)}
    assert len(fused_calls) == 3
    want = {**run(reference, torch.float64, cache64), **grads(reference, torch.float64, cache64)}
    assert rel_err(got.pop("conv_state"), steps.pop("conv_state")) < 1e-2  # the same inputs, projected apart
    want.pop("conv_state")
    errs = {k: (rel_err(got[k], want[k]), rel_err(steps[k], want[k])) for k in want}
    # (a gradient summed over few tokens, A_log's, may land either side of the step path's: 5e-3 passes)
    worse = {k: e for k, e in errs.items() if not (e[0] <= 1.1 * e[1] + 1e-4 or e[0] <= 5e-3)}
    assert not worse, worse
