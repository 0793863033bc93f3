"""The public op as a user calls it: values, gradients, fwd/bwd split, options and bad input."""

import pytest
import torch

from flash_qla_cp import KernelOptions, chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flash_qla_cp.reference import naive_recurrent_gated_delta_rule
from flash_qla_cp.reference.shapes import l2norm
from flash_qla_cp.testing import make_gdn_inputs, random_cu_seqlens, rel_err

NAMES = ("q", "k", "v", "g", "beta")


def _leaves(x):
    return {n: t.clone().requires_grad_(True) for n, t in x.items()}


def _inputs(seed, **kw):
    return make_gdn_inputs(generator=torch.Generator().manual_seed(seed), **kw)


def test_gradients_match_the_recurrent_reference_varlen_gva():
    lengths = [50, 3, 90]
    cu = random_cu_seqlens(lengths)
    x = _inputs(1, seq_len=sum(lengths), num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)
    h0 = torch.randn(3, 4, 16, 8, dtype=torch.float64)
    do = torch.randn(1, sum(lengths), 4, 8, dtype=torch.float64)
    dht = torch.randn(3, 4, 16, 8, dtype=torch.float64)

    grads = []
    for fn in (chunk_gated_delta_rule, naive_recurrent_gated_delta_rule):
        leaves, h = _leaves(x), h0.clone().requires_grad_(True)
        o, s = fn(**leaves, initial_state=h, output_final_state=True, cu_seqlens=cu)
        ((o * do).sum() + (s * dht).sum()).backward()
        grads.append([leaves[n].grad for n in NAMES] + [h.grad])
    for name, ours, ref in zip(NAMES + ("h0",), *grads):
        assert rel_err(ours, ref) < 1e-10, name


def test_gradcheck_against_finite_differences():
    x = _inputs(2, seq_len=20, num_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4)
    h0 = torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    leaves = _leaves(x)

    def fn(q, k, v, g, beta, h):
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
        return o, s

    assert torch.autograd.gradcheck(fn, (*[leaves[n] for n in NAMES], h0), eps=1e-6, atol=1e-6, fast_mode=True)


def test_fwd_bwd_split_equals_autograd():
    x = _inputs(3, seq_len=77, num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    h0 = torch.randn(1, 2, 16, 16, dtype=torch.float64)
    o, s, ctx = chunk_gated_delta_rule_fwd(**x, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
    do, dht = torch.randn_like(o), torch.randn_like(s)
    split = chunk_gated_delta_rule_bwd(do, dht, ctx)

    leaves, h = _leaves(x), h0.clone().requires_grad_(True)
    o2, s2 = chunk_gated_delta_rule(**leaves, initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ((o2 * do).sum() + (s2 * dht).sum()).backward()
    assert torch.equal(o, o2.detach()) and torch.equal(s, s2.detach())
    for got, leaf in zip(split, [leaves[n] for n in NAMES] + [h]):
        assert rel_err(got, leaf.grad) < 1e-12


def test_tilelang_backward_is_the_default_and_an_option_opts_out(monkeypatch):
    # a forward context that says it came from the TileLang backend (CPU tensors: the kernel
    # backward itself is replaced by a marker, only the dispatch is under test)
    from flash_qla_cp import ops

    x = _inputs(5, seq_len=40, num_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    o, _, ctx = chunk_gated_delta_rule_fwd(**x)
    ctx.backend = "tilelang"
    monkeypatch.setattr(ops, "_tilelang_bwd", lambda do, dht, ctx: "tilelang kernels")
    do = torch.randn_like(o)
    assert chunk_gated_delta_rule_bwd(do, None, ctx) == "tilelang kernels"
    _, _, ctx = chunk_gated_delta_rule_fwd(**x, kernel_options=KernelOptions(tilelang_backward=False))
    ctx.backend = "tilelang"
    grads = chunk_gated_delta_rule_bwd(do, None, ctx)  # the torch backward
    leaves = _leaves(x)
    (chunk_gated_delta_rule(**leaves)[0] * do).sum().backward()
    for got, name in zip(grads, NAMES):
        assert rel_err(got, leaves[name].grad) < 1e-12


def test_states_are_kept_only_when_a_backward_will_run(save_states_requests):
    # the forward keeps its chunk states (memory) only for a backward: inputs that need gradients
    # and save_states left on; the results do not depend on it
    asked = save_states_requests
    x = _inputs(6, seq_len=70, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=8)
    outs = []
    for save, grad in ((True, True), (False, True), (True, False)):
        leaves = {n: t.clone().requires_grad_(grad) for n, t in x.items()}
        o, _ = chunk_gated_delta_rule(**leaves, save_states=save)
        if grad:
            o.sum().backward()
            outs.append([leaves[n].grad for n in NAMES])
    assert asked == [True, False, False]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with torch.no_grad():  # nothing is recorded, e.g. activation checkpointing's first pass
        chunk_gated_delta_rule(**{n: t.clone().requires_grad_(True) for n, t in x.items()})
    assert asked[-1] is False


def test_forward_only_calls_skip_autograd_function(monkeypatch):
    # with nothing to record (no_grad, or no input needing a gradient) the op runs the forward
    # directly: autograd.Function's bookkeeping is host time a forward-only call would pay for
    # nothing. The results are those of the recorded path.
    from flash_qla_cp import ops

    x = _inputs(7, seq_len=70, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=8)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o_rec, ht_rec = chunk_gated_delta_rule(**leaves, output_final_state=True)

    def refuse(*args):
        raise AssertionError("autograd.Function used by a forward-only call")

    monkeypatch.setattr(ops._ChunkGatedDeltaRule, "apply", refuse)
    with torch.no_grad():
        o_ng, ht_ng = chunk_gated_delta_rule(**leaves, output_final_state=True)
    o_plain, ht_plain = chunk_gated_delta_rule(**x, output_final_state=True)
    for o, ht in ((o_ng, ht_ng), (o_plain, ht_plain)):
        assert not o.requires_grad and not ht.requires_grad
        assert torch.equal(o, o_rec.detach()) and torch.equal(ht, ht_rec.detach())
    with pytest.raises(AssertionError, match="forward-only"):  # a call that needs a backward still records
        chunk_gated_delta_rule(**leaves)


def test_tilelang_forward_gets_the_tilelang_backward_at_every_head_dim(monkeypatch):
    # K = V = 256 included (the walks and the V-sliced grad kernel in TileLang);
    # KernelOptions(tilelang_backward=False) sends every head dim to the torch backward
    from flash_qla_cp import ops

    chosen = []
    monkeypatch.setattr(ops, "_tilelang_bwd", lambda do, dht, ctx: chosen.append(ctx.q.shape[-1]))
    for dim in (256, 128, 64):
        x = _inputs(8, seq_len=20, num_heads=1, num_v_heads=2, head_k_dim=dim, head_v_dim=dim)
        o, _, ctx = chunk_gated_delta_rule_fwd(**x, backend="torch")
        do = torch.randn_like(o)
        want = chunk_gated_delta_rule_bwd(do, None, ctx)
        ctx.backend = "tilelang"  # as after a TileLang forward
        chunk_gated_delta_rule_bwd(do, None, ctx)
        ctx.options = KernelOptions(tilelang_backward=False)
        got = chunk_gated_delta_rule_bwd(do, None, ctx)
        assert all(torch.equal(a, b) for a, b in zip(got[:5], want[:5]))
    assert chosen == [256, 128, 64]


def test_l2norm_option_equals_normalising_first():
    x = _inputs(4, seq_len=65, num_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    raw = dict(x, q=x["q"] * 3.0, k=x["k"] * 0.5)
    o, _ = chunk_gated_delta_rule(**raw, use_qk_l2norm_in_kernel=True)
    o_ref, _ = naive_recurrent_gated_delta_rule(**dict(raw, q=l2norm(raw["q"]), k=l2norm(raw["k"])))
    assert rel_err(o, o_ref) < 1e-10


def test_state_v_first_is_the_transposed_layout():
    x = _inputs(5, seq_len=40, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=8)
    h0 = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    o, s = chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True)
    o_t, s_t = chunk_gated_delta_rule(**x, initial_state=h0.transpose(-1, -2).contiguous(),
                                      output_final_state=True, state_v_first=True)
    assert rel_err(o_t, o) < 1e-14
    assert rel_err(s_t.transpose(-1, -2), s) < 1e-14


def test_torch_backward_with_l2norm_and_v_first_states_matches_autograd():
    # the op's torch backward (hand-written walks) against autograd through the chunked torch
    # forward, with the options it handles around the walks: q / k normalised in the op,
    # [N, HV, V, K] states, an initial state and a final-state gradient
    from flash_qla_cp.reference import chunk_gated_delta_rule_torch

    lengths = [70, 5, 64]
    cu = random_cu_seqlens(lengths)
    x = _inputs(11, seq_len=sum(lengths), num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=8)
    x = dict(x, q=x["q"] * 3.0, k=x["k"] * 0.5)  # not unit length: the normalisation matters
    gen = torch.Generator().manual_seed(12)
    h0 = torch.randn(3, 2, 8, 16, generator=gen, dtype=torch.float64)
    do = torch.randn(1, sum(lengths), 2, 8, generator=gen, dtype=torch.float64)
    dht = torch.randn(3, 2, 8, 16, generator=gen, dtype=torch.float64)
    opts = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, state_v_first=True)

    grads = []
    for op in (chunk_gated_delta_rule, chunk_gated_delta_rule_torch):
        leaves = _leaves(x)
        h0_leaf = h0.clone().requires_grad_(True)
        o, ht = op(**leaves, initial_state=h0_leaf, **opts)
        ((o * do).sum() + (ht * dht).sum()).backward()
        grads.append([leaves[n].grad for n in NAMES] + [h0_leaf.grad])
    for name, got, want in zip((*NAMES, "h0"), *grads):
        assert rel_err(got, want) < 1e-10, name


def test_results_are_deterministic():
    x = make_gdn_inputs(seq_len=200, dtype=torch.bfloat16)
    first = chunk_gated_delta_rule(**x, output_final_state=True)
    second = chunk_gated_delta_rule(**x, output_final_state=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_no_nan_under_extreme_decay():
    x = _inputs(6, seq_len=130, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    x["g"] = torch.full_like(x["g"], -80.0)  # exp(G) underflows inside a chunk
    leaves = _leaves(x)
    o, s = chunk_gated_delta_rule(**leaves, output_final_state=True)
    (o.sum() + s.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert all(torch.isfinite(leaves[n].grad).all() for n in NAMES)


# --- bad input: a clear error, never a silent wrong answer -------------------------------------


def _good(**kw):
    return make_gdn_inputs(batch=1, seq_len=16, num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, **kw)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda x: x.update(q=x["q"][..., :4]), "same shape"),
        (lambda x: x.update(v=x["v"][:, :, :3]), "multiple"),
        (lambda x: x.update(g=x["g"][..., :2]), "g must be"),
        (lambda x: x.update(beta=x["beta"][:, :8]), "beta must be"),
        (lambda x: x.update(q=x["q"][0], k=x["k"][0]), "4-D"),
        (lambda x: x.update(v=x["v"].long()), "floating"),
        (lambda x: x.update(k=x["k"].float()), "one dtype"),
        (lambda x: x.update({n: t[:0] for n, t in x.items()}), "B = 0"),
        (lambda x: x.update(q=x["q"][:, :, :0], k=x["k"][:, :, :0]), "H = 0"),
        (lambda x: x.update(q=x["q"][..., :0], k=x["k"][..., :0]), "K = 0"),
        (lambda x: x.update(v=x["v"][..., :0]), "V = 0"),
        (lambda x: x.update(q=x["q"].tolist()), "q must be a torch.Tensor"),
        (lambda x: x.update(beta=0.5), "beta must be a torch.Tensor"),
        (lambda x: x.update(v=x["v"].half()), "one dtype"),
    ],
)
def test_bad_shapes_and_dtypes(mutate, message):
    x = _good()
    mutate(x)
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule(**x)


def test_cu_seqlens_with_batch_above_one():
    x = make_gdn_inputs(batch=2, seq_len=16, num_heads=1, num_v_heads=1, head_k_dim=8, head_v_dim=8)
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_gated_delta_rule(**x, cu_seqlens=random_cu_seqlens([8, 8]))


@pytest.mark.parametrize("edges", [[0, 10, 5, 16], [0, 8, 15], [1, 8, 16], [16]])
def test_bad_cu_seqlens(edges):
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(**_good(), cu_seqlens=torch.tensor(edges, dtype=torch.int32))


def test_device_cu_seqlens_is_checked_on_its_host_copy():
    # a GPU cu_seqlens with cu_seqlens_cpu is validated on the host copy (no read-back, so the
    # call can be captured in a CUDA graph); a "meta" tensor stands in for the GPU one here: it
    # has no values, so reading it back would fail
    from flash_qla_cp.validation import check_inputs

    x = _good()
    on_device = torch.empty(3, dtype=torch.int32, device="meta")
    assert check_inputs(**x, cu_seqlens=on_device, cu_seqlens_cpu=torch.tensor([0, 5, 16], dtype=torch.int32)) == 2
    with pytest.raises(ValueError, match="cu_seqlens_cpu must be a CPU tensor"):
        check_inputs(**x, cu_seqlens=on_device, cu_seqlens_cpu=torch.tensor([0, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        check_inputs(**x, cu_seqlens=on_device, cu_seqlens_cpu=torch.tensor([0, 17, 16], dtype=torch.int32))


def test_host_copy_of_cpu_cu_seqlens_must_match():
    # where cu_seqlens is itself on the CPU the copy's values are compared (no read-back needed)
    x = _good()
    edges = torch.tensor([0, 5, 16], dtype=torch.int32)
    assert chunk_gated_delta_rule(**x, cu_seqlens=edges, cu_seqlens_cpu=edges.long())[0].shape[1] == 16
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu \[0, 9, 16\] differs from cu_seqlens \[0, 5, 16\]"):
        chunk_gated_delta_rule(**x, cu_seqlens=edges, cu_seqlens_cpu=torch.tensor([0, 9, 16], dtype=torch.int32))


def test_host_cu_seqlens_with_device_inputs_rejected():
    # the kernels would read a host address; a "meta" device stands in for the GPU here
    from flash_qla_cp.validation import check_inputs

    x = {n: t.to("meta") for n, t in _good().items()}
    with pytest.raises(ValueError, match="cu_seqlens is a CPU tensor but the inputs are on meta"):
        check_inputs(**x, cu_seqlens=torch.tensor([0, 5, 16], dtype=torch.int32))


def test_float_cu_seqlens_rejected():
    with pytest.raises(ValueError, match="int32"):
        chunk_gated_delta_rule(**_good(), cu_seqlens=torch.tensor([0.0, 16.0]))


def test_initial_state_of_wrong_shape_or_dtype():
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(**_good(), initial_state=torch.zeros(1, 4, 8, 4))
    with pytest.raises(ValueError, match="float32"):
        chunk_gated_delta_rule(**_good(), initial_state=torch.zeros(1, 4, 8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[N, HV, K, V\]"):
        chunk_gated_delta_rule(**_good(), initial_state=torch.zeros(2, 4, 8, 8))


def test_unknown_or_unavailable_backend():
    with pytest.raises(ValueError, match="backend"):
        chunk_gated_delta_rule(**_good(), backend="cuda")
    with pytest.raises(NotImplementedError, match="CUDA"):
        chunk_gated_delta_rule(**_good(), backend="tilelang")


def test_head_first_rejected():
    with pytest.raises(ValueError, match="head_first"):
        chunk_gated_delta_rule(**_good(), head_first=True)


@pytest.mark.parametrize("scale", [torch.tensor(0.5), "x", True])
def test_scale_must_be_a_python_number(scale):
    # a tensor scale would get no gradient; anything else is a mistake
    with pytest.raises(ValueError, match="scale must be a Python float"):
        chunk_gated_delta_rule(**_good(), scale=scale)
    assert chunk_gated_delta_rule(**_good(), scale=1)[0].shape[-1] == 8  # an int is a number


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_scale_must_be_finite(scale):
    # every output would be NaN
    with pytest.raises(ValueError, match="scale must be finite"):
        chunk_gated_delta_rule(**_good(), scale=scale)


def test_input_modified_in_place_before_backward_raises():
    # as torch ops do: the gradients would be those of other values
    x = {n: t.clone().requires_grad_(True) for n, t in _good().items()}
    q = x["q"] * 1.0  # a non-leaf, so that it may be modified in place
    o, _ = chunk_gated_delta_rule(**dict(x, q=q))
    q.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


def test_input_modified_in_place_under_cp_raises():
    from flash_qla_cp import CPContext

    x = {n: t.clone().requires_grad_(True) for n, t in _good().items()}
    cp = CPContext.single(random_cu_seqlens([16]), intra_cp="off")
    g = x["g"] * 1.0
    o, _ = chunk_gated_delta_rule(**dict(x, g=g), cp_context=cp)
    g.add_(-1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()
